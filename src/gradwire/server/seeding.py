"""After a failover (docs/faults.md): a round completed from a sum some worker already holds (SEED) or that a replica
keeps (REPLICA, server/replica.py), and replayed contributions of sliced keys (REPLAY) that are no longer needed. The
Engine's, split out of its event loop (server/engine.py).
"""

from __future__ import annotations

from gradwire.protocol import dtypes
from gradwire.protocol.frames import AVERAGED, REPLICA
from gradwire.server import replica
from gradwire.server.rounds import KeyState, Outbox, Round
from gradwire.server.slot import Slot
from gradwire.server.staging import BufferPool


class Seeding:
    """The Engine's seeds and replays (its state, declared here for the reader)."""

    pool: BufferPool
    num_workers: int
    seeded_answers: int
    replicated: int
    outbox: Outbox

    @staticmethod
    def _stale_replay(state: KeyState, r: Round, rnd: int, bit: int) -> bool:
        """A replayed contribution (REPLAY, after a failover) that is not needed: its round is complete here already,
        or past, or the sender's contribution is in (a second failover asked for it again)."""
        if r.number != rnd:
            return r.number > rnd
        return r.count == state.need or bool(r.pushed & bit)

    def _take_seed(self, state: KeyState, r: Round, slot: Slot, dtype: dtypes.DType) -> None:
        """A worker resends a sum it holds (after a failover): complete the round with it, answer its pushers.

        Stale seeds are dropped: the buffer already holds a later round (every worker had that sum), or this round
        is complete already (another worker's seed, or every contribution came in). Any sum of a round is the same
        bytes, so which seed wins does not matter.
        """
        if r.number > slot.round or (r.number == slot.round and r.count == state.need):
            return
        waiting = r.pushed if r.number == slot.round else 0
        if state.lent:
            state.lend(r, self.pool)
        if not slot.landed:  # a replica's forward may have been received into the round's buffer already
            state.op.seeded(state, r, slot.round, slot.data.view(dtype.wire))
        r.seed(slot.round, state.need, state.everyone, self.num_workers)
        r.averaged = bool(slot.flags & AVERAGED)  # answered as it is: its workers do not divide it again
        if waiting:
            self.seeded_answers += bin(waiting).count("1")
            self.outbox.answer_round(slot.key, slot.dtype, r, waiting)

    def _seed(self, state: KeyState, r: Round, slot: Slot, dtype: dtypes.DType) -> None:
        """A seed (SEED, from a worker) or a round its key's server answered (REPLICA, kept here: server/replica.py,
        acknowledged once it is in)."""
        if slot.flags & REPLICA and state.shared and not slot.landed:
            state.kept_round = slot.round  # received into a ring slot: its bytes go into the one buffer now
        self._take_seed(state, r, slot, dtype)
        if slot.flags & REPLICA:
            self.replicated += 1
            replica.acknowledge(slot.conn, slot.key, slot.round, slot.pull)
