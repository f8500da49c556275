"""A control message: a dataclass whose fields and their types are its whole vocabulary (protocol/messages.py
defines one per op). `decode` checks a received body against the class (every required field, no unknown field, each
value of its type); `Message.encode` makes the body to send.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from gradwire.errors import RemoteProtocolError


@dataclass
class Message:
    """A control message; subclasses name their `op` and declare their fields."""

    op: ClassVar[str]
    # fields sent even at their default (the rest are left out of the body then)
    always: ClassVar[tuple[str, ...]] = ()

    def fields(self) -> dict:
        """Its fields as the body has them, without the op (a reply's result may be another message's fields)."""
        return {k: v for k, v in self.encode().items() if k != "op"}

    def encode(self) -> dict:
        """The body to send."""
        body: dict = {"op": self.op}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in self.always or not _is_default(f, value):
                body[f.name] = value
        return body


@dataclass
class Request(Message):
    """A message the sender waits on: the answer is a `Reply` with the same `id` (given as the request is sent)."""

    id: int = -1

    def encode(self) -> dict:
        return super().encode() | {"id": self.id}


def _is_default(f: dataclasses.Field, value: object) -> bool:
    if f.default is not dataclasses.MISSING:
        return value == f.default
    if f.default_factory is not dataclasses.MISSING:
        return value == f.default_factory()
    return False


def decode(cls: type[Message], body: dict) -> Message:
    """The message of `cls` that `body` holds; RemoteProtocolError saying what is wrong with it."""
    op, types = cls.op, _types(cls)
    unknown = sorted(set(body) - types.keys() - {"op"})
    if unknown:
        raise RemoteProtocolError(f"control op {op!r} has unknown field(s) {', '.join(unknown)}")
    missing = [f for f in (*cls.always, *(("id",) if issubclass(cls, Request) else ())) if f not in body]
    if missing:
        raise RemoteProtocolError(f"control op {op!r} lacks {', '.join(missing)}")
    return cls(**{k: typed(op, k, v, types[k]) for k, v in body.items() if k != "op"})


@functools.cache
def _types(cls: type[Message]) -> dict[str, object]:
    """Each field's type, from the class's annotations."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def typed(op: str, name: str, value: object, kind: object) -> object:
    """`value` as the field's type: numbers converted (JSON has one kind), anything else checked."""
    allowed = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, _UnionType) else (kind,)
    if value is None and type(None) in allowed:
        return None
    for t in allowed:
        if t is Any:
            return value
        if t is bool and isinstance(value, bool):
            return value
        if t in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
            if t is int and value != int(value):
                break
            return t(value)
        if t in (str, list, dict) and isinstance(value, t):
            return value
    raise RemoteProtocolError(f"control op {op!r}: field {name} is {value!r}, not {kind}")


_UnionType = type(int | None)
