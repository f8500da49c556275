"""The scheduler's requests to the servers (the keys to sum, joins, resets, promotions): each goes with an id and
waits for the server's REPLY with it (`ack`). A server that dies is `abandon`ed at once: nothing waits for its replies,
nor sends it anything, until a standby takes its place (`revive`).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from gradwire.errors import GradwireError
from gradwire.protocol import messages

# what the scheduler asks a server, and waits for the answer of (each given a request id as it is sent)
ServerRequest = messages.Keys | messages.Reset | messages.Promote | messages.Joined

log = logging.getLogger("gradwire.scheduler")


class ServerRequests:
    def __init__(self, send: Callable[[int, messages.Message], None], timeout: float) -> None:
        self._send = send  # send(server rank, body): a control message to a server
        self.timeout = timeout
        self._acks: dict[int, tuple[threading.Event, int]] = {}  # request id -> (its reply arrived, server)
        self.dead: set[int] = set()  # servers abandoned (dead) and not yet replaced by a standby
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def ack(self, request_id: int) -> None:
        """A server confirmed the keys of request `request_id`."""
        entry = self._acks.get(request_id)
        if entry is not None:
            entry[0].set()

    def abandon(self, dead: int) -> None:
        """Server `dead` is gone: stop waiting for its replies (the requests waiting go on without them)."""
        with self._lock:
            self.dead.add(dead)
            for event, server in list(self._acks.values()):
                if server == dead:
                    event.set()

    def request(self, server: int, body: ServerRequest) -> tuple[int, threading.Event] | None:
        """Send `body` with a new request id to `server`; None if the server is dead or the send failed (a server
        whose connection fails is being failed over: the failover moves what it had)."""
        rid, event = next(self._ids), threading.Event()
        with self._lock:
            if server in self.dead:
                return None
            self._acks[rid] = (event, server)
        try:
            self._send(server, replace(body, id=rid))
        except GradwireError as e:
            log.warning("cannot send %s to server %d: %s", body.op, server, e)
            self._acks.pop(rid, None)
            return None
        return rid, event

    def answered(self, server: int, rid: int, event: threading.Event) -> bool:
        """Wait for the reply to request `rid`: True once it came, False if it did not in time or the server died."""
        try:
            return event.wait(self.timeout) and server not in self.dead
        finally:
            self._acks.pop(rid, None)

    def call(self, server: int, body: ServerRequest) -> bool:
        """Send `body` (given a request id) to a server and wait for its reply; False if none came in time (or the
        server is dead)."""
        request = self.request(server, body)
        return request is not None and self.answered(server, *request)

    def revive(self, server: int) -> None:
        """A standby takes dead server `server`'s place: requests go to it again."""
        with self._lock:
            self.dead.discard(server)
