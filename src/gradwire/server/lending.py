"""A key's buffers over its life: lent by the engine's pool while a round needs them, given back once its replies are
sent, and a replica's one buffer for both rounds (KeyState inherits it: server/rounds.py).

Why lend (issue 33): a server held two round buffers per key, and a replica two per key it keeps; on a 1.2 GB tensor
that was 5-6 copies of each server's share, and each of the first two calls paid for fresh pages. Lent, a server holds
buffers for the rounds in flight, and writes pages the pool has written before (server/staging.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from gradwire.protocol import dtypes
from gradwire.server.round import Round

if TYPE_CHECKING:
    from gradwire.server.staging import BufferPool


class _Op(Protocol):
    intercepts: bool  # KeyOp's (server/rounds.py): it handles pushes itself, a replica applies every update


class Lending:
    """The buffer life cycle of a key (KeyState's state, declared here for the reader)."""

    __slots__ = ()
    dtype: dtypes.DType
    length: int
    slices: list[tuple[int, int]] | None
    first: int
    op: _Op
    held: object
    kept: bool
    lent: bool
    shared: bool
    kept_round: int
    pool: BufferPool | None
    rounds: tuple[Round, Round]

    def unfinished(self, r: Round) -> bool:
        raise NotImplementedError

    def keep(self, kept: bool) -> None:
        """This server keeps the key only as its replica (`kept`), or owns it (declared by its owner, or promoted by a
        failover). A replica keeps one round, the last its server answered, so its two rounds share one buffer: a
        forward of round r+1 comes only once every worker has pushed r+1, hence has round r, and nobody asks for r
        again (a forward cut off mid-frame leaves r+1 unanswered: the workers push it again to whoever owns the key
        next). Not a key whose operation keeps state of its own (a server-side optimizer's parameters), which applies
        every forwarded update. Called from the control thread, when the key is declared (before any traffic) or
        promoted: an owner's rounds get their own buffers again on the engine's thread (`own`)."""
        if kept and not self.kept and not self.op.intercepts and self.held is None:
            if self.lent:  # a replica's buffer is its own: it holds the key's last round for as long as it is kept
                self.rounds[0].buffers_of(None, self._buffer(), self.slices)
                self.lent = False
            self.rounds[1].buffers_of(self.rounds[0], self.rounds[0].acc, None)
            self.shared = True
        self.kept = kept

    def _buffer(self) -> np.ndarray:
        return np.empty(self.length // self.dtype.itemsize, self.dtype.accumulate)

    def lend(self, r: Round, pool: BufferPool) -> np.ndarray:
        """Round `r`'s accumulator (its result too), lent by `pool` if it has none (KeyOp.lendable, LEND_BYTES). A
        round holds its buffer from its first contribution added until every reply of its result has been sent
        (`release_when_sent`), or, where that is not known (a seeded round, a reply that was never sent), until the
        key's next round completes (`give_back`). So a server holds buffers for the rounds in flight, not one or two
        per key, and a round is written into pages the pool has written before rather than fresh ones (issue 33: a
        1.2 GB tensor's first two calls paid seconds of page faults for each server's round buffers). From the
        engine's thread and from a reader (the first rank's contribution received into it: Engine.landing)."""
        with pool.lock:
            r.lends += 1
            acc = r.acc
            if acc is None:
                acc = pool.take_locked(self.dtype.accumulate, self.length // self.dtype.itemsize)
                r.buffers_of(None, acc, self.slices)
        return acc

    def release_when_sent(self, r: Round) -> Callable[[], None] | None:
        """What the repliers call once every reply of round `r`'s result is sent (Reply's `sent`): its lent buffer
        goes back to the pool. None for a round that keeps its result (not lent, or seeded: a worker the dead server
        never answered may still push it and be answered from here). Every worker that pushed the round had its
        reply; a replica had it before them (server/replica.py); so nothing needs the buffer once they are sent.
        Not if it was lent again meanwhile (`lends`: a reply thread that was slow to call back)."""
        pool = self.pool
        if not self.lent or r.seeded or pool is None:
            return None
        acc, lends = r.acc, r.lends

        def release() -> None:
            with pool.lock:
                if r.acc is acc and r.lends == lends:
                    r.acc = r.out = r.result = None  # type: ignore[assignment]
                    pool.give_locked(acc)

        return release

    def give_back(self, done: Round, pool: BufferPool) -> None:
        """Round `done` completed: the other round's lent buffer, if it still has one (its replies' `release` never
        came), goes back to the pool. Every worker pushed `done` after it had the other round's result, so no reply of
        it is still being sent, and no failover can ask for it (its forward to a replica was acknowledged before any
        worker had it)."""
        other = self.rounds[1 - done.index]
        with pool.lock:
            acc = other.acc
            if acc is None or other.number >= done.number or self.unfinished(other):
                return
            other.acc = other.out = other.result = None  # type: ignore[assignment]
            pool.give_locked(acc)

    def own(self) -> None:
        """An owned key whose rounds share a buffer (it was a replica): the round last received into it keeps it; the
        other gets a buffer of its own and holds no round (its bytes were overwritten by the later one). On the
        engine's thread, before it touches either round."""
        latest = self.rounds[self.kept_round & 1] if self.kept_round >= 0 else self.rounds[0]
        other = self.rounds[1 - latest.index]
        if latest.out is latest.acc:
            other.buffers_of(None, np.empty_like(latest.acc), self.slices)
        else:  # narrowed or encoded: an accumulator and a result of its own
            other.acc, other.out = np.empty_like(latest.acc), np.empty_like(latest.out)
            whole = memoryview(other.out).cast("B")
            other.result = whole if self.slices is None else [whole[a : a + b] for a, b in self.slices]
        other.begin(-1, self.first)
        self.shared = False
