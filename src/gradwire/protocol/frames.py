"""The frame: a fixed little-endian header followed by a raw payload.

Layout (40 bytes)::

    magic u32 | version u8 | type u8 | flags u8 | dtype u8 | epoch u32 | sender u32
    | key u64 | round u32 | status u32 | length u64

A header is validated completely (`decode_header`) before any buffer is sized from it: the magic, the
version, a known type, a known dtype for data frames, and the length against the receiver's maximum.
Data frames (PUSHPULL, RESULT) carry raw array bytes; ACKS, RECEIVED and EVERYONE carry packed (key, round) pairs
(`ACK_ENTRY`); every other type carries a JSON body.
"""

from __future__ import annotations

import enum
import json
import struct
from typing import NamedTuple

from gradwire.errors import RemoteProtocolError
from gradwire.protocol import dtypes

MAGIC = 0x31575247  # b"GRW1" little-endian
VERSION = 1
HEADER = struct.Struct("<IBBBBIIQIIQ")
HEADER_SIZE = HEADER.size
MAX_CONTROL_BYTES = 1 << 20
ACK_ENTRY = struct.Struct("<QI")  # an ACKS, RECEIVED or EVERYONE frame's (key, round)


class FrameType(enum.IntEnum):
    """What a frame is. Data frames carry array bytes; the rest carry a JSON body."""

    HELLO = 1  # handshake: role, rank, nonce
    PROOF = 2  # handshake: HMAC over both nonces
    CONTROL = 3  # a JSON message (register, address book, declare, barrier, ...)
    PUSHPULL = 4  # worker -> server: one partition of one round; the reply is RESULT
    RESULT = 5  # server -> worker: the sum of that partition and round
    ERROR = 6  # JSON {"message": ..., "key": ...}: the request failed, the connection stays up
    BYE = 7  # orderly close
    ACK = 8  # server -> worker: your contribution to (key, round) is in; frees a window slot
    SHM_ATTACH = 9  # worker -> server {path, push, pull, slot_bytes}; the reply {ok} (transport/shm.py)
    PROBE = 10  # bytes that only measure a link's rate (GRADWIRE_PLACEMENT=auto; scheduler/probe.py)
    # server -> worker: its contributions to these (key, round)s are in (ACK_ENTRY each): the acknowledgements of one
    # batch of the engine, in one frame (server/replier.py)
    ACKS = 11
    # worker -> server: the sums of these (key, round)s are in its outputs (ACK_ENTRY each), which hold them for a
    # failover until every worker has them (held keys: docs/faults.md, server/receipts.py)
    RECEIVED = 12
    # server -> worker: every worker it answered these (key, round)s has them (ACK_ENTRY each): their calls complete
    EVERYONE = 13


# PUSHPULL and RESULT flag: the payload lies in a shared-memory slot (transport/shm.py), not on the stream; the header's
# length is the slot's bytes, and its status names the slots (a frame decoder reads no payload for it: `wire_length`)
SHM_PAYLOAD = 0x01
# PUSHPULL flag: the payload is a sum the worker already received (resent to a key's new server after a failover)
SEED = 0x02
# PUSHPULL flag: worker -> server, a contribution to a round of a sliced key (reducescatter, alltoall) that the dead
# server had already answered this worker for: resent after a failover so the round completes for the ranks still
# waiting; counted like any push, never answered nor acknowledged (they pull only their slice: none holds the sum)
REPLAY = 0x08
# PUSHPULL flag: server -> server, an update a key's primary applied, for the replica to apply alike (the header's
# status numbers it; the replica's ACK echoes the number). Parameter-server mode, server/replica.py.
REPLICA = 0x04
# PUSHPULL flag: worker -> server, the pusher holds the round's sum in its output until every worker has it, and says
# when it has it (RECEIVED); the server tells every one of them once all have (EVERYONE). docs/faults.md, "held keys"
HELD = 0x10
# PUSHPULL (with SEED) and RESULT flag: the payload is a sum already averaged (a held key's seed comes from an averaging
# call's output); a worker answered with it copies it as it is, without dividing again
AVERAGED = 0x20

DATA_TYPES = frozenset({FrameType.PUSHPULL, FrameType.RESULT})
ENTRY_TYPES = frozenset({FrameType.ACKS, FrameType.RECEIVED, FrameType.EVERYONE})  # bodies of ACK_ENTRY pairs


