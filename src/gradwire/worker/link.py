"""A worker's link to one server: a sender and a receiver thread on one full-duplex connection.

The sender takes the highest-priority ready partition while fewer than `window` are not yet received by
this server and the worker's credit (bytes in flight over all servers) allows, and pushes it as one frame.
The server acknowledges each contribution once summed (ACK; the RESULT itself for the last pusher). The
window must count contributions not yet *in*, not sums not yet *out*: workers submit asynchronously, so
their senders may take keys in different orders, and windows of unanswered sums can fill with disjoint
keys of which no round can ever complete (a deadlock we hit with 40 tensors in flight).
The receiver reads each RESULT straight into the output array's slice. So the push of partition i+1
overlaps the return of partition i, and both directions of the link are busy.

Why a window per server: on shaped links, a window of 4 unanswered 64 KiB partitions per server took a
prototype from 1.90x (window 1) to 1.10x the bound S/B (shared/MEASUREMENTS.md); an unbounded window
lets TCP's unfair fan-in starve some workers' pushes, and a key's sum waits for its slowest pusher.

Failover (docs/faults.md): with `saved` given, a link whose server dies keeps everything queued or unanswered,
tells `on_lost`, and hands it over by `detach`/`retire` once the scheduler has moved the server's keys. Sums are
received into the key's `Saved` copy first and only then copied to the output, so an in-place input is never
half overwritten by a sum cut off mid-frame (it is resent whole), and the copy is what the worker seeds the key's
new server with.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from gradwire.admin.metrics import Metrics
from gradwire.admin.timeline import Timeline
from gradwire.errors import (
    GradwireError,
    JobAborted,
    LocalProtocolError,
    RemoteProtocolError,
    TensorError,
    abort_error,
)
from gradwire.protocol import frames
from gradwire.protocol.frames import FrameType
from gradwire.transport import shm, tcp
from gradwire.worker.handle import Handle

log = logging.getLogger("gradwire.worker")
# a capped link with nothing it may send and no answer for this long sends one more anyway (see _wait_to_send); only
# programs whose workers order keys differently *and* block between them ever get here, and it is logged and counted
LIVENESS_SECONDS = 1.0
PACE_GIVE_UP_SECONDS = 0.2  # a paced link waits at most this long for the others to catch up (see Credit)


class Saved:
    """What a worker keeps of its last answered round of one key (allocated once per key), to seed a new server with
    after a failover: the sum it received, or, for a key it pulls only a slice of (reducescatter, alltoall), its own
    contribution, which it resends flagged REPLAY so that the round can be summed again for the ranks still waiting."""

    __slots__ = ("contribution", "data", "dtype", "round")

    def __init__(self, nbytes: int, dtype: int, contribution: bool = False) -> None:
        self.data = np.empty(nbytes, np.uint8)
        self.dtype = dtype
        self.round = -1  # none received yet
        self.contribution = contribution  # `data` is this worker's push, not the round's result


class Work:
    """One partition of one push_pull: what to send, where the sum goes, and whom to tell."""

    __slots__ = (
        "acked",
        "average",
        "credited",
        "dtype",
        "extra",
        "handle",
        "index",
        "key",
        "nbytes",
        "order",
        "partial",
        "push_bytes",
        "replayable",
        "out",
        "pull_slot",
        "push_slot",
        "round",
        "seed",
        "send",
        "t_pushed",
        "t_queued",
        "t_result",
        "t_sent",
        "tensor",
    )

    def __init__(
        self,
        tensor: str,
        key: int,
        rnd: int,
        dtype: int,
        send: np.ndarray,
        out: np.ndarray,
        average: int,
        handle: Handle | None,
        index: int = 0,
        seed: int = 0,
        partial: bool = False,
        replayable: bool = False,
    ) -> None:
        self.tensor, self.key, self.round, self.dtype, self.index = tensor, key, rnd, dtype, index
        self.order: tuple = ()  # the job-wide order of flow control, set when queued (see ServerLink._next)
        self.send = memoryview(send).cast("B")
        self.push_bytes = len(self.send)  # what this worker contributes (a gather's part may be short, or empty)
        self.extra: memoryview | None = None  # bytes pushed after the data (`trail`)
        self.out = out
        self.nbytes = out.nbytes  # what it pulls
        self.partial = partial  # it pulls only its slice of the key's result (so holds no sum to seed a failover)
        self.replayable = replayable  # a sliced round's: its contribution is kept instead (see Saved)
        self.average = average
        self.handle = handle
        self.acked = False  # the server has our contribution: the window slot and credit are free again
        self.credited = False  # holds credit (taken by the sender, given back on its ACK)
        # resent after a failover, no answer expected: a sum this worker holds (SEED) or its contribution (REPLAY)
        self.seed = seed
        self.push_slot = shm.NO_SLOT  # shared slots in use (same-host links only)
        self.pull_slot = shm.NO_SLOT
        # when it was queued, taken by the sender, fully sent, and answered (time.monotonic): the stages
        self.t_queued = self.t_sent = self.t_pushed = self.t_result = 0.0

    def trail(self, extra: memoryview | None) -> Work:
        """Push `extra` after the data (a server-side update's trailer: protocol/update.py)."""
        if extra is not None:
            self.extra = extra
            self.push_bytes += len(extra)
        return self


class LostLink:
    """Stands in for a server that died before this worker connected: its keys were moved onto the others."""

    transport = "lost"

    class _NoConnection:
        peer = "(lost)"

        def send(self, parts: object) -> None:
            pass

        def close(self) -> None:
            pass

    def __init__(self, server: int, redirect: Callable[[Work, int], None]) -> None:
        self.server = server
        self.conn = self._NoConnection()
        self._redirect = redirect

    def submit(self, work: Work, priority: int) -> None:
        self._redirect(work, priority)

    def outstanding(self) -> list[str]:
        return []

    def start(self) -> None:
        pass

    def close(self, reason: BaseException) -> None:
        pass

    def join(self, timeout: float) -> None:
        pass


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
    waited PACE_GIVE_UP_SECONDS goes anyway, so no order of events can hang on it.
    """

    def __init__(self, limit: int, lead: int = 0) -> None:
        self.limit = limit
        self.used = 0
        self.lead = lead
        self._shares: dict[int, float] = {}  # paced server -> its share
        self._queued: dict[int, int] = {}  # paced server -> bytes submitted, not yet sent
        self._cond = threading.Condition()
        # senders waiting for their turn (pacing) and for credit: wake-ups only where one may now go (a release of
        # credit woke every paced sender of the worker, eight at n = 8, most of them to wait again)
        self._pace_waiters = 0
        self._credit_waiters = 0
        # the network links' use, for the scheduler's drift check (tuning.Drift): the time some push over a socket was
        # unacknowledged, and the bytes acknowledged; shared-memory links move bytes at memory speed and are not counted
        self._net_used = 0
        self._busy_since = 0.0
        self.busy_seconds = 0.0
        self.busy_bytes = 0

    def busy(self) -> tuple[float, int]:
        """(seconds some push over a network link was unacknowledged, bytes acknowledged on network links)."""
        with self._cond:
            now = time.monotonic()
            return self.busy_seconds + (now - self._busy_since if self._net_used else 0.0), self.busy_bytes

    def set_lead(self, lead: int) -> None:
        """The pacing lead from now on (it is a number of partitions' bytes: the partition size changed)."""
        with self._cond:
            self.lead = lead
            self._cond.notify_all()

    def pace(self, server: int, share: float) -> None:
        """Pace the link to `server` (from now on) with this share of the bytes."""
        if self.lead <= 0 or share <= 0:
            return
        with self._cond:
            self._shares[server] = share
            self._queued.setdefault(server, 0)

    def unpace(self, server: int) -> None:
        """The link is gone (its work moves elsewhere): nobody waits for it any more."""
        with self._cond:
            self._shares.pop(server, None)
            self._queued.pop(server, None)
            self._cond.notify_all()

    def queue(self, server: int, n: int) -> None:
        """`n` more bytes are waiting to be sent to `server`."""
        if server in self._shares:
            with self._cond:
                if server in self._queued:
                    self._queued[server] += n
                    if self._pace_waiters:  # more behind: its own sender's turn may have come
                        self._cond.notify_all()

    def _behind(self, server: int) -> float:
        return self._queued[server] / self._shares[server]

    def _may_send(self, server: int) -> bool:
        if server not in self._shares:
            return True
        return self._behind(server) + self.lead >= max(self._behind(s) for s in self._shares)

    def _has_credit(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    def acquire(self, n: int, server: int = -1, network: bool = False) -> None:
        """Take `n` bytes of credit for a push to `server` (its turn, when paced); `network`: over a socket."""
        with self._cond:
            if not self._may_send(server):
                self._pace_waiters += 1
                try:
                    if not self._cond.wait_for(lambda: self._may_send(server), PACE_GIVE_UP_SECONDS):
                        log.debug(
                            "pacing: the link to server %d waited %.1f s and goes anyway", server, PACE_GIVE_UP_SECONDS
                        )
                finally:
                    self._pace_waiters -= 1
            if not self._has_credit(n):
                self._credit_waiters += 1
                try:
                    self._cond.wait_for(lambda: self._has_credit(n))
                finally:
                    self._credit_waiters -= 1
            self.used += n
            if network:
                if not self._net_used:
                    self._busy_since = time.monotonic()
                self._net_used += max(n, 1)
            if server in self._queued:
                self._queued[server] = max(0, self._queued[server] - n)
                if self._pace_waiters:  # the others' turn may have come
                    self._cond.notify_all()

    def release(self, n: int, network: bool = False, acked: bool = True) -> None:
        """Give back the credit of `n` bytes pushed (`acked`: the server has them; else abandoned, after a failover)."""
        with self._cond:
            self.used -= n
            if network:
                self._net_used -= max(n, 1)
                self.busy_bytes += n if acked else 0
                if not self._net_used:
                    self.busy_seconds += time.monotonic() - self._busy_since
            if self._credit_waiters:  # pacing does not depend on the credit in use: only these may go now
                self._cond.notify_all()


class ServerLink:
    """The connection to one server. `submit` is thread-safe; the two threads are the link's own."""

    def __init__(
        self,
        conn: tcp.Connection,
        server: int,
        rank: int,
        epoch: int,
        window: int,
        credit: Credit,
        arena: shm.Arena | None = None,
        metrics: Metrics | None = None,
        timeline: Timeline | None = None,
        unanswered_cap: int = 0,
        saved: dict[int, Saved] | None = None,
        on_lost: Callable[[ServerLink, BaseException], None] | None = None,
    ) -> None:
        self.conn, self.server, self.rank, self.epoch = conn, server, rank, epoch
        self.metrics = metrics or Metrics("worker")
        self.timeline = timeline
        self.transport = "shm" if arena else ("unix" if conn.sock.family == socket.AF_UNIX else "tcp")
        self.network = arena is None  # bytes cross a socket (counted for the drift check: Credit.busy)
        self.arena = arena  # one push slot per window place, so a free one always exists when the window allows
        self.window = self._fitting(window)
        self.unanswered_cap = unanswered_cap
        self._last_answer = 0.0  # when a sum last came back on this link
        self.capped_sends = 0  # partitions sent past a full cap because they come first in the job-wide order
        self.cap_escapes = 0  # partitions sent past the cap by the liveness rule (see LIVENESS_SECONDS)
        self.capped_seconds = 0.0  # time the sender had work and window room, but the cap held all of it
        self.full_seconds = 0.0  # time the sender had work but the window was full (waiting for the server's ACKs)
        self.credit = credit
        self._heap: list[tuple[int, int, Work]] = []
        self._order = itertools.count()
        self._pending: dict[int, Work] = {}
        self._in_flight = 0
        self._closed: BaseException | None = None
        self.saved = saved  # key -> its last sum (failover on), shared by the worker's links
        self._on_lost = on_lost
        self.lost: BaseException | None = None  # the server died; work is kept for the failover
        self._redirect: Callable[[Work, int], None] | None = None  # once retired: where submits go instead
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._free_push = list(range(arena.push)) if arena else []
        self._free_pull = list(range(arena.pull)) if arena else []

    def _fitting(self, window: int) -> int:
        """`window`, within the push slots of this link's shared memory: made for the window of the link's start, so
        a window raised later (RETUNE) would send a push with no free slot to put it in."""
        return min(window, self.arena.push) if self.arena is not None else window

    def set_flow(self, window: int, unanswered_cap: int) -> None:
        """The window and the cap on unanswered partitions from now on (the scheduler re-derived them). Thread-safe."""
        with self._cond:
            self.window, self.unanswered_cap = self._fitting(window), unanswered_cap
            self._cond.notify_all()

    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"gw-send-{self.server}", daemon=True),
            threading.Thread(target=self._recv_loop, name=f"gw-recv-{self.server}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def join(self, timeout: float) -> None:
        """Wait for both threads to end (after `close`)."""
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)

    def submit(self, work: Work, priority: int) -> None:
        """Queue a partition; higher priority leaves first, equal priorities in submission order."""
        work.order = (work.round, -priority, work.tensor, work.index)  # the same on every worker
        with self._cond:
            if self._closed is not None:
                assert work.handle is not None
                work.handle.fail(self._lost(self._closed))
                return
            redirect = self._redirect
            if redirect is None:
                work.t_queued = time.monotonic()
                heapq.heappush(self._heap, (-priority, next(self._order), work))
                if not work.seed:
                    self.credit.queue(self.server, work.push_bytes)
                self._cond.notify()
                return
        redirect(work, priority)  # this server is gone and its keys have moved

    def outstanding(self) -> list[str]:
        """Tensors with partitions queued or unanswered on this link (for timeout messages)."""
        with self._cond:
            return sorted({w.tensor for w in self._pending.values()} | {w.tensor for _, _, w in self._heap})

    def close(self, reason: BaseException) -> None:
        """Fail everything queued or in flight with `reason` and stop both threads."""
        with self._cond:
            if self._closed is None:
                self._closed = reason
            failed = [w for _, _, w in self._heap] + list(self._pending.values())
            self._heap.clear()
            self._pending.clear()
            self._cond.notify_all()
        self.credit.unpace(self.server)
        for work in failed:
            if work.handle is not None:
                work.handle.fail(self._lost(reason))
        self.conn.close()
        if self.arena is not None and threading.current_thread() not in self._threads:
            self.arena.close()

    def _broken(self, error: GradwireError) -> None:
        """The connection failed. A dead server (closed connection) with failover on: keep the work, tell the
        worker, wait for `detach`. Anything else (an abort, a protocol error, failover off): fail everything."""
        if self._on_lost is None or not isinstance(error, tcp.ConnectionClosed):
            self.close(error)
            return
        with self._cond:
            if self._closed is not None or self.lost is not None:
                return
            self.lost = error
            self._cond.notify_all()
        self.conn.close()  # wakes the other thread
        self._on_lost(self, error)

    def detach(self, timeout: float) -> list[Work]:
        """After the server died: stop both threads and take every partition it had not answered (queued ones
        too), ready to push again elsewhere. Submits keep queuing here until `retire`."""
        with self._cond:
            if self.lost is None:  # the scheduler saw the death first
                self.lost = tcp.ConnectionClosed(f"server {self.server} was declared lost by the scheduler")
            self._cond.notify_all()
        self.conn.close()
        self.join(timeout)
        with self._cond:
            works = list(self._pending.values()) + [w for _, _, w in sorted(self._heap)]
            self._pending.clear()
            self._heap.clear()
            self._in_flight = 0
        self.credit.unpace(self.server)
        for work in works:
            if work.credited and not work.acked:
                self.credit.release(work.push_bytes, self.network, acked=False)
            work.acked = work.credited = False
            work.push_slot = work.pull_slot = shm.NO_SLOT
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        return [w for w in works if not w.seed]

    def retire(self, redirect: Callable[[Work, int], None]) -> list[Work]:
        """From now on submits go to `redirect`; returns what was queued here since `detach`."""
        with self._cond:
            works = [w for _, _, w in sorted(self._heap)]
            self._heap.clear()
            self._redirect = redirect
        return works

    def _lost(self, reason: BaseException) -> GradwireError:
        if isinstance(reason, GradwireError) and not isinstance(reason, tcp.ConnectionClosed):
            return reason
        return JobAborted(
            f"worker {self.rank} lost server {self.server} ({self.conn.peer}): {reason}", server=self.server
        )

    def _send_loop(self) -> None:
        try:
            self._send_all()
        except Exception as e:  # a bug here must fail this link's calls with its cause, not leave them waiting
            log.exception("worker %d: the sender to server %d failed", self.rank, self.server)
            self.close(LocalProtocolError(f"worker {self.rank}: the sender to server {self.server} failed: {e!r}"))

    def _send_all(self) -> None:
        header = bytearray(frames.HEADER_SIZE)
        while True:
            with self._cond:
                work = self._wait_to_send()
                if work is None:
                    return
                if not work.seed:
                    self._in_flight += 1
                    self._pending[work.key] = work
                    if self.arena is not None:
                        work.push_slot = self._free_push.pop()
                        work.pull_slot = self._free_pull.pop() if self._free_pull else shm.NO_SLOT
            if work.seed:
                if not self._send_seed(header, work):
                    return
                continue
            self.credit.acquire(work.push_bytes, self.server, self.network)
            work.credited = True
            work.t_sent = time.monotonic()
            if self.timeline:
                self.timeline.counter("bytes in flight", work.t_sent, self.credit.used)
            if self.arena is not None:
                self._push_shared(header, work)
                continue
            self._pack_push(header, work)
            if not self._send([header, work.send] if work.extra is None else [header, work.send, work.extra]):
                return
            work.t_pushed = time.monotonic()
            self.metrics.pushed(work.push_bytes)

    def _send(self, parts: list) -> bool:
        """Send one frame; False (and the link broken) if the connection failed."""
        try:
            self.conn.send(parts)
        except GradwireError as e:
            self._broken(e)
            return False
        return True

    def _send_seed(self, header: bytearray, work: Work) -> bool:
        """A sum (SEED) or a contribution (REPLAY) this worker holds, for the key's new server (always on the socket,
        never a shared slot)."""
        self._pack_push(header, work, work.seed)
        return self._send([header, work.send])

    def _pack_push(self, header: bytearray, work: Work, flags: int = 0, status: int = 0) -> None:
        """The PUSHPULL header of `work` into `header`."""
        frames.pack_header_into(
            header,
            FrameType.PUSHPULL,
            work.push_bytes,
            work.dtype,
            self.epoch,
            self.rank,
            work.key,
            work.round,
            flags,
            status,
        )

    def _wait_to_send(self) -> Work | None:
        """Wait (holding the condition) for the next partition that may go and take it off the queue; None once the
        link is closed.

        Two limits. The window: partitions not yet acknowledged (received and summed) by the server, which bounds
        what queues on the link. The cap on unanswered partitions (pushed, sum not yet back), which keeps a fast
        worker from running ahead of the rounds: with TCP's unfair fan-in into a server, a round completes only when
        its slowest pusher delivers, so workers racing ahead leave the pull direction idle (measured at n = 8 on
        50 Mbit/s links: 1.36-1.59x the bound S/B without the cap).

        A capped link may still send a partition that comes before one of its unanswered ones in the job-wide order
        (round, then priority, then tensor name and partition index: the same for every worker). That makes the cap
        deadlock-free whatever order workers submit in: the earliest partition not yet summed everywhere is never
        held back, since everything a worker has unanswered comes after it. So in training, where each worker's
        backward hooks submit keys at their own moments and in their own order, the cap never stalls the link it
        bounds; it only stops a worker that has submitted *later* work (the next round, lower priorities) from
        pushing it while earlier sums are out. (The earlier rule, a fixed 100 ms escape, stalled every server link
        to one partition per 100 ms in training: 7.5 s a step against DDP's 2.2 s.)
        """
        capped_since: float | None = None  # since when the cap has held back every queued partition
        work = None
        while work is None and self._closed is None and self.lost is None:
            if not (self._heap and (self._heap[0][2].seed or self._in_flight < self.window)):
                capped_since = self._end_capped(capped_since)  # now the window (or an empty queue) holds it
                full = time.monotonic() if self._heap else 0.0
                self._cond.wait()
                if full:
                    self.full_seconds += time.monotonic() - full
                continue
            work = self._next()
            if work is not None:
                break
            now = time.monotonic()
            capped_since = capped_since or now
            if now - max(capped_since, self._last_answer) > LIVENESS_SECONDS:
                self.cap_escapes += 1
                log.warning(
                    "worker %d: the cap on unanswered partitions to server %d held every queued partition for "
                    "%.1f s with no answer; sending one anyway (workers pushing keys in different orders and "
                    "waiting in between)",
                    self.rank,
                    self.server,
                    LIVENESS_SECONDS,
                )
                work = heapq.heappop(self._heap)[2]
            else:
                self._cond.wait(LIVENESS_SECONDS / 4)
        self._end_capped(capped_since)
        return work

    def _end_capped(self, since: float | None) -> None:
        """Count the time the cap held every queued partition back (since `since`, if it did)."""
        if since is not None:
            self.capped_seconds += time.monotonic() - since

    def _next(self) -> Work | None:
        """The highest-priority queued partition the cap lets go (see `_wait_to_send`), taken off the queue."""
        top = self._heap[0][2]
        if top.seed or not self.unanswered_cap or len(self._pending) < self.unanswered_cap:
            return heapq.heappop(self._heap)[2]
        latest = max(w.order for w in self._pending.values())
        best = None
        for i, (_, _, work) in enumerate(self._heap):
            if work.order < latest and (best is None or self._heap[i] < self._heap[best]):
                best = i
        if best is None:
            return None
        entry = self._heap[best]
        self._heap[best] = self._heap[-1]
        self._heap.pop()
        if best < len(self._heap):
            heapq.heapify(self._heap)
        self.capped_sends += 1
        return entry[2]

    def _push_shared(self, header: bytearray, work: Work) -> None:
        """Copy the partition into its push slot and send the header alone (transport/shm.py)."""
        assert self.arena is not None
        slot = self.arena.push_slot(work.push_slot, work.push_bytes)
        np.copyto(slot[: len(work.send)], np.frombuffer(work.send, np.uint8))
        if work.extra is not None:
            np.copyto(slot[len(work.send) :], np.frombuffer(work.extra, np.uint8))
        self._pack_push(header, work, shm.SHM_PAYLOAD, work.push_slot | (work.pull_slot << 16))
        if not self._send([header]):
            return
        work.t_pushed = time.monotonic()
        self.metrics.pushed(work.push_bytes)

    def _recv_loop(self) -> None:
        np.seterr(all="ignore")  # averaging inf or nan gives inf or nan, as in the sum (see server/engine.py)
        try:
            while True:
                header = self.conn.recv_header()
                if header.type == FrameType.RESULT:
                    self._on_result(header)
                elif header.type == FrameType.ACK:
                    self._on_ack(header)
                elif header.type == FrameType.ERROR:
                    self._on_error(header, frames.decode_json(self.conn.recv_body(header)))
                else:
                    raise RemoteProtocolError(f"server {self.server} sent an unexpected {header.type.name}")
        except GradwireError as e:
            self._broken(e)
        except Exception as e:  # as in _send_loop
            log.exception("worker %d: the receiver from server %d failed", self.rank, self.server)
            self.close(LocalProtocolError(f"worker {self.rank}: the receiver from server {self.server} failed: {e!r}"))

    def _take(self, key: int, remove: bool = True) -> Work:
        with self._cond:
            work = self._pending.pop(key, None) if remove else self._pending.get(key)
            if work is None:
                raise RemoteProtocolError(f"server {self.server} answered key {key:016x}, which is not in flight")
            newly_acked = not work.acked
            if newly_acked:
                work.acked = True
                self._in_flight -= 1
                if work.push_slot != shm.NO_SLOT:  # the server has summed it: the slot may take the next push
                    self._free_push.append(work.push_slot)
                    work.push_slot = shm.NO_SLOT
            if newly_acked or remove:  # a freed window place, or a freed unanswered place
                self._cond.notify()
        if newly_acked:
            self.credit.release(work.push_bytes, self.network)
        return work

    def _on_ack(self, header: frames.Header) -> None:
        work = self._take(header.key, remove=False)
        if header.round != work.round:
            raise RemoteProtocolError(
                f"server {self.server} acknowledged round {header.round} of {work.tensor!r}, expected {work.round}"
            )

    def _on_result(self, header: frames.Header) -> None:
        with self._cond:  # taken off `_pending` only once the sum is in whole: cut off, it is pushed again
            work = self._pending.get(header.key)
        if work is None:
            raise RemoteProtocolError(f"server {self.server} answered key {header.key:016x}, which is not in flight")
        work.t_result = self._last_answer = time.monotonic()
        if not work.t_pushed:  # the answer came before the sender thread stamped the end of its send
            work.t_pushed = work.t_result
        if header.round != work.round or header.length != work.nbytes:
            raise RemoteProtocolError(
                f"server {self.server} answered {work.tensor!r} round {header.round} with {header.length} bytes; "
                f"expected round {work.round} with {work.nbytes}"
            )
        out = work.out.reshape(-1).view(np.uint8)
        saved = None
        if self.saved is not None and work.replayable:
            self._keep_contribution(work)
        elif self.saved is not None and not work.partial:  # the sum goes to the key's saved copy first (see above)
            saved = self.saved.get(work.key)
            if saved is None or len(saved.data) != work.nbytes:
                saved = self.saved[work.key] = Saved(work.nbytes, work.dtype)  # once per key
        into = saved.data if saved is not None else out
        if header.flags & shm.SHM_PAYLOAD:
            if self.arena is None or header.status != work.pull_slot:
                raise RemoteProtocolError(f"server {self.server} answered in pull slot {header.status}, not ours")
            np.copyto(into, self.arena.pull_slot(work.pull_slot, work.nbytes))
        else:
            self.conn.recv_into(memoryview(into))
        self._take(header.key)
        if work.pull_slot != shm.NO_SLOT:
            with self._cond:
                self._free_pull.append(work.pull_slot)
            work.pull_slot = shm.NO_SLOT
        source = work.out
        if saved is not None:  # the saved copy keeps the sum; the output gets it (averaged) in one pass
            saved.round = work.round
            source = saved.data.view(work.out.dtype)
        if work.average > 1:
            # integers: the quotient truncated toward zero, as Horovod's average of an integer tensor
            np.divide(source, work.average, out=work.out, casting="unsafe")
        elif saved is not None:
            np.copyto(out, saved.data)
        self._record(work, time.monotonic())
        assert work.handle is not None
        work.handle.part_done()

    def _keep_contribution(self, work: Work) -> None:
        """Copy what this worker pushed in a sliced round into the key's saved copy, as the round is answered (its
        input is still the caller's until the handle completes): a dead server's replacement may need it again for
        the ranks it had not answered yet."""
        assert self.saved is not None
        saved = self.saved.get(work.key)
        if saved is None or len(saved.data) != len(work.send) or not saved.contribution:
            saved = self.saved[work.key] = Saved(len(work.send), work.dtype, contribution=True)
        saved.data[:] = work.send
        saved.round = work.round

    def _record(self, work: Work, done: float) -> None:
        """The partition's bytes pulled and its four stages, into the metrics and the timeline."""
        self.metrics.partition(
            work.nbytes,
            work.t_sent - work.t_queued,
            work.t_pushed - work.t_sent,
            work.t_result - work.t_pushed,
            done - work.t_result,
        )
        if self.timeline:
            stages = (
                ("queued", work.t_queued, work.t_sent),
                ("push", work.t_sent, work.t_pushed),
                ("wait", work.t_pushed, work.t_result),
                ("pull", work.t_result, done),
            )
            args = {"tensor": work.tensor, "key": f"{work.key:016x}", "bytes": work.nbytes, "round": work.round}
            for name, start, end in stages:
                self.timeline.complete(name, start, end, self.server, args)
            self.timeline.counter("bytes in flight", done, self.credit.used)

    def _on_error(self, header: frames.Header, body: dict) -> None:
        if body.get("abort"):
            raise abort_error(body, server=self.server, rank=self.rank)
        work = self._take(header.key)
        work.handle.fail(
            TensorError(
                f"server {self.server} refused {work.tensor!r} (key {header.key:016x}): {body.get('message')}",
                tensor=work.tensor,
                server=self.server,
                rank=self.rank,
            )
        )
