"""Workers that joined (hvd.join: out of data) or left the job (shutdown()) while the others go on: zeros stand in for
a joined worker's contributions to a sum, and a round that waits for a push from one that left fails at once rather
than at the timeout. The Engine's, split out of its event loop (server/engine.py); both events reach it through its
ring, in order with the pushes (server/control.py publishes them).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gradwire.server.receipts import Receipts
from gradwire.server.rounds import FailRank, KeyState, Round
from gradwire.server.slot import DEPARTED_EVENT, Slot


class Membership:
    """The Engine's joined and departed workers (its state, declared here for the reader)."""

    keys: dict[int, KeyState]
    joined: int  # bitmask
    departed: int  # bitmask
    receipts: Receipts | None
    _fail_rank: FailRank | None
    _zeros: dict[tuple[int, int], np.ndarray]
    _contribute: Callable[..., None]
    _complete: Callable[..., None]

    def on_membership(self, slot: Slot) -> None:
        """A ring event from the scheduler (server/control.py): the workers in `slot.key`'s mask have joined, or (flag
        DEPARTED_EVENT) have left."""
        if slot.flags & DEPARTED_EVENT:
            self.set_departed(slot.key)
        else:
            self.set_joined(slot.key)

    def set_joined(self, mask: int) -> None:
        """Workers in `mask` have joined (hvd.join: out of data): the rounds of sums go on with zeros in their place,
        those begun already included. Runs on the engine's thread (a ring event), in order with the pushes."""
        self.joined = mask
        if not mask:
            return
        for key, state in list(self.keys.items()):
            if not state.op.reduction:
                continue
            for r in state.rounds:
                if state.unfinished(r) and not r.seeded:
                    self._join_in(state, r)
                    if r.count == state.need:
                        self._complete(state, key, state.dtype.code, r)

    def set_departed(self, mask: int) -> None:
        """Workers in `mask` have left the job (shutdown()) while others go on: a round that needs a push of theirs
        can never complete, so every worker that pushed it is told at once, and so is every later pusher (instead of a
        wait until the timeout). Runs on the engine's thread (a ring event), in order with the pushes."""
        self.departed = mask
        if self.receipts is not None:
            self.receipts.depart(mask)  # nobody waits for them to have a held round
        for key, state in list(self.keys.items()):
            for r in state.rounds:
                if state.unfinished(r) and not r.seeded:
                    self._fail_departed(state, key, r)

    def _fail_departed(self, state: KeyState, key: int, r: Round) -> bool:
        """Fail round `r` where a worker that has left owes a push to it; True if it did."""
        missing = self.departed & state.everyone & ~r.pushed & ~self.joined
        if not missing:
            return False
        who = ", ".join(map(str, ranks_of(missing)))
        message = (
            f"worker {who} left the job (shutdown(), or its process ended) before pushing round {r.number} of "
            f"{state.name!r}, which can never complete: every worker must make the same calls before it shuts down"
        )
        pushers = [rank for rank in state.members if r.pushed >> rank & 1 and not r.virtual >> rank & 1]
        r.fail(state.first)
        for rank in pushers:
            if self._fail_rank is not None:
                self._fail_rank(rank, key, message)
        return True

    def _join_in(self, state: KeyState, r: Round) -> None:
        """Zeros for every joined member that has not pushed round `r`."""
        missing = self.joined & state.everyone & ~r.pushed
        if not missing or not state.op.reduction:
            return
        zeros = self._zeros.get((state.dtype.code, state.length))
        if zeros is None:  # one per dtype and size, never written
            zeros = self._zeros[(state.dtype.code, state.length)] = np.zeros(
                state.length // state.dtype.itemsize, state.dtype.wire
            )
        for rank in state.members:
            if missing >> rank & 1:
                self._contribute(state, r, rank, zeros, False)
                r.virtual |= 1 << rank


def ranks_of(mask: int) -> list[int]:
    """The ranks whose bits are set in `mask`, in order."""
    return [r for r in range(mask.bit_length()) if mask >> r & 1]
