"""Where a server's readers receive a contribution straight into, rather than into a ring slot: the Engine's
`landing` (a staging buffer lent by its pool, or the round's accumulator for the first rank) and `replica_landing` (a
replica's one buffer). Called by readers (server/reader.py), once per frame, after `Engine.check`.
"""

from __future__ import annotations

import numpy as np

from gradwire.server.rounds import KeyState, Round
from gradwire.server.staging import BufferPool


class Landing:
    """The Engine's landing buffers (its state, declared here for the reader)."""

    keys: dict[int, KeyState]
    deterministic: bool
    pool: BufferPool

    def landing(self, key: int, rnd: int, sender: int) -> np.ndarray | None:
        """Where a reader may receive `sender`'s contribution to `key`'s round `rnd` directly (deterministic sums
        only; None: into a ring slot). Called by the one reader of that sender's connection, after `check`; the
        buffer is allocated once per key, rank and round buffer."""
        state = self.keys.get(key)
        if state is None or not state.everyone >> sender & 1:
            return None
        if not (self.deterministic or state.op.ordered) or state.op.asynchronous:
            return None
        r = state.rounds[rnd & 1]
        if sender != state.first:
            return self._stage(state, r, sender).view(np.uint8)
        # The first rank's contribution is added first: where the operation allows, it is received into the round's
        # accumulator itself, which saves a pass over the partition (a copy out of the ring slot). Free at this
        # point: a worker pushes round `rnd` only once it has round `rnd - 1`'s result, so every worker has round
        # `rnd - 2`'s, the accumulator's last. Not where that does not hold (a misbehaving or replaying worker: the
        # engine refuses or handles those from a ring slot), nor before a round completed from contributions alone.
        if not state.landable or r.seeded:
            return None
        current = r.number == rnd
        if current and (r.pushed >> sender & 1 or r.count >= state.need):
            return None
        if not current and state.unfinished(r):
            return None
        if state.lent:
            state.lend(r, self.pool)
        into = state.op.landing(state, r)
        return None if into is None else into.view(np.uint8)

    def replica_landing(self, key: int, rnd: int, length: int) -> np.ndarray | None:
        """Where a forwarded result of a key this server only keeps (a replica) may be received directly: the round
        buffer it will be the seed of (None: a ring slot). Its rounds are only ever seeds while it is kept, and they
        come in order on one connection, so the buffer holds an older seed nobody will ask for again."""
        state = self.keys.get(key)
        if state is None or not state.kept or state.op.intercepts or length != state.length:
            return None
        state.kept_round = rnd  # what its buffer holds from now on (one buffer for both rounds: KeyState.keep)
        return state.rounds[rnd & 1].out.view(np.uint8)

    def _stage(self, state: KeyState, r: Round, sender: int) -> np.ndarray:
        """The staging buffer of `sender` in round `r`'s buffer: a lent key's is lent by the pool until its
        contribution is added (server/staging.py), a small key's is its own (KeyState.lend). One a contribution was
        received into and never added (refused, or its round failed) stays where it is for the next."""
        stage = r.stage
        buffer = stage[sender]
        if buffer is None:
            buffer = stage[sender] = self.pool.take(np.dtype(state.dtype.wire), state.length // state.dtype.itemsize)
        return buffer
