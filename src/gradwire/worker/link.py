"""A worker's link to one server: a sender and a receiver thread on one full-duplex connection.

The sender takes the next partition that flow control lets go (worker/flow.py: priority, the window, the cap, the
job-wide order) once the worker's credit (bytes in flight over all servers, and pacing: worker/credit.py) allows, and
pushes it as one frame. The server acknowledges each contribution once summed (ACK; the RESULT itself for the last
pusher). The receiver reads each RESULT straight into the output array's slice. So the push of partition i+1
overlaps the return of partition i, and both directions of the link are busy. The decisions are `Flow`'s; this
module holds only the sockets, the threads and the shared-memory slots.

Failover (docs/faults.md): with `seeds` given, a link whose server dies keeps everything queued or unanswered,
tells `on_lost`, and hands it over by `detach`/`retire` once the scheduler has moved the server's keys. Sums are
received into the key's `Seed` copy first and only then copied to the output, so an in-place input is never
half overwritten by a sum cut off mid-frame (it is resent whole), and the copy is what the worker seeds the key's
new server with; a held key's sum stays in the output until every worker has it instead (worker/holding.py: the
sender says what came in, RECEIVED, ahead of its next pushes).
"""

from __future__ import annotations

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
)
from gradwire.protocol import frames
from gradwire.protocol.frames import HELD, FrameType
from gradwire.transport import shm, tcp
from gradwire.worker.answers import Answers
from gradwire.worker.credit import Credit
from gradwire.worker.flow import LIVENESS_SECONDS, Flow
from gradwire.worker.holding import Holds, release
from gradwire.worker.work import Seed, Work

log = logging.getLogger("gradwire.worker")
# partitions that flow control lets go together leave in one send, within these bounds: small partitions then cost one
# system call and one wake-up of the sender for several, and a large one still goes alone
SEND_BATCH_BYTES = 256 << 10
SEND_BATCH_FRAMES = 64


