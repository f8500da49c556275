"""A worker's link to one server: one full-duplex connection, both of whose directions the worker's link loop moves
(transport/loop.py: one thread for all of a worker's links).

The link pushes the next partitions that flow control lets go (worker/flow.py: priority, the window, the cap, the
job-wide order) once the worker's credit (bytes in flight over all servers, and pacing: worker/credit.py) allows
(worker/pushes.py). The server acknowledges each contribution once summed (ACK; the RESULT itself for the last
pusher). Each RESULT is read straight into the output array's slice (worker/answers.py). So the push of partition i+1
overlaps the return of partition i, and both directions of the link are busy. The decisions are `Flow`'s; this
module holds the link's life: submits, limits, closing, and a failover's hand-over.

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
from typing import Protocol

from gradwire.admin.metrics import Metrics
from gradwire.admin.timeline import Timeline
from gradwire.errors import GradwireError, JobAborted, LocalProtocolError
from gradwire.transport import shm, tcp
from gradwire.transport.loop import LinkLoop
from gradwire.worker.answers import Answers
from gradwire.worker.credit import Credit
from gradwire.worker.flow import Flow
from gradwire.worker.holding import Holds, release
from gradwire.worker.pushes import Pushes
from gradwire.worker.work import Seed, Work

log = logging.getLogger("gradwire.worker")
FAREWELL_SECONDS = 1.0  # a closing link's last frame (BYE) waits at most this long for the socket


class Borrower(Protocol):
    """What holds a link lent for good (worker/native_path.py's `NativePath`)."""

    def set_limits(self, window: int, cap: int) -> None: ...

    def stop(self, reason: BaseException) -> None: ...


class ServerLink(Answers, Pushes):
    """The connection to one server. Thread-safe; its frames move on `loop` (a loop of its own if none is given)."""

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
        loop: LinkLoop | None = None,
    ) -> None:
        self.conn, self.server, self.rank, self.epoch = conn, server, rank, epoch
        self.metrics = metrics or Metrics("worker")
        self.timeline = timeline
        self.transport = "shm" if arena else ("unix" if conn.sock.family == socket.AF_UNIX else "tcp")
        self.network = arena is None  # bytes cross a socket (counted for the drift check: Credit.busy)
        self.arena = arena  # one push slot per window place, so a free one always exists when the window allows
        self.flow = Flow(self._fitting(window), unanswered_cap)  # the queue and the rule; guarded by _lock
        self.credit = credit
        self._closed: BaseException | None = None
        self.seeds = seeds  # key -> its last sum (failover on), shared by the worker's links
        self._on_lost = on_lost
        self.lost: BaseException | None = None  # the server died; work is kept for the failover
        self._redirect: Callable[[Work, int], None] | None = None  # once retired: where submits go instead
        self._lock = threading.Lock()
        self.holds = Holds(self._lock, server)  # answered partitions of held keys, until every worker has them
        self._own_loop = loop is None
        self.loop = loop or LinkLoop(f"gw-link-{server}")
        self._removed = threading.Event()  # out of the loop: its socket closed
        self._farewell: bytes | None = None  # the frame to send last, as it closes (BYE)
        self._free_push = list(range(arena.push)) if arena else []  # the loop's
        self._free_pull = list(range(arena.pull)) if arena else []
        self.dirty = True  # see LinkLoop
        self._lent = False  # its socket handed to a native data path (`hand_over`), out of the loop, not closed
        self._borrower: Borrower | None = None  # who holds it lent for good (worker/native_path.py)
        self._init_pushes()
        self._init_answers()

    def _fitting(self, window: int) -> int:
        """`window`, within the push slots of this link's shared memory: made for the window of the link's start, so
        a window raised later (RETUNE) would send a push with no free slot to put it in."""
        return min(window, self.arena.push) if self.arena is not None else window

    def set_flow(self, window: int, unanswered_cap: int) -> None:
        """The window and the cap on unanswered partitions from now on (the scheduler re-derived them). Thread-safe."""
        with self._lock:
            self.flow.set_limits(self._fitting(window), unanswered_cap)
            self.dirty = True
            borrower = self._borrower
        if borrower is not None:
            borrower.set_limits(self.flow.window, unanswered_cap)
        self.loop.wake()

    @property
    def window(self) -> int:
        return self.flow.window

    @property
    def unanswered_cap(self) -> int:
        return self.flow.cap

    def start(self) -> None:
        if self._own_loop:
            self.loop.start()
        self.loop.add(self)

    def join(self, timeout: float) -> None:
        """Wait for the link to leave its loop (after `close`)."""
        self._removed.wait(timeout)

    def fileno(self) -> int:
        return self.conn.sock.fileno()

    def submit(self, work: Work, priority: int) -> None:
        """Queue a partition; higher priority leaves first, equal priorities in submission order."""
        self.submit_all([work], priority)

    def submit_all(self, works: list[Work], priority: int) -> None:
        """Queue partitions (a call's for this server), in this order, with one wake-up of the loop."""
        with self._lock:
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
                self.dirty = True
        if redirect is None:
            self.loop.wake()
            return
        for work in works:
            redirect(work, priority)  # this server is gone and its keys have moved

    def unanswered(self, keys: list[int]) -> dict[int, int]:
        """key -> the round of it queued or unanswered on this link, of `keys` (a failover's report)."""
        with self._lock:
            return self.flow.rounds(keys)

    def outstanding(self) -> list[str]:
        """Tensors with partitions queued or unanswered on this link (for timeout messages; held ones: `held`)."""
        with self._lock:
            return sorted(self.flow.tensors())

    def held(self) -> list[str]:
        """Tensors with sums answered here and held until the server says every worker has them."""
        with self._lock:
            return sorted(self.holds.tensors())

    def close(self, reason: BaseException, farewell: bytes | None = None) -> None:
        """Fail everything queued or in flight with `reason` and leave the loop, the socket closed (`farewell`: a last
        frame sent before, after whatever frame is half sent). A link lent for good is taken back from its borrower
        first (which fails its calls in flight with `reason`)."""
        with self._lock:
            borrower = self._borrower
        if borrower is not None:
            borrower.stop(reason)
        with self._lock:
            if self._closed is None:
                self._closed = reason
                self._farewell = farewell
            failed = self.flow.take_all()
            self._waiting = []
        failed += release(self.holds.take_all(), self.seeds)
        self.credit.unpace(self.server)
        for work in failed:
            if work.handle is not None:
                work.handle.fail(self._lost(reason))
        self.loop.remove(self)

    def hand_over(self, timeout: float, borrower: Borrower | None = None) -> int:
        """Lend the link's socket to a native data path (gradwire-native's, which takes links after Python's connect
        and handshake): the link leaves its loop, its socket open (and its shared slots mapped: the borrower may use
        them). Only a quiet link: nothing queued or unanswered, nothing read ahead. Returns the socket's descriptor;
        `take_back` ends the loan.
        `borrower`: the worker's own data path, which holds it for good (its window and cap follow `set_flow`, and
        `close` takes it back first). Raises GradwireError where the link cannot be lent."""
        with self._lock:
            busy = self.flow.queued or self.flow.pending or self._waiting or self.holds.tensors()
            if self._closed is not None or self.lost is not None or busy or self._lent:
                raise GradwireError(f"worker {self.rank}: the link to server {self.server} cannot be lent now")
            self._lent = True
            self._borrower = borrower
        if not self.loop.remove(self).wait(timeout) or self._decoder.mid_frame or self._unsent:
            self.take_back()
            raise GradwireError(f"worker {self.rank}: the link to server {self.server} was not quiet")
        return self.conn.sock.fileno()

    def take_back(self, broken: BaseException | None = None) -> None:
        """End a loan (`hand_over`): the link's frames move on its loop again; or, `broken` (the native call failed
        and the stream may be mid-frame), the link closes with it."""
        with self._lock:
            self._lent = False
            self._borrower = None
            self.dirty = True
        if broken is not None:
            self.close(broken)  # its removal from the loop (a no-op) closes the socket (`on_removed`)
            return
        self.loop.add(self)

    def on_removed(self) -> None:
        """(On the loop, or with no loop running.) Out of the loop: the last frame, then the socket and the slots."""
        if self._removed.is_set() or self._lent:
            return
        if self._farewell is not None:
            try:
                self.conn.sock.settimeout(FAREWELL_SECONDS)
                self.conn.send([*self._unsent, self._farewell])
            except (GradwireError, OSError):
                pass
        self._unsent = []
        self.conn.close()
        if self.arena is not None:
            self.arena.close()
        if self._own_loop:
            self.loop.stop(FAREWELL_SECONDS)
        self._removed.set()

    def on_error(self, error: Exception) -> None:
        """(On the loop.) A bug escaped the link's own handlers: its calls fail with it."""
        self.close(LocalProtocolError(f"worker {self.rank}: the link to server {self.server} failed: {error!r}"))

    def __repr__(self) -> str:
        return f"<ServerLink worker {self.rank} to server {self.server} ({self.conn.peer})>"

    def _broken(self, error: GradwireError) -> None:
        """The connection failed. A dead server (closed connection) with failover on: keep the work, tell the
        worker, wait for `detach`. Anything else (an abort, a protocol error, failover off): fail everything."""
        if self._on_lost is None or not isinstance(error, tcp.ConnectionClosed):
            self.close(error)
            return
        with self._lock:
            if self._closed is not None or self.lost is not None:
                return
            self.lost = error
        self.loop.remove(self)
        self._on_lost(self, error)

    def detach(self, timeout: float) -> list[Work]:
        """After the server died: take the link out of its loop and take every partition it had not answered (queued
        ones too), ready to push again elsewhere. Submits keep queuing here until `retire`."""
        with self._lock:
            if self.lost is None:  # the scheduler saw the death first
                self.lost = tcp.ConnectionClosed(f"server {self.server} was declared lost by the scheduler")
        self.loop.remove(self).wait(timeout)
        with self._lock:
            works = self.flow.take_all()
            self._waiting = []
        self.credit.unpace(self.server)
        for work in works:
            if work.credited and not work.acked:
                self.credit.release(work.push_bytes, self.network, acked=False)
            work.acked = work.credited = False
            work.push_slot = work.pull_slot = shm.NO_SLOT
        self.arena = None
        self.loop.wake()  # credit given back: other links may push
        return [w for w in works if not w.seed]

    def retire(self, redirect: Callable[[Work, int], None]) -> list[Work]:
        """From now on submits go to `redirect`; returns what was queued here since `detach`."""
        with self._lock:
            works = self.flow.take_queued()
            self._redirect = redirect
        return works

    def _lost(self, reason: BaseException) -> GradwireError:
        if isinstance(reason, GradwireError) and not isinstance(reason, tcp.ConnectionClosed):
            return reason
        return JobAborted(
            f"worker {self.rank} lost server {self.server} ({self.conn.peer}): {reason}", server=self.server
        )
