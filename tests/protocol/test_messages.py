"""Control messages (protocol/messages.py): one typed message per op; what a peer may send is checked before any
handler sees it."""

import dataclasses
import json

import pytest

from gradwire.errors import RemoteProtocolError
from gradwire.protocol import messages
from gradwire.protocol.messages import MESSAGES


def _example(cls):
    """A message of `cls` with every field set away from its default (so each one travels)."""
    values = {}
    for f in dataclasses.fields(cls):
        kind = str(f.type)
        if kind.startswith("int"):
            values[f.name] = 7
        elif kind.startswith("float"):
            values[f.name] = 2.5
        elif kind.startswith("bool"):
            values[f.name] = f.default is not True
        elif kind.startswith("str"):
            values[f.name] = "why"
        elif kind.startswith("list"):
            values[f.name] = [1, 2]
        elif kind.startswith("dict"):
            values[f.name] = {"a": 1}
        else:
            values[f.name] = {"any": [1]}
    return cls(**values)


@pytest.mark.parametrize("op", sorted(MESSAGES))
def test_every_message_travels_as_json_and_comes_back_equal(op):
    message = _example(MESSAGES[op])
    body = json.loads(json.dumps(message.encode()))
    assert body["op"] == op
    assert messages.parse(body) == message


@pytest.mark.parametrize("op", sorted(MESSAGES))
def test_a_message_at_its_defaults_still_names_its_required_fields(op):
    cls = MESSAGES[op]
    body = cls().encode()
    assert set(cls.always) <= set(body)
    assert messages.parse(body) == cls() or issubclass(cls, messages.Request)  # a request's id is given as sent


@pytest.mark.parametrize(
    "body, why",
    [
        ({"op": "nope"}, "unknown control op 'nope'"),
        ({"name": "x"}, "unknown control op None"),
        ({"op": "recut"}, "lacks number"),
        ({"op": "declare", "name": "x", "shape": [1], "dtype": "float32"}, "lacks id"),
        ({"op": "recut", "number": "7"}, "field number is '7'"),
        ({"op": "recut", "number": 7.5}, "field number is 7.5"),
        ({"op": "recut", "number": True}, "field number is True"),
        ({"op": "members", "joining": None}, "field joining is None"),
        ({"op": "recut", "number": 7, "extra": 1}, "unknown field"),
        ({"op": "heartbeat", "stats": [1]}, "field stats is"),
        ({"op": "reply"}, "lacks id"),
        ({"op": "reply", "id": "1"}, "field id is '1'"),
    ],
)
def test_a_malformed_body_is_refused_saying_what_is_wrong(body, why):
    with pytest.raises(RemoteProtocolError, match=why):
        messages.parse(body)


def test_json_numbers_take_their_field_s_type():
    """JSON has one kind of number: a whole float is an int field's, an int a float field's."""
    assert messages.parse({"op": "recut", "number": 7.0}) == messages.Recut(7)
    result = messages.parse({"op": "probe_result", "down": 3})
    assert isinstance(result, messages.ProbeResult) and isinstance(result.down, float)


def test_a_reply_carries_its_result_beside_the_id():
    body = messages.Reply(3, {"error": "no", "lost_rank": 1}).encode()
    assert body == {"op": "reply", "id": 3, "error": "no", "lost_rank": 1}
    reply = messages.parse(body)
    assert isinstance(reply, messages.Reply) and reply.error == "no" and reply.result["lost_rank"] == 1


def test_a_reply_s_result_cannot_pass_for_another_op():
    with pytest.raises(ValueError, match="op or id"):
        messages.Reply(1, messages.Recut(3).encode()).encode()


def test_a_rejoin_s_reply_reads_as_an_address_book():
    book = messages.AddressBook(rank=2, epoch=3, num_workers=4, servers=[{"host": "h"}], wall_time=1.5)
    reply = messages.parse(messages.Reply(9, book.fields()).encode())
    assert isinstance(reply, messages.Reply)
    assert messages.address_book(reply.result) == book
