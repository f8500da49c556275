"""A tensor as the scheduler keeps it (`Declaration`: the first declaration, its partitions, keys and servers), and
one worker's declaration waiting for the others' (`Call`). What every worker must agree on: protocol/signature.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from gradwire.protocol.signature import Signature

HOLDABLE_OPS = frozenset({"sum", "min", "max", "product"})


@dataclass
class Declaration:
    """The first declaration of a tensor, against which every other worker's is checked."""

    shape: list[int]
    dtype: str
    rank: int
    servers: list[int]
    partition_bytes: int
    keys: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    key_op: str = "sum"  # what its keys compute (server/ops.py)
    slices: list[list[int]] | None = None  # per rank, the [first element, count] of the result it pulls
    meta: str | None = None  # anything else the workers must agree on (a broadcast's root)
    members: list[int] | None = None  # the ranks that take part (a process set); None: every worker
    op_args: str | None = None  # the operation's declared arguments (canonical JSON: a server-side optimizer's)
    replicas: list[int | None] | None = None  # per key, the server holding a replica of its state (server/replica.py)
    # its workers hold each round's sum in their outputs until every one has it, in place of a copy or a replica
    # (docs/faults.md, "Held keys"; server/receipts.py)
    held: bool = False
    ready: threading.Event = field(default_factory=threading.Event)  # set once every owning server knows its keys
    error: str | None = None

    @property
    def signature(self) -> Signature:
        return Signature(self.key_op, self.dtype, self.shape, self.slices, self.meta, self.members, self.op_args)

    def answer(self) -> dict:
        """What every declarer of it is told."""
        if self.error:
            return {"error": self.error}
        # per key, whether a replica holds its last answered round (then workers keep no copy of it)
        # (a server-side optimizer's keys keep the workers' copies: the parameters they pulled seed a new server where
        # the replica is gone, docs/ps-mode.md)
        replicas = self.replicas if self.key_op != "optimizer" else None
        replicated = [r is not None for r in replicas] if replicas is not None else None
        return {
            "servers": self.servers,
            "partition_bytes": self.partition_bytes,
            "replicated": replicated,
            "held": self.held,
        }

    @property
    def holdable(self) -> bool:
        """Its workers may hold its sums in their outputs for a failover (`held`): a reduction whose every worker
        pulls the whole result, as it is (a compressed key's workers get a decoded block, which is not what a seed
        must carry; a sliced key's hold only their slice; a server-side optimizer's keep the parameters)."""
        return self.key_op in HOLDABLE_OPS and self.slices is None


def key_slices(sizes: list[int], slices: list[list[int]], itemsize: int) -> list[list[list[int]]]:
    """Per key (partitions of `sizes` bytes, in order), per rank: the [start byte, bytes] of the key that falls in
    the rank's slice [first element, count] of the tensor (empty where they miss)."""
    out, start = [], 0
    for nbytes in sizes:
        end = start + nbytes
        per_rank = []
        for first, count in slices:
            lo, hi = max(start, first * itemsize), min(end, (first + count) * itemsize)
            per_rank.append([lo - start, hi - lo] if hi > lo else [0, 0])
        out.append(per_rank)
        start = end
    return out


@dataclass
class Call:
    """One worker's declaration of a tensor, waiting for the others'."""

    rank: int
    signature: Signature
    partition_bytes: int
    answer: Callable[[dict], None]
