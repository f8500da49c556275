"""A worker's control connection to the scheduler: its requests (declarations, barriers, joins, rejoins), each
waiting for the REPLY with its id or cancelled by an abort or a membership change (`Pending`), and the control thread
that hands each of the scheduler's messages to its handler (`Control`). Thread-safe: replies come on that thread."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gradwire.errors import GradwireError, GradwireTimeout, JobAborted, WorkerLost, abort_error
from gradwire.protocol import messages
from gradwire.protocol.frames import FrameType
from gradwire.scheduler import client
from gradwire.transport import tcp
from gradwire.worker.state import SHUTDOWN_JOIN_SECONDS, WorkerState

log = logging.getLogger("gradwire.worker")


class Pending:
    """One request in flight. `reply` is the scheduler's answer (the REPLY's result fields) once `done` is set, or
    None if it was cancelled; `callback(reply)` (or `callback(None)`) runs on the thread that answers or cancels it.
    `message`: what was sent (sent again to a scheduler that resumes the job)."""

    __slots__ = ("callback", "done", "message", "reply")

    def __init__(self, message: messages.Request, callback: Callable[[dict | None], None] | None = None) -> None:
        self.done = threading.Event()
        self.reply: dict | None = None
        self.callback = callback
        self.message = message

    def answer(self, body: dict) -> None:
        self.reply = body
        self.done.set()
        if self.callback is not None:
            self.callback(body)

    def cancel(self) -> None:
        """No reply will come: blocked callers wake to find none, asynchronous ones are told None."""
        self.done.set()
        if self.callback is not None:
            self.callback(None)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until answered or cancelled (at most `timeout` seconds); False if neither came in time."""
        return self.done.wait(timeout)


