"""A key's rounds on a server, and what a per-key operation does with them.

`KeyState`: the accumulators and round bookkeeping of one key (double-buffered rounds, rank order, staging, seeds:
server/engine.py says why). `KeyOp`: the interface of a per-key operation (the engine's one extension point;
server/ops.py and server/optim.py implement it). `Outbox`: what an operation may send, and nothing else of the
engine's (the engine implements it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

from gradwire.errors import TensorError
from gradwire.protocol import dtypes
from gradwire.transport.shm import NO_SLOT

if TYPE_CHECKING:
    from gradwire.ring import Slot


# what the engine sends through (the server's repliers): the callables it is given
# reply(key, round, dtype code, payload, pull slot per rank, bitmask of ranks) -> None: queue the result for them;
# the payload is one view for all, or a list with each rank's view (a key declared with slices)
Reply = Callable[[int, int, int, "memoryview | list[memoryview]", list[int], int], None]
# fail(slot, message) -> None: send an ERROR for the slot's key to its sender
Fail = Callable[["Slot", str], None]
# ack(rank, key, round) -> None: tell one worker its contribution is in
Ack = Callable[[int, int, int], None]
# fail_rank(rank, key, message) -> None: send an ERROR for the key to that worker (a round that cannot complete)
FailRank = Callable[[int, int, str], None]
# forward(replica server, key, round, dtype code, payload parts, done) -> None: replicate an applied update; done()
# once the replica has it
Forward = Callable[[int, int, int, int, list, Callable[[], None]], None]


class Outbox(Protocol):
    """What a per-key operation may send: a round's result, one push's answer, an acknowledgement, a payload of its
    own, an update forwarded to the key's replica (None: no replicas)."""

    forward: Callable[[int, int, int, int, list, Callable[[], None]], None] | None

    def answer_round(self, state: KeyState, key: int, rnd: int, code: int, i: int, ranks: int) -> None: ...

    def answer_one(self, slot: Slot, payload: memoryview) -> None: ...

    def answer_rank(self, key: int, rnd: int, code: int, payload: memoryview, pull: int, rank: int) -> None: ...

    def ack(self, rank: int, key: int, rnd: int) -> None: ...

    def reply(self, key: int, rnd: int, code: int, payload: memoryview, pulls: list[int], ranks: int) -> None: ...


class KeyOp:
    """How a contribution goes into a round. Stateless: one instance serves every key of its kind."""

    name: ClassVar[str]
    ordered: ClassVar[bool] = False  # contributions must go in in rank order, even when sums need not be
    variable: ClassVar[bool] = False  # a contribution may be shorter than the key (down to empty)
    trailer: ClassVar[int] = 0  # bytes each push carries after its data (per-push arguments; part of the key's length)
    intercepts: ClassVar[bool] = False  # `intercept` sees each push first
    asynchronous: bool = False  # pushes are not gathered into rounds (no staging: they go through the ring)

    def setup(self, state: KeyState, previous: KeyState | None = None) -> None:
        """Per-key state, allocated when the key is declared (`previous`: the key's state before an elastic reset)."""

    def add(self, state: KeyState, i: int, dtype: dtypes.DType, wire: np.ndarray, first: bool) -> None:
        """Put one contribution into round buffer `i` (`first`: the round's first, in the order it is added)."""
        raise NotImplementedError

    def landing(self, state: KeyState, i: int) -> np.ndarray | None:
        """Where round buffer `i`'s first contribution (in rank order) may be received directly, so that it is in
        without `add` (None: `add` puts it in). Deterministic sums only (server/engine.py `landing`)."""
        return None

    def check(self, state: KeyState, i: int) -> None:
        """Called when every contribution is in: raise TensorError if they do not make a result."""

    def finish(self, state: KeyState, i: int) -> None:
        """Called when every contribution is in, before the result of round buffer `i` is sent."""
        self.check(state, i)

    def seeded(self, state: KeyState, i: int, rnd: int, data: np.ndarray) -> None:
        """A worker resent the result of round `rnd` it holds (after a failover): it is buffer `i`'s result."""
        state.out[i][:] = data

    def intercept(self, outbox: Outbox, state: KeyState, slot: Slot) -> bool:
        """Handle a push outside the rounds (True), or let the engine run it (False). Only with `intercepts`."""
        return False

    def answer(self, outbox: Outbox, state: KeyState, key: int, rnd: int, code: int, i: int, ranks: int) -> None:
        """Send round buffer `i`'s result to `ranks` (an operation may first replicate what it did)."""
        outbox.answer_round(state, key, rnd, code, i, ranks)


