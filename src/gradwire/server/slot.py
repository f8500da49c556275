"""What a server keeps in each slot of its ring (ring.py's event): the frame's header fields beside the slot's own
buffer, and the ring's own events, which a server's own publisher puts in a slot between the wire's frames."""

from __future__ import annotations

import numpy as np

# A slot's `flags` are its frame's (protocol/frames.py's bits), or, for a slot a server's own publisher fills, a ring
# event's, chosen apart from every bit of the wire's. JOIN_EVENT: the set of joined workers changed (hvd.join); the
# slot's key is the bitmask. With it, DEPARTED_EVENT: the bitmask is of the workers that have left the job instead
# (shutdown() while others go on).
JOIN_EVENT = 0x80
DEPARTED_EVENT = 0x40


class Slot:
    """A server's ring event: one preallocated receive buffer and the header fields of the frame it holds."""

    __slots__ = (
        "array",
        "buffer",
        "conn",
        "data",
        "dtype",
        "flags",
        "key",
        "landed",
        "length",
        "pull",
        "round",
        "sender",
        "valid",
    )

    def __init__(self, buffer: memoryview, array: np.ndarray) -> None:
        self.buffer = buffer  # the slot's own memory, for recv_into
        self.array = array  # the same memory as uint8
        self.data: np.ndarray = array  # where this event's payload lies: the slot, or a shared-memory slot
        self.pull = 0xFFFF  # the worker's shared pull slot for the sum (transport/shm.py), or none
        self.conn: object = None
        self.key = 0
        self.round = 0
        self.dtype = 0
        self.length = 0
        self.sender = 0
        self.flags = 0  # the frame's flags (SEED: a sum a worker already holds, resent after a failover)
        self.valid = False  # False: the frame was not fully received; the consumer skips it
        self.landed = False  # the payload was received straight into its key's landing buffer (server/engine.py)