class ServerLink(Answers):
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
        seeds: dict[int, Seed] | None = None,
        on_lost: Callable[[ServerLink, BaseException], None] | None = None,
    ) -> None:
        self.conn, self.server, self.rank, self.epoch = conn, server, rank, epoch
        self.metrics = metrics or Metrics("worker")
        self.timeline = timeline
        self.transport = "shm" if arena else ("unix" if conn.sock.family == socket.AF_UNIX else "tcp")
        self.network = arena is None  # bytes cross a socket (counted for the drift check: Credit.busy)
        self.arena = arena  # one push slot per window place, so a free one always exists when the window allows
        self.flow = Flow(self._fitting(window), unanswered_cap)  # the queue and the rule; guarded by _cond
        self.credit = credit
        self._closed: BaseException | None = None
        self.seeds = seeds  # key -> its last sum (failover on), shared by the worker's links
        self._on_lost = on_lost
        self.lost: BaseException | None = None  # the server died; work is kept for the failover
        self._redirect: Callable[[Work, int], None] | None = None  # once retired: where submits go instead
        self._cond = threading.Condition()
        self.holds = Holds(self._cond, server)  # answered partitions of held keys, until every worker has them
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
            self.flow.set_limits(self._fitting(window), unanswered_cap)
            self._cond.notify_all()

    @property
    def window(self) -> int:
        return self.flow.window

    @property
    def unanswered_cap(self) -> int:
        return self.flow.cap

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
        self.submit_all([work], priority)

    def submit_all(self, works: list[Work], priority: int) -> None:
        """Queue partitions (a call's for this server), in this order, with one wake-up of the sender."""
        with self._cond:
            redirect = self._redirect
            if self._closed is not None:
                for work in works:
                    assert work.handle is not None
                    work.handle.fail(self._lost(self._closed))
                return
            if redirect is None:
                now = time.monotonic()
                for work in works:
                    work.t_queued = now
                    self.flow.push(work, priority)
                queued = sum(work.push_bytes for work in works if not work.seed)
                if queued:  # seeds take no credit
                    self.credit.queue(self.server, queued)
                self._cond.notify()
                return
        for work in works:
            redirect(work, priority)  # this server is gone and its keys have moved

    def unanswered(self, keys: list[int]) -> dict[int, int]:
        """key -> the round of it queued or unanswered on this link, of `keys` (a failover's report)."""
        with self._cond:
            return self.flow.rounds(keys)

    def outstanding(self) -> list[str]:
        """Tensors with partitions queued or unanswered on this link (for timeout messages; held ones: `held`)."""
        with self._cond:
            return sorted(self.flow.tensors())

    def held(self) -> list[str]:
        """Tensors with sums answered here and held until the server says every worker has them."""
        with self._cond:
            return sorted(self.holds.tensors())

    def close(self, reason: BaseException) -> None:
        """Fail everything queued or in flight with `reason` and stop both threads."""
        with self._cond:
            if self._closed is None:
                self._closed = reason
            failed = self.flow.take_all()
            self._cond.notify_all()
        failed += release(self.holds.take_all(), self.seeds)
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
            works = self.flow.take_all()
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
            works = self.flow.take_queued()
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
        headers = memoryview(bytearray(frames.HEADER_SIZE * SEND_BATCH_FRAMES))
        while True:
            with self._cond:
                batch = self._wait_to_send()
                receipts = self.holds.take_receipts()
                if not batch and (not receipts or self._closed is not None or self.lost is not None):
                    return
                if self.arena is not None:
                    self._take_slots(batch)
            if receipts and not self._send_receipts(receipts):
                return
            if batch and not self._send_batch(batch, headers):
                return
            batch = []  # not the last partitions sent while waiting: they would keep their calls' outputs alive

    def _send_receipts(self, receipts: list[tuple[int, int]]) -> bool:
        """Tell the server which held sums are in (RECEIVED), ahead of the next pushes; False if the connection
        failed."""
        try:
            self.conn.send([frames.encode_entries(FrameType.RECEIVED, receipts, epoch=self.epoch, sender=self.rank)])
        except GradwireError as e:
            self._broken(e)
            return False
        return True

    def _take_slots(self, batch: list[Work]) -> None:
        """(Holding the condition.) The shared slots of the pushes in `batch`, in flight now (Flow)."""
        for work in batch:
            if not work.seed:
                work.push_slot = self._free_push.pop()
                work.pull_slot = self._free_pull.pop() if self._free_pull else shm.NO_SLOT

    def _send_batch(self, batch: list[Work], headers: memoryview) -> bool:
        """Push the partitions of `batch` in as few sends as credit allows (one, unless some must wait for credit);
        False (and the link broken) if the connection failed."""
        parts: list = []
        sent: list[Work] = []
        for i, work in enumerate(batch):
            header = headers[i * frames.HEADER_SIZE : (i + 1) * frames.HEADER_SIZE]
            if work.seed:  # a sum (SEED) or a contribution (REPLAY) for the key's new server: no credit, never shared
                self._pack_push(header, work, work.seed)
                parts += (header, work.send)
                continue
            if not self.credit.acquire(work.push_bytes, self.server, self.network, wait=False):
                if parts and not self._send_pushes(parts, sent):
                    return False
                parts, sent = [], []
                self.credit.acquire(work.push_bytes, self.server, self.network)
            work.credited = True
            work.t_sent = time.monotonic()
            if self.timeline:
                self.timeline.counter("bytes in flight", work.t_sent, self.credit.used)
            sent.append(work)
            if self.arena is not None:
                parts.append(self._push_shared(header, work))
            else:
                self._pack_push(header, work)
                parts += (header, work.send) if work.extra is None else (header, work.send, work.extra)
        return self._send_pushes(parts, sent)

    def _send_pushes(self, parts: list, sent: list[Work]) -> bool:
        """Send frames in one go; `sent`, the pushes among them, are then pushed (stamped and counted)."""
        try:
            self.conn.send(parts)
        except GradwireError as e:
            self._broken(e)
            return False
        now = time.monotonic()
        for work in sent:
            work.t_pushed = now
        self.metrics.pushed(sum(work.push_bytes for work in sent))
        return True

    def _pack_push(self, header: memoryview, work: Work, flags: int = 0, status: int = 0) -> None:
        """The PUSHPULL header of `work` into `header`."""
        if work.held:
            flags |= HELD
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

    def _wait_to_send(self) -> list[Work]:
        """Wait (holding the condition) for the next partitions flow control lets go (worker/flow.py), taken off the
        queue: the first, and with it those that follow at once up to SEND_BATCH_BYTES (small partitions: one send and
        one wake-up for several); empty once the link is closed or its server lost."""
        while self._closed is None and self.lost is None:
            now = time.monotonic()
            work = self._next(now)
            if work is not None:
                return self._more(work, now)
            if self.holds.receipts:
                return []
            wake = self.flow.wake_at()
            self._cond.wait(None if wake is None else max(0.0, wake - now))
        return []

    def _more(self, work: Work, now: float) -> list[Work]:
        """`work` and the partitions flow control lets go right after it, within SEND_BATCH_BYTES and
        SEND_BATCH_FRAMES."""
        batch, size, queued = [work], work.push_bytes, self.flow.queued
        while len(batch) < SEND_BATCH_FRAMES and queued and size + queued[0][2].push_bytes <= SEND_BATCH_BYTES:
            more = self._next(now)
            if more is None:
                break
            batch.append(more)
            size += more.push_bytes
        return batch

    def _next(self, now: float) -> Work | None:
        """`Flow.next`, with a warning where the liveness rule let a partition go."""
        escapes = self.flow.cap_escapes
        work = self.flow.next(now)
        if self.flow.cap_escapes != escapes:
            log.warning(
                "worker %d: the cap on unanswered partitions to server %d held every queued partition for %.1f s with "
                "no answer; sending one anyway (workers pushing keys in different orders and waiting in between)",
                self.rank,
                self.server,
                LIVENESS_SECONDS,
            )
        return work

    def _push_shared(self, header: memoryview, work: Work) -> memoryview:
        """Copy the partition into its push slot; returns its header, the frame to send (transport/shm.py)."""
        assert self.arena is not None
        slot = self.arena.push_slot(work.push_slot, work.push_bytes)
        np.copyto(slot[: len(work.send)], np.frombuffer(work.send, np.uint8))
        if work.extra is not None:
            np.copyto(slot[len(work.send) :], np.frombuffer(work.extra, np.uint8))
        self._pack_push(header, work, shm.SHM_PAYLOAD, work.push_slot | (work.pull_slot << 16))
        return header