class Control:
    """The scheduler connection (`conn`, once the rendezvous has made it), the requests in flight, and the thread
    that reads the scheduler's messages."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.conn: tcp.Connection | None = None
        self._requests: dict[int, Pending] = {}  # by id, until answered
        self._ids = itertools.count(1)
        self._rejoin_id = -1  # an elastic reset's request: its reply is the new membership
        self._thread: threading.Thread | None = None
        self._sending = threading.Lock()  # a request is sent on the connection in use, or sent again on the next one
        self.report: Callable[[], messages.Resume] | None = None  # what this worker reports to a resuming scheduler
        self.resumes: list[dict] = []  # each time a scheduler resumed the job: when the old one was lost, how long
        self.promise = client.Promise(state.config)  # to the scheduler in charge (scheduler/lease.py)
        self.at = 0  # which of GRADWIRE_SCHEDULER's and the standbys' addresses it is at

    def start(self, handlers: dict[type, Callable[[Any], None]]) -> None:
        """Serve the scheduler's messages on a thread of their own: each op to its handler, REPLY to its request,
        ABORT (or a lost connection) fails everything."""
        self._thread = threading.Thread(target=self._loop, args=(handlers,), name="gw-worker-control", daemon=True)
        self._thread.start()

    def join_thread(self) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(SHUTDOWN_JOIN_SECONDS)

    def send(self, message: messages.Message) -> None:
        """A message that expects no reply; where the scheduler cannot be reached, it is dropped and the control loop
        reports the loss (of these, only the servers lost reach the next scheduler: in this worker's report)."""
        conn = self.conn
        if conn is None:
            return
        try:
            conn.send_message(message)
        except GradwireError:
            pass

    def request_async(
        self, body: messages.Request, callback: Callable[[dict | None], None] | None = None, rejoin: bool = False
    ) -> Pending:
        """Send a request without waiting. With a `callback`, `callback(reply)` runs on the control thread when the
        reply comes, or `callback(None)` if an abort or a membership change cancels it first."""
        rid = next(self._ids)
        request = Pending(replace(body, id=rid), callback)
        with self.state.lock:
            self._requests[rid] = request
            if rejoin:
                self._rejoin_id = rid
        assert self.conn is not None
        with self._sending:
            try:
                self.conn.send_message(request.message)
            except GradwireError:
                if not self._resumable():
                    raise
                # the scheduler is gone: the request goes to the one that resumes the job (`_resume`)
        return request

    def _resumable(self) -> bool:
        return self.state.config.scheduler_timeout > 0 and self.report is not None

    def request(self, body: messages.Request, check: bool = True, rejoin: bool = False) -> dict:
        """Send a request and wait for its reply (at most GRADWIRE_TIMEOUT)."""
        state = self.state
        if check:
            state.check_usable()
        request = self.request_async(body, rejoin=rejoin)
        if not request.wait(state.config.timeout):
            raise GradwireTimeout(f"worker {state.rank}: scheduler did not answer {body.op} in {state.config.timeout}s")
        if request.reply is None:  # woken by an abort or a membership change, not a reply
            state.check_usable()
            raise JobAborted(f"worker {state.rank}: {body.op} was cancelled", rank=state.rank)
        return request.reply

    def barrier(self) -> None:
        """Block until every worker has entered the barrier. Raises WorkerLost at once if a worker has left the
        job (shut down) and so can never enter it."""
        state = self.state
        state.barriers += 1
        number = state.barriers
        reply = self.request(messages.Barrier(number=number))
        state.barriers_passed = max(state.barriers_passed, number)
        if "error" in reply:
            raise WorkerLost(f"worker {self.state.rank}: barrier failed: {reply['error']}", int(reply["lost_rank"]))

    def cancel_requests(self) -> None:
        """Cancel every request in flight but an elastic reset's own (its reply is the new membership)."""
        with self.state.lock:
            cancelled = [r for rid, r in self._requests.items() if rid != self._rejoin_id]
            self._requests = {rid: r for rid, r in self._requests.items() if rid == self._rejoin_id}
        for request in cancelled:
            request.cancel()

    def fail_all(self, error: JobAborted) -> None:
        """The job has ended for this worker: every request and every call in flight fails with `error`."""
        self.state.abort = error
        log.error("%s", error)
        with self.state.lock:
            cancelled = list(self._requests.values())
            self._requests.clear()
        for request in cancelled:
            request.cancel()
        if self.state.native is not None:  # its calls, a lost server's parts among them (worker/native_path.py)
            self.state.native.stop(error)
        for link in self.state.links:
            link.close(error)

    def _loop(self, handlers: dict[type, Callable[[Any], None]]) -> None:
        self.promise.renew()
        while True:
            try:
                self._serve(handlers)
                return
            except GradwireError as e:
                self.promise.lost(self.conn, e)
                if self.state.closed or not self._resume(e):
                    return

    def _serve(self, handlers: dict[type, Callable[[Any], None]]) -> None:
        """The scheduler's messages, until an ABORT (returns) or the connection's loss (raises)."""
        assert self.conn is not None
        self.promise.watch(self.conn)
        while True:
            _, body = self.conn.recv_json(FrameType.CONTROL)
            message = messages.parse(body)
            if isinstance(message, messages.Beat):
                self.promise.answer(self.conn, message)
            elif isinstance(message, messages.Abort):
                self.fail_all(abort_error(message.encode(), rank=self.state.rank))
                return
            if isinstance(message, messages.Reply):
                self._answered(message)
            elif type(message) in handlers:
                handlers[type(message)](message)

    def _resume(self, error: GradwireError) -> bool:
        """The scheduler connection dropped: wait for a scheduler to resume the job (the data path goes on
        meanwhile), then send it again every request still unanswered. False (every call failed) when none did in
        GRADWIRE_SCHEDULER_TIMEOUT, or resuming is off."""
        state, rank = self.state, self.state.rank
        if not self._resumable():
            self.fail_all(JobAborted(f"worker {rank} lost the scheduler: {error}", rank=rank))
            return False
        assert self.report is not None
        lost_at = time.monotonic()
        log.warning(
            "worker %d lost the scheduler (%s); training goes on, waiting up to %gs for a scheduler to resume the job",
            *(rank, error, state.config.scheduler_timeout),
        )
        try:
            conn, resumed, self.at = client.resume(state.config, self.report, state.term, lambda: state.closed, self.at)
        except JobAborted as e:
            self.fail_all(JobAborted(f"worker {rank}: {e}", rank=rank))
            return False
        except GradwireError as e:
            self.fail_all(JobAborted(f"worker {rank} lost the scheduler ({error}), and {e}", rank=rank))
            return False
        with self._sending:
            if self.conn is not None:
                self.conn.close()
            self.conn, state.term = conn, resumed.term
            self.promise.renew()
            with state.lock:
                pending = [r.message for r in self._requests.values()]
            try:
                for message in pending:
                    conn.send_message(message)
            except GradwireError:
                pass  # it died again: the next recv finds out, and the next scheduler gets them
        self.resumes.append({"term": resumed.term, "seconds": time.monotonic() - lost_at, "resent": len(pending)})
        log.warning(
            "worker %d: the job resumed with the scheduler of term %d after %.1f s; %d requests sent again",
            *(rank, resumed.term, time.monotonic() - lost_at, len(pending)),
        )
        return True

    def _answered(self, reply: messages.Reply) -> None:
        """A REPLY: the request with its id is answered."""
        with self.state.lock:
            request = self._requests.pop(reply.id, None)
        if request is not None:
            request.answer(reply.result)
