"""Credit: bytes in flight over all of a worker's links, and the pacing of its network links against each other."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

PACE_GIVE_UP_SECONDS = 0.2  # a paced link waits at most this long for the others to catch up (see Credit)


class Credit:
    """Bytes in flight over all of a worker's links, and the pacing of its network links against each other.

    The limit: a lone request larger than it still passes.

    Pacing (`lead` > 0): each paced link (one to a server on another host) has a share, its server's placement
    weight. A link whose bytes still to send, over its share, are more than `lead` bytes behind the most behind
    link's waits; so the bytes to each server leave in proportion to the shares, and every server's round
    finishes at about the same time. Without it, TCP shares a worker's link equally between connections: at
    n = 4, k = 2 with colocated servers the flows to the colocated servers (a third of the dedicated ones'
    bytes each) finished first, and the dedicated servers then worked alone with the workers' links half idle
    (measured: 2.05 s a step against 1.70 s of bytes on the busiest link). Pacing only delays: a link that has
    waited PACE_GIVE_UP_SECONDS goes anyway (its link asks with `paced=False`: worker/pushes.py), so no order of events
    can hang on it.

    Nothing here waits: `take` says whether the bytes may go now, and the link loop (transport/loop.py) asks again after
    the next event. Thread-safe: the loop takes and gives back; a failover or a closing link gives back from others.
    """

    def __init__(self, limit: int, lead: int = 0) -> None:
        self.limit = limit
        self.used = 0
        self.lead = lead
        self._shares: dict[int, float] = {}  # paced server -> its share
        self._queued: dict[int, int] = {}  # paced server -> bytes submitted, not yet sent
        self._lock = threading.Lock()
        # the network links' use, for the scheduler's drift check (tuning.Drift): the time some push over a socket was
        # unacknowledged, and the bytes acknowledged; shared-memory links move bytes at memory speed and are not counted
        self._net_used = 0
        self._busy_since = 0.0
        self.busy_seconds = 0.0
        self.busy_bytes = 0

    def busy(self) -> tuple[float, int]:
        """(seconds some push over a network link was unacknowledged, bytes acknowledged on network links)."""
        with self._lock:
            now = time.monotonic()
            return self.busy_seconds + (now - self._busy_since if self._net_used else 0.0), self.busy_bytes

    def set_lead(self, lead: int) -> None:
        """The pacing lead from now on (it is a number of partitions' bytes: the partition size changed)."""
        with self._lock:
            self.lead = lead

    def pace(self, server: int, share: float) -> None:
        """Pace the link to `server` (from now on) with this share of the bytes."""
        if self.lead <= 0 or share <= 0:
            return
        with self._lock:
            self._shares[server] = share
            self._queued.setdefault(server, 0)

    def share(self, server: int) -> float:
        """The link to `server`'s share of the bytes (0: not paced)."""
        with self._lock:
            return self._shares.get(server, 0.0)

    def unpace(self, server: int) -> None:
        """The link is gone (its work moves elsewhere): nobody waits for it any more."""
        with self._lock:
            self._shares.pop(server, None)
            self._queued.pop(server, None)

    def queue(self, server: int, n: int) -> None:
        """`n` more bytes are waiting to be sent to `server`."""
        if server in self._shares:
            with self._lock:
                if server in self._queued:
                    self._queued[server] += n

    def may_send(self, server: int) -> bool:
        """Whether the link to `server` has its turn now (pacing; thread-safe)."""
        with self._lock:
            return self._may_send(server)

    def _may_send(self, server: int) -> bool:
        """Whether the link to `server` is within `lead` bytes of the most behind link, its bytes still to send over
        its share (per push: written out)."""
        share = self._shares.get(server)
        if share is None:
            return True
        queued = self._queued
        mine = queued[server] / share + self.lead
        for other, theirs in self._shares.items():  # a loop, not max() over a generator: per push, it counts
            if queued[other] / theirs > mine:
                return False
        return True

    def _has_credit(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    def take(self, n: int, server: int = -1, network: bool = False, paced: bool = True) -> bool:
        """Take `n` bytes of credit for a push to `server`, if its turn has come (when paced; `paced=False`: its
        wait is over) and the credit is there; `network`: over a socket. False: not taken, ask again later."""
        with self._lock:
            if paced and not self._may_send(server):
                return False
            if not self._has_credit(n):
                return False
            self.used += n
            if network:
                if not self._net_used:
                    self._busy_since = time.monotonic()
                self._net_used += max(n, 1)
            if server in self._queued:
                self._queued[server] = max(0, self._queued[server] - n)
            return True

    def release(self, n: int, network: bool = False, acked: bool = True) -> None:
        """Give back the credit of `n` bytes pushed (`acked`: the server has them; else abandoned, after a failover)."""
        self.release_all((n,), network, acked)

    def release_all(self, sizes: Sequence[int], network: bool = False, acked: bool = True) -> None:
        """Give back the credit of several pushes at once (an ACKS frame's), `sizes` their bytes; as `release`."""
        total = sum(sizes)
        with self._lock:
            self.used -= total
            if network:
                self._net_used -= total + sizes.count(0)  # a push of 0 bytes counts 1 (see `take`)
                self.busy_bytes += total if acked else 0
                if not self._net_used:
                    self.busy_seconds += time.monotonic() - self._busy_since
