"""The scheduler's requests to the servers (the keys to sum, joins, resets, promotions): each goes with an id and
waits for the server's REPLY with it (`ack`). A server that dies is `abandon`ed at once: nothing waits for its replies,
nor sends it anything, until a standby takes its place (`revive`).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from gradwire.errors import GradwireError
from gradwire.protocol import dtypes, messages
from gradwire.scheduler.declaration import Declaration, key_slices

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

    def register_keys(
        self, name: str, decl: Declaration, only: set[int] | None, address_of: Callable[[int], dict] | None
    ) -> None:
        """Tell each owning server (or those in `only`) its keys and wait for every answer."""
        wire = dtypes.BY_NAME[decl.dtype]
        cuts = key_slices(decl.sizes, decl.slices, wire.itemsize) if decl.slices is not None else None
        waits = []
        bodies = []
        replicas = decl.replicas or [None] * len(decl.keys)
        for server in sorted({r for r in replicas if r is not None} if only is None else set()):
            held = [
                [k, wire.code, n] for k, n, r in zip(decl.keys, decl.sizes, replicas, strict=True) if r == server
            ]  # keys whose state this server replicates: declared as any key, fed by their primaries
            bodies.append((server, messages.Keys(keys=held, name=name, key_op=decl.key_op, kept=True)))
        for server in sorted(set(decl.servers) if only is None else only):
            owned = [
                [k, wire.code, n] for k, n, s in zip(decl.keys, decl.sizes, decl.servers, strict=True) if s == server
            ]
            body = messages.Keys(keys=owned, name=name, key_op=decl.key_op)
            pairs = zip(decl.keys, decl.servers, replicas, strict=True)
            targets = {str(k): r for k, s, r in pairs if s == server and r is not None}
            if targets and address_of is not None:
                body.replicas = targets
                body.addresses = {str(r): address_of(r) for r in set(targets.values())}
            bodies.append((server, body))
        for server, body in bodies:
            body.members = decl.members
            if decl.op_args is not None:
                body.op_args = json.loads(decl.op_args)
            if cuts is not None:
                body.slices = {str(k): cuts[decl.keys.index(k)] for k, _, _ in body.keys}
            request = self.request(server, body)
            if request is not None:
                waits.append((server, *request))
        for server, rid, event in waits:
            if not self.answered(server, rid, event) and server not in self.dead:
                decl.error = f"server {server} did not confirm the keys of {name!r} in {self.timeout}s"
        decl.ready.set()
