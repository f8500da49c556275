"""Flow control of a worker's link to one server, as a state machine without I/O: which queued partition may be pushed
next, and when to look again. `ServerLink` (worker/link.py) keeps only the sockets and threads around it; bytes in
flight over all of a worker's links and their pacing against each other are `Credit`'s (worker/credit.py).

The rule, in the order it is applied:
1. **Priority.** Queued partitions leave highest priority first, equal priorities in the order they were queued.
2. **The window**: at most `window` partitions pushed and not yet acknowledged (received and summed) by the server,
   which bounds what queues on the link. It counts contributions not yet *in*, not sums not yet *out*: workers submit
   asynchronously, so their senders may take keys in different orders, and windows of unanswered sums can fill with
   disjoint keys of which no round can ever complete (a deadlock we hit with 40 tensors in flight). On shaped links a
   window of 4 unanswered 64 KiB partitions per server took a prototype from 1.90x (window 1) to 1.10x the bound S/B
   (shared/MEASUREMENTS.md); an unbounded one lets TCP's unfair fan-in starve some workers' pushes.
3. **The cap** on unanswered partitions (pushed, sum not yet back; 0: none), which keeps a fast worker from running
   ahead of the rounds where the servers' links are the bottleneck (TCP's unfair fan-in into a server: a round
   completes only when its slowest pusher delivers). A capped link may still push a partition that comes before one
   of its unanswered ones in the **job-wide order** (round, then priority, then tensor name and partition index: the
   same on every worker). That makes the cap deadlock-free whatever order workers submit in: the earliest partition
   not yet summed everywhere is never held back, since everything a worker has unanswered comes after it. In training,
   where backward hooks submit keys at their own moments and in their own order, it never stalls the link; it only
   stops a worker that has submitted *later* work from pushing it while earlier sums are out. (The earlier rule, a
   fixed 100 ms escape, stalled every server link to one partition per 100 ms in training: 7.5 s a step against DDP's
   2.2 s.)
4. **Liveness.** A capped link with nothing it may push and no answer for LIVENESS_SECONDS pushes its top partition
   anyway: only programs whose workers order keys differently *and* block between them get here (counted, and logged
   by the link).
Seeds and replays (a failover's resends, never answered) pass the window and the cap.

Not thread-safe: the link calls it under its own lock. Time comes in as `now` (time.monotonic() in the link, any
number in tests); nothing here sleeps or waits.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gradwire.worker.work import Work

LIVENESS_SECONDS = 1.0  # see rule 4


class Flow:
    """One link's queue, its partitions in flight, and the rule for the next push (module docstring).

    Events: `push` (queued), `next(now)` (taken to be sent, or None), `on_ack` (the server has a contribution),
    `on_answer` (its sum is back), `set_limits`. `wake_at()`: when `next` may decide otherwise with no other event
    (the liveness rule), or None. Counters for /status and the drift check: `full_seconds` (work queued, the window
    full), `capped_seconds` (work queued and window room, the cap holding all of it), `capped_sends` (pushes past a
    full cap by the job-wide order), `cap_escapes` (by the liveness rule).
    """

    def __init__(self, window: int, cap: int = 0, liveness: float = LIVENESS_SECONDS) -> None:
        self.window, self.cap, self.liveness = window, cap, liveness
        self.queued: list[tuple[int, int, Work]] = []  # a heap of (-priority, arrival, work)
        self.pending: dict[int, Work] = {}  # taken and not yet answered, by key (seeds are never)
        self.in_flight = 0  # taken and not yet acknowledged
        self.last_answer = 0.0  # when a sum last came back (`now`'s clock)
        self.full_seconds = self.capped_seconds = 0.0
        self.capped_sends = self.cap_escapes = 0
        self._arrivals = itertools.count()
        self._full_since: float | None = None
        self._capped_since: float | None = None

    # -- events --------------------------------------------------------------------------------------------------

    def push(self, work: Work, priority: int) -> None:
        """Queue a partition: higher priority leaves first, equal priorities in the order queued."""
        work.order = (work.round, -priority, work.tensor, work.index)  # the job-wide order: the same on every worker
        heapq.heappush(self.queued, (-priority, next(self._arrivals), work))

    def next(self, now: float) -> Work | None:
        """The partition that may be pushed now, taken off the queue (and counted in flight unless a seed); None if
        none may (then wait for an event, or until `wake_at()`)."""
        self._end_full(now)
        if not self.queued:
            self._end_capped(now)
            return None
        top = self.queued[0][2]
        if not (top.seed or self.in_flight < self.window):
            self._end_capped(now)  # the window holds it now, not the cap
            self._full_since = now
            return None
        work = self._allowed()
        if work is None:
            self._capped_since = self._capped_since if self._capped_since is not None else now
            if now - max(self._capped_since, self.last_answer) <= self.liveness:
                return None
            self.cap_escapes += 1
            work = heapq.heappop(self.queued)[2]
        self._end_capped(now)
        if not work.seed:
            self.in_flight += 1
            self.pending[work.key] = work
        return work

    def wake_at(self) -> float | None:
        """When `next` would let the liveness rule push, if the cap holds everything now; else None."""
        if self._capped_since is None:
            return None
        return max(self._capped_since, self.last_answer) + self.liveness

    def on_ack(self, key: int) -> tuple[Work, bool] | None:
        """The server has the contribution of `key`: (the work, whether this freed its window place); None if `key`
        is not in flight."""
        work = self.pending.get(key)
        return None if work is None else (work, self._acked(work))

    def on_answer(self, key: int, now: float) -> tuple[Work, bool] | None:
        """The sum of `key` is in: it is answered (and acknowledged, if no ACK came before). As `on_ack`."""
        work = self.pending.pop(key, None)
        if work is None:
            return None
        self.last_answer = now
        return work, self._acked(work)

    def set_limits(self, window: int, cap: int) -> None:
        """A new window and cap (the scheduler re-derived them), from the next decision on."""
        self.window, self.cap = window, cap

    def take_queued(self) -> list[Work]:
        """Everything queued, in the order it would have left; the queue is then empty."""
        works = [w for _, _, w in sorted(self.queued)]
        self.queued.clear()
        return works

    def take_all(self) -> list[Work]:
        """Everything in flight, then everything queued; nothing is left in either."""
        works = list(self.pending.values()) + self.take_queued()
        self.pending.clear()
        self.in_flight = 0
        return works

    def rounds(self, keys: list[int]) -> dict[int, int]:
        """key -> the round queued or unanswered here, of `keys` (seeds are not waited for)."""
        wanted = set(keys)
        works = [*self.pending.values(), *(w for _, _, w in self.queued)]
        return {w.key: w.round for w in works if w.key in wanted and not w.seed}

    def tensors(self) -> set[str]:
        """The tensors with partitions queued or unanswered."""
        return {w.tensor for w in self.pending.values()} | {w.tensor for _, _, w in self.queued}

    # -- the rule ------------------------------------------------------------------------------------------------

    def _allowed(self) -> Work | None:
        """The highest-priority queued partition the cap lets go (rule 3), taken off the queue; None if none."""
        top = self.queued[0][2]
        if top.seed or not self.cap or len(self.pending) < self.cap:
            return heapq.heappop(self.queued)[2]
        latest = max(w.order for w in self.pending.values())
        best = None
        for i, (_, _, work) in enumerate(self.queued):
            if work.order < latest and (best is None or self.queued[i] < self.queued[best]):
                best = i
        if best is None:
            return None
        entry = self.queued[best]
        self.queued[best] = self.queued[-1]
        self.queued.pop()
        if best < len(self.queued):
            heapq.heapify(self.queued)
        self.capped_sends += 1
        return entry[2]

    def _acked(self, work: Work) -> bool:
        if work.acked:
            return False
        work.acked = True
        self.in_flight -= 1
        return True

    def _end_full(self, now: float) -> None:
        """Count the time the window held the queue since the last decision (it may hold it again from now)."""
        if self._full_since is not None:
            self.full_seconds += now - self._full_since
            self._full_since = None

    def _end_capped(self, now: float) -> None:
        if self._capped_since is not None:
            self.capped_seconds += now - self._capped_since
            self._capped_since = None
