"""Replicas: a key's last answered round, or its server-held optimizer state, kept on another server too.

Sums (docs/faults.md): a tensor past the workers' GRADWIRE_FAILOVER_COPY_BYTES has each key's result forwarded to
the key's replica (the next live server) before any worker gets it; the replica keeps it as that key's seed
(server/engine.py), so when the key's server dies and the key moves to its replica, every round some worker has seen
is answered from there, and the workers keep no copy. Costs: one buffer per key on the replica, one more send
of each result (1/n of what the key's server sends the workers), and one server-to-server round trip per answer.

A replica that acknowledges nothing for `deadline` seconds (GRADWIRE_HEARTBEAT_TIMEOUT) while forwards wait for it is
hung: the primary reports it lost to the scheduler (`on_lost`), which fails it over as a dead server (the workers then
keep copies of every sum), and answers what waited for it, so that no worker waits on a hung replica until its
GRADWIRE_TIMEOUT.

Parameter-server mode (docs/ps-mode.md): each key of a synchronous server-side optimizer has a replica on another server
(the next live one). When its primary finishes a round, it forwards what it applied (the averaged gradient and the
round's hyper-parameters, or installed parameters, or a write) to the replica, which applies the same update to its own
copy: torch's and numpy's steps are deterministic, so the two copies stay bit-identical. The primary answers the workers
only once the replica has acknowledged, so every round a worker has seen is in the replica. When the primary dies its
keys move to their replica (scheduler), which answers rounds it has already applied without applying them again.

Costs: each server also holds its replicas' parameters and state, applies each update twice over the pool, and
sends each round's averaged gradient once more (1/n of what it sends the workers); a round's answer waits one
server-to-server round trip.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

from gradwire.errors import GradwireError, GradwireTimeout
from gradwire.protocol import frames
from gradwire.protocol.frames import REPLICA, FrameType
from gradwire.transport import endpoints, tcp

log = logging.getLogger("gradwire.server")


class _Link:
    """The primary's connection to one replica server: a sender thread (engines never block on it) and a reader
    of acknowledgements."""

    def __init__(self, conn: tcp.Connection, rank: int) -> None:
        self.conn, self.rank = conn, rank
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: dict[int, Callable[[], None]] = {}
        self.since: dict[int, float] = {}  # when each pending forward was queued (time.monotonic)
        self.lock = threading.Lock()
        self.dead = False

    def flush(self, why: BaseException, answer: bool = True) -> None:
        """The replica is gone: answer everything waiting for it, and forward nothing more. Not when this server is
        the one stopping (`answer` False): a round its replica never got must not reach any worker, or a failover
        would find it nowhere."""
        with self.lock:
            if not self.dead and answer:
                log.warning("replica server %d lost (%s): its keys go on without a replica", self.rank, why)
            self.dead = True
            waiting, self.pending, self.since = list(self.pending.values()), {}, {}
        for done in waiting if answer else ():
            done()
        self.conn.close()


class Replicas:
    """A primary server's forwards to the servers that replicate its keys. Thread-safe."""

    def __init__(
        self,
        rank: int,
        secret: bytes,
        max_payload: int,
        timeout: float,
        host_id: str = "",
        buffer_bytes: int = 0,
        transport: str = "auto",
        deadline: float = 0.0,
        on_lost: Callable[[int, str], None] | None = None,
    ) -> None:
        self.rank, self._secret, self._max_payload, self._timeout = rank, secret, max_payload, timeout
        # a replica on this host and namespace is reached by Unix socket, as workers reach servers
        # (endpoints.connect_node)
        self._host_id, self._buffer_bytes, self._transport = host_id, buffer_bytes, transport
        self._links: dict[int, _Link] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.forwarded = 0
        self._closed = False  # this server is stopping: nothing more is forwarded, or answered
        self._deadline, self._on_lost = deadline, on_lost  # a replica silent that long is reported (0: never)
        self._watching = False

    def ensure(self, rank: int, address: dict) -> bool:
        """Connect to replica server `rank` (once); False if it cannot be reached (its keys then go unreplicated)."""
        with self._lock:
            link = self._links.get(rank)
            if link is not None and not link.dead:
                return True
            try:
                conn, _ = endpoints.connect_node(
                    address,
                    self._host_id,
                    self._transport,
                    what=f"replica server {rank}",
                    log=log,
                    secret=self._secret,
                    role="server",
                    rank=self.rank,
                    max_payload=self._max_payload,
                    timeout=self._timeout,
                    buffer_bytes=self._buffer_bytes,
                )
            except (GradwireError, OSError) as e:
                log.warning("server %d cannot reach replica server %d at %s: %s", self.rank, rank, address, e)
                return False
            link = self._links[rank] = _Link(conn, rank)
        threading.Thread(target=self._send_loop, args=(link,), name=f"gw-replica-send-{rank}", daemon=True).start()
        threading.Thread(target=self._recv_loop, args=(link,), name=f"gw-replica-recv-{rank}", daemon=True).start()
        with self._lock:
            watch, self._watching = self._deadline > 0 and not self._watching, True
        if watch:
            threading.Thread(target=self._watch, name="gw-replica-watch", daemon=True).start()
        return True

    def _watch(self) -> None:
        """Every quarter of the deadline: a replica whose oldest waiting forward is older than it is hung."""
        while not self._closed:
            time.sleep(self._deadline / 4)
            now = time.monotonic()
            with self._lock:
                links = list(self._links.values())
            for link in links:
                with link.lock:
                    oldest = min(link.since.values(), default=now)
                if not link.dead and now - oldest > self._deadline:
                    why = f"replica server {link.rank} acknowledged no forwarded round for {now - oldest:.0f}s"
                    log.warning("server %d: %s: reported lost", self.rank, why)
                    if self._on_lost is not None:
                        self._on_lost(link.rank, why)
                    link.flush(GradwireTimeout(why))

    def forward(self, rank: int, key: int, rnd: int, code: int, parts: list, done: Callable[[], None]) -> None:
        """Send an applied update of `key` to replica server `rank`; `done()` once it is in there (or at once, if
        that replica is gone). `parts` must stay unchanged until then."""
        if self._closed:
            return
        link = self._links.get(rank)
        if link is None or link.dead:
            done()
            return
        seq = next(self._ids) & 0xFFFFFFFF
        with link.lock:
            if link.dead:
                seq = -1
            else:
                link.pending[seq] = done
                link.since[seq] = time.monotonic()
        if seq < 0:
            done()
            return
        length = sum(len(p) for p in parts)
        header = frames.encode_header(
            FrameType.PUSHPULL, length, flags=REPLICA, dtype=code, sender=self.rank, key=key, round=rnd, status=seq
        )
        link.queue.put([header, *parts])
        self.forwarded += 1

    def _send_loop(self, link: _Link) -> None:
        while (parts := link.queue.get()) is not None:
            try:
                link.conn.send(parts)
            except GradwireError as e:
                link.flush(e)
                return

    def _recv_loop(self, link: _Link) -> None:
        try:
            while True:
                header = link.conn.recv_header(idle_ok=True)
                if header.type != FrameType.ACK:
                    if header.type == FrameType.ERROR:
                        body = frames.decode_json(link.conn.recv_body(header))
                        raise GradwireError(f"replica refused an update: {body.get('message')}")
                    raise GradwireError(f"unexpected {header.type.name} frame from replica server {link.rank}")
                with link.lock:
                    done = link.pending.pop(header.status, None)
                    link.since.pop(header.status, None)
                if done is not None:
                    done()
        except GradwireError as e:
            link.flush(e)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.queue.put(None)
            link.flush(GradwireError("server stopping"), answer=False)


def acknowledge(conn: object, key: int, rnd: int, seq: int) -> None:
    """The replica's side: tell the primary its update `seq` is applied."""
    if isinstance(conn, tcp.Connection):
        try:
            conn.send([frames.encode_header(FrameType.ACK, 0, key=key, round=rnd, status=seq)])
        except GradwireError:
            pass  # the primary is gone; its keys come here by failover