class KeyState:
    """The accumulators and round bookkeeping of one key."""

    __slots__ = (
        "acc",
        "count",
        "dtype",
        "filled",
        "length",
        "lengths",
        "members",
        "need",
        "nexts",
        "everyone",
        "first",
        "held",
        "landable",
        "name",
        "narrow",
        "op",
        "out",
        "pulls",
        "pushed",
        "results",
        "round",
        "scratch",
        "seeded",
        "slices",
        "stage",
        "staged",
        "started",
        "turn",
        "virtual",
    )

    def __init__(
        self,
        dtype: dtypes.DType,
        length: int,
        num_workers: int,
        name: str,
        op: KeyOp,
        slices: list[tuple[int, int]] | None = None,
        members: list[int] | None = None,
        previous: KeyState | None = None,
    ) -> None:
        self.name = name  # the tensor's, for stall reports
        # the ranks that contribute to its rounds (a process set), in the order their contributions go in
        self.members = sorted(members) if members is not None else list(range(num_workers))
        self.need = len(self.members)
        self.everyone = sum(1 << r for r in self.members)
        self.first = self.members[0] if self.members else 0
        self.nexts = [num_workers] * (num_workers + 1)  # the member after each rank, in rank order (past the last)
        for a, b in zip(self.members, self.members[1:], strict=False):
            self.nexts[a] = b
        self.op = op
        self.slices = slices  # (start byte, bytes) of the result each rank pulls; None: all of it
        self.filled = [0, 0]  # a gather's elements in, per buffer
        self.lengths = [[0] * num_workers for _ in range(2)]  # elements of each staged contribution (a gather's vary)
        self.started = [0.0, 0.0]  # when each buffer's round got its first contribution (the engine's clock)
        self.dtype = dtype
        self.length = length = length + op.trailer  # what each push carries
        n = length // dtype.itemsize
        self.narrow = dtype.accumulate != dtype.wire
        self.acc = [np.empty(n, dtype.accumulate) for _ in range(2)]
        self.out = [np.empty(n, dtype.wire) for _ in range(2)] if self.narrow else self.acc
        self.scratch = np.empty(n, dtype.accumulate) if dtype.accumulate != dtype.wire else self.acc[0]
        # what each buffer's round answers: the whole result, or one slice per rank (views made once, here)
        whole = [memoryview(out).cast("B") for out in self.out]
        self.results: list = whole if slices is None else [[w[a : a + b] for a, b in slices] for w in whole]
        self.round = [-1, -1]
        self.count = [0, 0]
        self.pushed = [0, 0]  # bitmask of ranks that pushed the round in this buffer
        self.pulls = [[NO_SLOT] * num_workers for _ in range(2)]  # each worker's shared pull slot, per buffer
        self.turn = [self.first, self.first]  # deterministic mode: the rank whose contribution is added next
        self.staged = [0, 0]  # bitmask of ranks whose early contributions wait in `stage`
        self.stage: list[list[np.ndarray | None]] = [[None] * num_workers for _ in range(2)]  # allocated on need
        self.seeded = [False, False]  # the round's sum came as a seed (a failover), not from contributions
        self.virtual = [0, 0]  # ranks not answered: joined ones' zeros stood in, or they replayed (REPLAY)
        self.held = None  # what the operation keeps per key (server/optim.py)
        # the first rank's contributions may be received straight into the accumulator (Engine.landing): only once a
        # round completed from contributions (before, after a failover, a seed may be written there meanwhile)
        self.landable = False
        op.setup(self, previous)

    def fits(self, code: int, length: int) -> bool:
        """A contribution of `length` bytes of dtype `code` may go into this key (a gather's may be shorter)."""
        return self.dtype.code == code and (length == self.length or self.op.variable and length < self.length)

    def begin(self, i: int, rnd: int) -> None:
        """Buffer `i` takes round `rnd` (its previous round must be complete: double buffering)."""
        if 0 < self.count[i] < self.need:
            raise TensorError(f"round {rnd} arrived while round {self.round[i]} is unfinished")
        self.round[i], self.count[i], self.pushed[i] = rnd, 0, 0
        self.turn[i], self.staged[i], self.seeded[i] = self.first, 0, False

    def drain(self, i: int, dtype: dtypes.DType) -> None:
        """Deterministic sums, after rank `turn` was added to buffer `i`: add the early contributions that are now
        next in rank order."""
        self.turn[i] = self.nexts[self.turn[i]]
        while self.staged[i] >> self.turn[i] & 1:
            rank = self.turn[i]
            source = self.stage[i][rank]
            assert source is not None
            self.op.add(self, i, dtype, source[: self.lengths[i][rank]], rank == self.first)
            self.staged[i] &= ~(1 << rank)
            self.turn[i] = self.nexts[rank]

    def stalled(self, now: float, threshold: float) -> list[tuple[int, float, list[int]]]:
        """Its rounds begun more than `threshold` seconds ago and still missing workers: (round, seconds waited,
        ranks that have not pushed). Read from another thread for a report: it only reads counters the engine writes,
        so at worst a round is reported a moment late."""
        out = []
        for i in (0, 1):
            if 0 < self.count[i] < self.need and now - self.started[i] > threshold:
                missing = [r for r in self.members if not self.pushed[i] >> r & 1]
                out.append((self.round[i], now - self.started[i], missing))
        return out
