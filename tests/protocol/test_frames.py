import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradwire.errors import RemoteProtocolError
from gradwire.protocol import frames
from gradwire.protocol.frames import FrameType

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@given(
    ftype=st.sampled_from([FrameType.PUSHPULL, FrameType.RESULT]),
    dtype=st.sampled_from([1, 2, 3, 4, 5, 6]),
    elements=st.integers(0, 1 << 20),
    epoch=u32,
    sender=u32,
    key=u64,
    rnd=u32,
)
def test_data_header_round_trip(ftype, dtype, elements, epoch, sender, key, rnd):
    itemsize = {1: 2, 2: 4, 3: 8, 4: 4, 5: 8, 6: 2}[dtype]
    buf = bytearray(frames.HEADER_SIZE)
    frames.pack_header_into(buf, ftype, elements * itemsize, dtype, epoch, sender, key, rnd)
    h = frames.decode_header(buf, max_payload=8 << 20)
    assert (h.type, h.dtype, h.epoch, h.sender, h.key, h.round, h.length) == (
        ftype,
        dtype,
        epoch,
        sender,
        key,
        rnd,
        elements * itemsize,
    )


@given(body=st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=5))
def test_json_frame_round_trip(body):
    raw = frames.encode_json(FrameType.CONTROL, body, epoch=3)
    h = frames.decode_header(raw[: frames.HEADER_SIZE], 0)
    assert h.type == FrameType.CONTROL and h.epoch == 3
    assert frames.decode_json(raw[frames.HEADER_SIZE :]) == body


def _header(**overrides):
    fields = dict(
        magic=frames.MAGIC, version=1, type=4, flags=0, dtype=2, epoch=0, sender=0, key=0, round=0, status=0, length=16
    )
    fields.update(overrides)
    return struct.pack("<IBBBBIIQIIQ", *fields.values())


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (dict(magic=0xDEADBEEF), "bad magic"),
        (dict(version=9), "protocol version 9"),
        (dict(type=99), "unknown frame type 99"),
        (dict(dtype=42), "unknown dtype code 42"),
        (dict(length=1 << 40), "exceeds the maximum"),
        (dict(length=6), "not a whole number"),
        (dict(type=3, length=1 << 30), "exceeds"),
    ],
)
def test_bad_headers_are_refused_with_a_reason(overrides, needle):
    with pytest.raises(RemoteProtocolError, match=needle):
        frames.decode_header(_header(**overrides), max_payload=1 << 20)


@pytest.mark.parametrize("payload", [b"not json", b"[1, 2]", b"\xff\xfe"])
def test_control_body_must_be_a_json_object(payload):
    with pytest.raises(RemoteProtocolError):
        frames.decode_json(payload)
