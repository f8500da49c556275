"""The rendezvous: nodes register (role, requested rank, data address); once all `num_workers + num_servers` (and
the standby servers) are in, ranks are fixed, the links are measured (GRADWIRE_PLACEMENT=auto), the placement and the
data path's settings are derived from them, and everyone gets the address book.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from gradwire.errors import GradwireError
from gradwire.protocol import messages
from gradwire.scheduler import adapt, probe
from gradwire.scheduler.declarations import Declarations
from gradwire.scheduler.node import Node
from gradwire.scheduler.placing import placement_weights
from gradwire.scheduler.roster import Roster, server_entry
from gradwire.transport import tcp

log = logging.getLogger("gradwire.scheduler")


def node_of(conn: tcp.Connection, m: messages.Register, clock_now: float) -> Node:
    """The node that registers with `m` on `conn`."""
    node = Node(
        conn,
        m.role,
        m.rank,
        m.host,
        m.port,
        slot_bytes=m.slot_bytes,
        unix=m.unix,
        host_id=m.host_id,
        admin=m.admin,
        admin_host=m.admin_host or conn.peer.rsplit(":", 1)[0],
        standby=m.standby,
        colocated=m.colocated,
        link_rate=m.link_rate,
    )
    node.heard = node.last_seen = node.answered = clock_now  # its lease starts with its registration
    return node


class Rendezvous:
    """The job's first meeting, and the address book it ends with (also for a new generation: `publish_locked`)."""

    def __init__(self, roster: Roster) -> None:
        self.roster = roster

    @property
    def expected(self) -> int:
        config = self.roster.config
        return config.num_workers + config.num_servers + config.num_standby

    def admit_locked(self, node: Node) -> None:
        """A node registered for the job's start; the last one to arrive completes the rendezvous."""
        roster = self.roster
        if len(roster.nodes) >= self.expected:
            raise GradwireError(f"job is full: {self.expected} nodes registered already")
        roster.nodes.append(node)
        log.info("registered %s from %s (%d/%d)", node.role, node.conn.peer, len(roster.nodes), self.expected)
        if len(roster.nodes) == self.expected:
            self._assign_ranks_locked()

    def _assign_ranks_locked(self) -> None:
        roster, config = self.roster, self.roster.config
        try:
            for role, count, group in (
                ("worker", config.num_workers, roster.workers),
                ("server", config.num_servers, roster.servers),
                ("standby", config.num_standby, roster.standby),
            ):
                members = [n for n in roster.nodes if _role(n) == role]
                group.extend(rank(role, count, members) if role != "standby" else _number(members, count))
        except GradwireError as e:
            roster.abort_locked(str(e))
            return
        given = all(n.link_rate > 0 for n in roster.workers + [s for s in roster.servers if not s.colocated])
        if config.placement == "auto" and not given:  # measure first, without the lock; then as below
            threading.Thread(target=self._measure_then_publish, name="gw-sched-probe", daemon=True).start()
            return
        self.publish_locked()

    def _measure_then_publish(self) -> None:
        roster = self.roster
        started = time.monotonic()
        try:
            nodes = roster.workers + [s for s in roster.servers if not s.colocated]
            hosts = probe.measure_links(nodes, roster.config.timeout)
        except GradwireError as e:
            roster.abort(f"measuring the links for GRADWIRE_PLACEMENT=auto failed: {e}")
            return
        rated = [n for n in roster.workers + roster.servers if n.link_rate]
        rates = [f"{n.role} {n.rank} {n.link_rate * 8 / 1e6:.1f} Mbit/s" for n in rated]
        log.info("measured %d links in %.1f s: %s", len(hosts), time.monotonic() - started, ", ".join(rates))
        with roster.lock:
            self.publish_locked()

    def publish_locked(self, to: list[Node] | None = None) -> None:
        """Placement weights from the split model, the declarations, and the address book for everyone (or `to`)."""
        roster, config = self.roster, self.roster.config
        weights, roster.placement_info = placement_weights(
            config.placement, roster.workers, roster.servers, config.server_efficiency
        )
        roster.tuning = adapt.derive(roster, roster.placement_info)
        if roster.tuning:
            log.info("data path tuning: %s", roster.tuning.reason)
        roster.declarations = declarations_for(roster, weights)
        book, now = roster.address_book(), roster.clock()
        for node in roster.nodes if to is None else to:
            node.answered = now  # a node's promise starts with its address book (scheduler/lease.py)
            node.conn.send_message(replace(book, rank=node.rank, standby=node.standby))
        log.info("rendezvous complete: %d workers, %d servers", len(roster.workers), len(roster.servers))

    def watch_deadline(self) -> None:
        """Abort the job when the rendezvous has not completed within GRADWIRE_TIMEOUT (a thread of its own)."""
        roster, config = self.roster, self.roster.config
        deadline = roster.clock() + config.timeout
        while not roster.done.wait(0.2):
            with roster.lock:
                if roster.workers or roster.servers:
                    return
                if roster.clock() > deadline:
                    have = {r: sum(n.role == r for n in roster.nodes) for r in ("worker", "server")}
                    roster.abort_locked(
                        f"rendezvous timed out after {config.timeout}s: {have['worker']}/{config.num_workers} "
                        f"workers and {have['server']}/{config.num_servers} servers registered"
                    )
                    return


def declarations_for(roster: Roster, weights: list[float]) -> Declarations:
    """The job's declarations, placing by `weights`, talking to the roster's servers."""
    return Declarations(
        roster.config,
        [s.slot_bytes for s in roster.servers],
        lambda rank, message: roster.servers[rank].conn.send_message(message),
        weights,
        num_workers=len(roster.workers),
        address_of=lambda rank: server_entry(roster.servers[rank]),
        local_servers=roster.local_servers,
    )


def _role(node: Node) -> str:
    return "standby" if node.standby else node.role


def _number(standby: list[Node], count: int) -> list[Node]:
    """Standby servers: ranks are assigned when one takes a dead server's place; until then -1."""
    if len(standby) != count:
        raise GradwireError(f"expected {count} standby servers, {len(standby)} registered")
    return list(standby)


def rank(role: str, count: int, nodes: list[Node]) -> list[Node]:
    """Fix ranks: requested ones are honoured, the rest fill the gaps in order of arrival."""
    if len(nodes) != count:
        raise GradwireError(f"expected {count} {role}s, {len(nodes)} registered")
    ranks: dict[int, Node] = {}
    for node in nodes:
        r = node.requested_rank
        if r is None:
            continue
        if not 0 <= r < count:
            raise GradwireError(f"{role} asked for rank {r}, outside [0, {count})")
        if r in ranks:
            raise GradwireError(f"two {role}s asked for rank {r} ({ranks[r].conn.peer} and {node.conn.peer})")
        ranks[r] = node
    free = iter(r for r in range(count) if r not in ranks)
    for node in nodes:
        if node.requested_rank is None:
            ranks[next(free)] = node
    for r, node in ranks.items():
        node.rank = r
        node.conn.peer_rank = r
    return [ranks[r] for r in range(count)]
