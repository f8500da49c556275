"""Connecting a worker: the rendezvous with the scheduler, and a link to every server. To a server on this host and
network namespace a Unix socket with shared-memory slots (transport/shm.py); else TCP. Links to servers on the network
are paced against each other by the placement's weights (worker/credit.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gradwire.protocol.frames import FrameType
from gradwire.scheduler.client import join
from gradwire.transport import endpoints, shm, tcp
from gradwire.worker.link import ServerLink
from gradwire.worker.lost_link import LostLink
from gradwire.worker.native_path import NativePath
from gradwire.worker.state import WorkerState
from gradwire.worker.work import Seed, Work

log = logging.getLogger("gradwire.worker")


@dataclass
class LinkHooks:
    """What a failover needs of every link (worker/failover.py): where it keeps each key's seed, whom it tells when
    its server is lost, and how a lost server's link hands its partitions back."""

    seeds: dict[int, Seed] | None  # None: failover is off
    on_lost: Callable[[ServerLink, BaseException], None] | None
    resubmit: Callable[[Work, int], None]


class Connecting:
    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.registration: dict = {}  # what this worker registered with (its report to a resuming scheduler repeats it)

    def rendezvous(self, admin_port: int, admin_host: str) -> tuple[tcp.Connection, dict]:
        """Join the job: the scheduler connection and the address book. Also the skew of this host's wall clock
        against the scheduler's, from the book's stamp (late by its one-way trip: well under a millisecond on a LAN),
        for the timeline's time base."""
        config = self.state.config
        self.registration = {
            "port": 0,
            "admin": admin_port,
            "admin_host": admin_host,
            "host_id": endpoints.host_identity(self.state.config.host_id),
            "link_rate": config.link_rate_bytes(),
        }
        conn, book = join(config, "worker", **self.registration)
        self.state.clock_skew = (book.wall_time or time.time()) - time.time()
        return conn, book

    def connect_all(self, servers: list[dict], hooks: LinkHooks) -> None:
        """A link to every server of the address book (a lost one's keys moved: a LostLink in its place)."""
        links: list[ServerLink | LostLink] = []
        for index, server in enumerate(servers):
            links.append(LostLink(index, hooks.resubmit) if server.get("lost") else self.link(index, server, hooks))
        self.state.links = links
        self.state.loop.start()
        for link in links:
            link.start()
        self.state.native = NativePath.start(self.state, links, hooks.on_lost)  # where it applies (native_path.py)

    def link(self, index: int, server: dict, hooks: LinkHooks) -> ServerLink:
        """A link to server `index` (not started)."""
        state = self.state
        conn, arena = self._connect(server)
        assert state.credit is not None
        link = ServerLink(
            conn,
            index,
            state.rank,
            state.epoch,
            state.config.window,
            state.credit,
            arena,
            state.metrics,
            state.timeline,
            state.config.unanswered,
            seeds=hooks.seeds,
            on_lost=hooks.on_lost,
            loop=state.loop,
        )
        weights = [float(w) for w in state.placement.get("weights") or []]
        if link.transport == "tcp" and index < len(weights):  # only links on the network are paced
            state.credit.pace(index, weights[index] / sum(weights))
        return link

    def _connect(self, server: dict) -> tuple[tcp.Connection, shm.Arena | None]:
        """To a server on this host and network namespace a Unix socket with shared slots; else TCP."""
        state = self.state
        options = dict(
            secret=state.secret,
            role="worker",
            rank=state.rank,
            max_payload=state.slot_limit,  # partitions may grow to the servers' slots: a re-cut (scheduler/adapt.py)
            timeout=state.config.timeout,
            buffer_bytes=state.config.socket_buffer_bytes,
        )
        transport = state.config.transport
        host_id = endpoints.host_identity(state.config.host_id)
        conn, unix = endpoints.connect_node(server, host_id, transport, what="server", log=log, **options)  # type: ignore[arg-type]
        return conn, self._attach_shared(conn) if unix and transport == "auto" else None

    def _attach_shared(self, conn: tcp.Connection) -> shm.Arena | None:
        """Offer the server shared slots; None (plain socket transfers) if either side cannot."""
        window = self.state.config.window
        try:
            slot = max(self.state.partition_bytes, self.state.local_partition_bytes)
            arena = shm.Arena.create(window, 2 * window, slot)
        except (OSError, ValueError) as e:
            log.info("no shared memory (%s); using the socket", e)
            return None
        try:
            body = {"path": arena.path, "push": arena.push, "pull": arena.pull, "slot_bytes": arena.slot_bytes}
            conn.send_json(FrameType.SHM_ATTACH, body)
            conn.sock.settimeout(self.state.config.timeout)
            _, reply = conn.recv_json(FrameType.SHM_ATTACH)
            conn.sock.settimeout(None)
        finally:
            arena.unlink()  # mapped on both sides now (or refused): nothing stays in /dev/shm
        if not reply.get("ok"):
            log.info("server refused shared memory: %s", reply.get("error"))
            arena.close()
            return None
        return arena
