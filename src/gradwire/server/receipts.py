"""Receipts: which workers have the sum of a held key's round, and telling them all once every one has.

A held key (docs/faults.md, "Held keys"): its workers receive each round's sum straight into the caller's output and
keep the call unfinished, the sum untouched there, until every worker this server answered has it. So long as one has
not, the others' outputs are the copies a failover seeds it with; once all have, no failover can need the round again
(each worker pushes the next round only after this one's call completed), and the calls complete. So no server keeps
a replica of the sums and no worker a copy: what a failover needs lies in the outputs of the calls in flight.

The engine says whom it answers (`expect`, before the answers leave), each worker says when a sum is in (a RECEIVED
frame, read by its reader: `received`), and once all have it each of them is told (EVERYONE, `notify`). Workers that
leave the job (`depart`) are not waited for. Thread-safe: engines and readers call it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from gradwire.errors import RemoteProtocolError

# notify(rank, [(key, round), ...]) -> None: one EVERYONE frame to that worker
Notify = Callable[[int, list[tuple[int, int]]], None]


class Receipts:
    def __init__(self, notify: Notify) -> None:
        self._notify = notify
        # (key, round) -> [ranks that have not said they have it, ranks answered]
        self._waiting: dict[tuple[int, int], list[int]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._waiting)

    def expect(self, key: int, rnd: int, ranks: int) -> None:
        """The engine answers `ranks` (a bitmask) with `key`'s round `rnd` (a seeded round may answer its pushers one
        at a time: they join the ranks waited for)."""
        with self._lock:
            entry = self._waiting.get((key, rnd))
            if entry is None:
                self._waiting[(key, rnd)] = [ranks, ranks]
            else:
                entry[0] |= ranks
                entry[1] |= ranks

    def received(self, rank: int, pairs: list[tuple[int, int]]) -> None:
        """Worker `rank` has these sums (a RECEIVED frame): tell everyone of each round all now have."""
        bit, done = 1 << rank, []
        with self._lock:
            for key, rnd in pairs:
                entry = self._waiting.get((key, rnd))
                if entry is None or not entry[0] & bit:
                    raise RemoteProtocolError(
                        f"worker {rank} says it received round {rnd} of key {key:016x}, which this server has not "
                        "answered it (or it said so already)"
                    )
                entry[0] &= ~bit
                if not entry[0]:
                    del self._waiting[(key, rnd)]
                    done.append((key, rnd, entry[1]))
        self._tell(done)

    def depart(self, ranks: int) -> None:
        """Workers in `ranks` (a bitmask) left the job: nobody waits for them any more, nor tells them."""
        done = []
        with self._lock:
            for pair, entry in list(self._waiting.items()):
                entry[0] &= ~ranks
                entry[1] &= ~ranks
                if not entry[0]:
                    del self._waiting[pair]
                    done.append((*pair, entry[1]))
        self._tell(done)

    def reset(self) -> None:
        """Elastic: the workers changed, and every call in flight failed with their connections."""
        with self._lock:
            self._waiting.clear()

    def _tell(self, done: list[tuple[int, int, int]]) -> None:
        per_rank: dict[int, list[tuple[int, int]]] = {}
        for key, rnd, ranks in done:
            for rank in range(ranks.bit_length()):
                if ranks >> rank & 1:
                    per_rank.setdefault(rank, []).append((key, rnd))
        for rank, pairs in per_rank.items():
            self._notify(rank, pairs)