class Header(NamedTuple):
    """A decoded, validated header. (A named tuple: made once per frame, it costs a fifth of a frozen dataclass.)"""

    type: FrameType
    flags: int
    dtype: int
    epoch: int
    sender: int
    key: int
    round: int
    status: int
    length: int


def encode_header(
    ftype: int,
    length: int,
    *,
    flags: int = 0,
    dtype: int = 0,
    epoch: int = 0,
    sender: int = 0,
    key: int = 0,
    round: int = 0,
    status: int = 0,
) -> bytes:
    """Pack a header (for control frames; the data path packs into preallocated buffers instead)."""
    return HEADER.pack(MAGIC, VERSION, ftype, flags, dtype, epoch, sender, key, round, status, length)


def pack_header_into(
    buf: bytearray,
    ftype: int,
    length: int,
    dtype: int,
    epoch: int,
    sender: int,
    key: int,
    round: int,
    flags: int = 0,
    status: int = 0,
) -> None:
    """Pack a data-frame header into a preallocated buffer (no allocation on the hot path)."""
    HEADER.pack_into(buf, 0, MAGIC, VERSION, ftype, flags, dtype, epoch, sender, key, round, status, length)


def decode_header(raw: bytes | bytearray | memoryview, max_payload: int) -> Header:
    """Unpack and validate a header; raises RemoteProtocolError saying what was wrong."""
    magic, version, ftype, flags, dtype, epoch, sender, key, rnd, status, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise RemoteProtocolError(f"bad magic 0x{magic:08x} (expected 0x{MAGIC:08x}): not a gradwire peer")
    if version != VERSION:
        raise RemoteProtocolError(f"protocol version {version}, this node speaks {VERSION}")
    frame_type = _TYPES.get(ftype)
    if frame_type is None:
        raise RemoteProtocolError(f"unknown frame type {ftype}")
    if frame_type in DATA_TYPES:
        itemsize = _ITEMSIZES.get(dtype)
        if itemsize is None:
            raise RemoteProtocolError(f"unknown dtype code {dtype} in a {frame_type.name} frame")
        if length > max_payload:
            raise RemoteProtocolError(f"payload of {length} bytes exceeds the maximum of {max_payload}")
        if length % itemsize:
            raise RemoteProtocolError(f"payload of {length} bytes is not a whole number of {dtype=} elements")
    elif length > MAX_CONTROL_BYTES:
        raise RemoteProtocolError(f"{frame_type.name} body of {length} bytes exceeds {MAX_CONTROL_BYTES}")
    elif frame_type in ENTRY_TYPES and length % ACK_ENTRY.size:
        raise RemoteProtocolError(f"{frame_type.name} body of {length} bytes is not a whole number of entries")
    return Header(frame_type, flags, dtype, epoch, sender, key, rnd, status, length)


_TYPES = {t.value: t for t in FrameType}  # a dict lookup: FrameType(n) costs microseconds per frame
_ITEMSIZES = {code: d.itemsize for code, d in dtypes.BY_CODE.items()}


def wire_length(header: Header) -> int:
    """The bytes of the frame's payload that follow its header on the stream."""
    return 0 if header.flags & SHM_PAYLOAD and header.type in DATA_TYPES else header.length


def encode_json(ftype: int, body: dict, *, epoch: int = 0, sender: int = 0, key: int = 0) -> bytes:
    """A whole control frame: header and JSON body."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    return encode_header(ftype, len(payload), epoch=epoch, sender=sender, key=key) + payload


def encode_entries(ftype: int, pairs: list[tuple[int, int]], *, epoch: int = 0, sender: int = 0) -> bytes:
    """A whole frame of (key, round) pairs (RECEIVED, EVERYONE)."""
    body = b"".join(ACK_ENTRY.pack(key, rnd) for key, rnd in pairs)
    return encode_header(ftype, len(body), epoch=epoch, sender=sender) + body


def decode_json(payload: bytes) -> dict:
    """Parse a control body; raises RemoteProtocolError if it is not a JSON object."""
    try:
        body = json.loads(payload.decode("utf-8"))  # UTF-8 only: json.loads on bytes would guess UTF-16 or 32
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RemoteProtocolError(f"control body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise RemoteProtocolError(f"control body must be a JSON object, got {type(body).__name__}")
    return body
