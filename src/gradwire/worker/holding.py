"""Held keys: a worker's side (docs/faults.md, "Held keys"; the server's: server/receipts.py).

A tensor past the workers' GRADWIRE_FAILOVER_COPY_BYTES keeps no copy of its sums anywhere. Each partition's sum is
received into the call's output (its own push flagged HELD), averaged there where the call averages, and stays
there, the call unfinished, until its server says that every worker it answered has that sum (EVERYONE). Meanwhile
the output is this worker's seed of the round (`Seed.holding`): if the server dies before some worker has the sum,
the scheduler asks one that has it to seed the key's new server from its output, flagged AVERAGED where it is
averaged (the new server answers with that flag, and the workers it answers copy the result as it is: the same bits).
Once every worker has it, no failover can need the round again, and the call completes.

What it costs: each call completes one worker-server-worker round trip after its last sum arrived (small frames,
batched: RECEIVED from the link loop, EVERYONE from the server's repliers), and, where the output is the input
too (in place), one copy of each sum from a buffer of one partition (`bounce`): a sum cut off mid-frame by a dying
server must not have overwritten the contribution that the worker then pushes again. Memory: that buffer per link,
whatever the model's size.
"""

from __future__ import annotations

import threading

import numpy as np

from gradwire.errors import RemoteProtocolError
from gradwire.worker.work import Seed, Work


class Holds:
    """One link's held partitions: answered, waiting for every worker to have their sums. Guarded by the link's lock;
    filled and emptied on the link loop (transport/loop.py), whose next pass over the link sends the receipts."""

    def __init__(self, lock: threading.Lock, server: int) -> None:
        self._lock = lock
        self._server = server
        self._held: dict[tuple[int, int], tuple[Work, Seed]] = {}
        self.receipts: list[tuple[int, int]] = []  # (key, round)s received, for the link to say so (RECEIVED)
        self._bounce = np.empty(0, np.uint8)  # the loop's only

    def __len__(self) -> int:
        return len(self._held)

    def into(self, work: Work) -> np.ndarray:
        """Where `work`'s sum is received over a socket: its output, or, where the output is its input too, the
        bounce buffer (copied to the output by `hold`)."""
        out = work.out.reshape(-1).view(np.uint8)
        if not np.may_share_memory(out, np.frombuffer(work.send, np.uint8)):
            return out
        if len(self._bounce) < work.nbytes:
            self._bounce = np.empty(work.nbytes, np.uint8)
        return self._bounce[: work.nbytes]

    def hold(self, work: Work, received: np.ndarray, seeds: dict[int, Seed], averaged: bool = False) -> None:
        """`work`'s sum is in `received` (`into`'s, or a shared slot): into its output, averaged where the call
        averages (one pass; not a sum that came `averaged`, a seed's), which holds it as the key's seed until
        `everyone`; then say so to the server (the link's next RECEIVED)."""
        seed = Seed.holding(work, averaged or work.average > 1)
        if work.average > 1 and not averaged:
            # integers: the quotient truncated toward zero, as Horovod's average of an integer tensor (Work.deliver)
            np.divide(received.view(work.out.dtype), work.average, out=work.out.reshape(-1), casting="unsafe")
        elif received.ctypes.data != seed.data.ctypes.data:
            np.copyto(seed.data, received)
        seeds[work.key] = seed
        with self._lock:
            self._held[(work.key, work.round)] = (work, seed)
            self.receipts.append((work.key, work.round))

    def tensors(self) -> set[str]:
        """(Holding the lock.) The tensors with partitions held."""
        return {work.tensor for work, _ in self._held.values()}

    def take_receipts(self) -> list[tuple[int, int]]:
        """(Holding the lock.) The receipts to send now."""
        receipts, self.receipts = self.receipts, []
        return receipts

    def everyone(self, pairs: list[tuple[int, int]]) -> list[tuple[Work, Seed]]:
        """Every worker has these rounds' sums (EVERYONE): their partitions, done holding, with their seeds."""
        done = []
        with self._lock:
            for pair in pairs:
                held = self._held.pop(pair, None)
                if held is None:
                    raise RemoteProtocolError(
                        f"server {self._server} says every worker has round {pair[1]} of key {pair[0]:016x}, "
                        "which this worker does not hold"
                    )
                done.append(held)
        return done

    def take_all(self) -> list[tuple[Work, Seed]]:
        """Every partition held, with its seed (the link closed, or its server failed over)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
            self.receipts = []
        return held


def release(held: list[tuple[Work, Seed]], seeds: dict[int, Seed] | None) -> list[Work]:
    """Held partitions done holding: their seeds out of `seeds` (where a later round's has not replaced them)."""
    for work, seed in held if seeds is not None else ():
        if seeds.get(work.key) is seed:
            del seeds[work.key]
    return [work for work, _ in held]
