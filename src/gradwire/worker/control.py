"""A worker's control connection to the scheduler: its requests (declarations, barriers, joins, rejoins), each
waiting for the REPLY with its id or cancelled by an abort or a membership change (`Request`), and the control thread
that hands each of the scheduler's messages to its handler (`Control`). Thread-safe: replies come on that thread."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gradwire.errors import GradwireError, GradwireTimeout, JobAborted, WorkerLost, abort_error
from gradwire.protocol import messages
from gradwire.protocol.frames import FrameType
from gradwire.transport import tcp
from gradwire.worker.state import SHUTDOWN_JOIN_SECONDS, WorkerState

log = logging.getLogger("gradwire.worker")


class Request:
    """One request in flight. `reply` is the scheduler's answer (the REPLY's result fields) once `done` is set, or
    None if it was cancelled; `callback(reply)` (or `callback(None)`) runs on the thread that answers or cancels it."""

    __slots__ = ("callback", "done", "reply")

    def __init__(self, callback: Callable[[dict | None], None] | None = None) -> None:
        self.done = threading.Event()
        self.reply: dict | None = None
        self.callback = callback

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
        self._requests: dict[int, Request] = {}  # by id, until answered
        self._ids = itertools.count(1)
        self._rejoin_id = -1  # an elastic reset's request: its reply is the new membership
        self._thread: threading.Thread | None = None

    def start(self, handlers: dict[type, Callable[[Any], None]]) -> None:
        """Serve the scheduler's messages on a thread of their own: each op to its handler, REPLY to its request,
        ABORT (or a lost connection) fails everything."""
        self._thread = threading.Thread(target=self._loop, args=(handlers,), name="gw-worker-control", daemon=True)
        self._thread.start()

    def join_thread(self) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(SHUTDOWN_JOIN_SECONDS)

    def send(self, message: messages.Message) -> None:
        """A message that expects no reply; where the scheduler cannot be reached, the control loop reports it."""
        if self.conn is None:
            return
        try:
            self.conn.send_message(message)
        except GradwireError:
            pass

    def request_async(
        self, body: messages.Request, callback: Callable[[dict | None], None] | None = None, rejoin: bool = False
    ) -> Request:
        """Send a request without waiting. With a `callback`, `callback(reply)` runs on the control thread when the
        reply comes, or `callback(None)` if an abort or a membership change cancels it first."""
        rid, request = next(self._ids), Request(callback)
        with self.state.lock:
            self._requests[rid] = request
            if rejoin:
                self._rejoin_id = rid
        assert self.conn is not None
        self.conn.send_message(replace(body, id=rid))
        return request

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
        reply = self.request(messages.Barrier())
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
        for link in self.state.links:
            link.close(error)

    def _loop(self, handlers: dict[type, Callable[[Any], None]]) -> None:
        assert self.conn is not None
        try:
            while True:
                _, body = self.conn.recv_json(FrameType.CONTROL)
                message = messages.parse(body)
                if isinstance(message, messages.Abort):
                    self.fail_all(abort_error(message.encode(), rank=self.state.rank))
                    return
                if isinstance(message, messages.Reply):
                    self._answered(message)
                elif type(message) in handlers:
                    handlers[type(message)](message)
        except GradwireError as e:
            if not self.state.closed:
                rank = self.state.rank
                self.fail_all(JobAborted(f"worker {rank} lost the scheduler: {e}", rank=rank))

    def _answered(self, reply: messages.Reply) -> None:
        """A REPLY: the request with its id is answered."""
        with self.state.lock:
            request = self._requests.pop(reply.id, None)
        if request is not None:
            request.answer(reply.result)
