"""The roster: the scheduler's state in one place. The nodes by role, the epoch, the one lock that guards them, the
workers waiting (in a barrier, in hvd.join, to join an elastic job, to form a new generation), the placement and the
data path's settings, and how the job ends (`tell`, `abort`, `end`). Every part of the scheduler (rendezvous,
failover, synchronisation, departures, generations, liveness, elastic membership, adaptation) works on a roster and
never on another part's fields.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gradwire.config import Config
from gradwire.errors import GradwireError
from gradwire.protocol import messages
from gradwire.scheduler.declarations import Declarations
from gradwire.scheduler.node import Node
from gradwire.scheduler.placing import host_of
from gradwire.tuning import Tuning

log = logging.getLogger("gradwire.scheduler")


class Roster:
    """Who is in the job, and what they wait on. Fields are read and written with `lock` held unless they say not."""

    def __init__(self, config: Config, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock  # injected: tests drive failure detection with a fake clock, not sleeps
        self.lock = threading.Lock()
        self.epoch = 1  # goes up with every failover, elastic reset and new generation
        self.term = 1  # this scheduler's: one past the last one's where it recovered a running job (recovery.py)
        self.barriers_passed = 0  # the highest barrier number every worker has passed (Barrier.number)
        self.nodes: list[Node] = []  # every registered node, in order of arrival
        self.workers: list[Node] = []  # the members, by rank (lost and departed ones too, until a reset)
        self.servers: list[Node] = []  # by rank; a lost one stays in its place (its keys moved to the others)
        self.standby: list[Node] = []  # standby servers not yet promoted
        self.declarations: Declarations | None = None  # once ranks are fixed
        self.placement_info: dict = {}  # the placement's mode, rates and weights (in the address book, /status)
        self.tuning: Tuning | None = None  # the data path's settings derived from the links (tuning.py)
        self.rate_scale = 1.0  # the links' rate now over the one measured at the start (the drift check: adapt.py)
        self.barrier: list[tuple[Node, int]] = []  # workers in a barrier: (node, request id)
        self.joins: dict[int, tuple[Node, int, dict[str, int]]] = {}  # workers in hvd.join: (node, request, rounds)
        self.joiners: list[Node] = []  # workers waiting to join an elastic job at its next reset
        # every worker called shutdown(): the workers of the next generation as they register (generations.py)
        self.between: list[Node] | None = None
        self.ending = False  # every worker said bye; servers are being shut down
        self.done = threading.Event()  # the job has ended (set without the lock being needed to read it)
        self.abort_reason: str | None = None

    def live_workers(self) -> list[Node]:
        """The workers of the job now: not lost, not gone."""
        return [w for w in self.workers if not (w.lost or w.said_bye)]

    def live_servers(self) -> list[Node]:
        return [s for s in self.servers if not s.lost]

    def over(self) -> bool:
        """The job is ending or has ended: nothing more to recover."""
        return self.ending or self.done.is_set()

    def finishing(self) -> bool:
        """Some worker of the job has said bye (shutdown(), or its process ended): its work is done, and the others
        are finishing theirs."""
        return any(w.said_bye for w in self.workers)

    @staticmethod
    def tell(nodes: list[Node], message: messages.Message) -> None:
        """Send a control message to each node; one that cannot be reached is lost, which its connection reports."""
        for node in nodes:
            try:
                node.conn.send_message(message)
            except GradwireError:
                pass

    def abort(self, reason: str, lost: tuple[str, int] | None = None) -> None:
        """`abort_locked`, unless the job has ended meanwhile (takes the lock)."""
        with self.lock:
            if not self.done.is_set():
                self.abort_locked(reason, lost)

    def abort_locked(self, reason: str, lost: tuple[str, int] | None = None) -> None:
        """End the job for everyone, naming why (and the node lost, if one was)."""
        if self.abort_reason is None:
            self.abort_reason = reason
            log.error("aborting the job: %s", reason)
        self.tell(self.nodes, messages.Abort(reason, *(lost or (None, None))))
        self.done.set()

    def end(self, why: str) -> None:
        """Shut the servers down and end the job cleanly (takes the lock); workers still waiting to join are told."""
        with self.lock:
            servers = self.live_servers() + self.standby
            joiners = self.joiners + (self.between or [])  # a new generation that never filled up
            self.joiners, self.between = [], None
            # before the shutdowns go out: a server that closes on receiving one has not been lost
            self.ending = True
        self.tell(servers, messages.Shutdown())
        self.tell(joiners, messages.Abort("the job ended before it joined"))
        log.info("%s", why)
        self.done.set()

    def colocated_servers(self) -> dict[str, list[int]]:
        """The live colocated servers' ranks, by host."""
        by_host: dict[str, list[int]] = {}
        for server in self.live_servers():
            if server.colocated:
                by_host.setdefault(host_of(server), []).append(server.rank)
        return by_host

    def local_servers(self, members: list[int]) -> list[int]:
        """The live colocated servers on the one host that workers `members` share; [] where they span hosts."""
        hosts = {host_of(self.workers[r]) for r in members if 0 <= r < len(self.workers)}
        if len(hosts) != 1:
            return []
        (host,) = hosts
        return self.colocated_servers().get(host, [])

    def address_book(self) -> messages.AddressBook:
        """What every worker learns at the rendezvous, a reset or a new generation: where the servers are, and how."""
        # "lost": its keys moved onto the others (failover without a standby)
        servers = [server_entry(s) | {"lost": s.lost} for s in self.servers]
        return messages.AddressBook(
            epoch=self.epoch,
            num_workers=len(self.workers),
            servers=servers,
            workers=[w.host for w in self.workers],
            worker_hosts=[host_of(w) for w in self.workers],
            placement=self.placement_info,
            # derived from the links (gradwire/tuning.py); None when their rates are unknown
            tuning=self.tuning and self.tuning.as_dict(),
            wall_time=time.time(),  # the job's clock: workers align their timelines to it
            term=self.term,
            barriers=self.barriers_passed,
        )


def server_entry(server: Node) -> dict:
    """How a worker reaches a server (the address book's entry, and a promoted standby's)."""
    return {
        "host": server.host,
        "port": server.port,
        "slot_bytes": server.slot_bytes,
        "unix": server.unix,
        "host_id": server.host_id,
        "colocated": server.colocated,
    }
