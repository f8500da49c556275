"""Liveness: every node's heartbeats (its counters, and the rates the scheduler computes from them), and the check
that finds the nodes silent for longer than GRADWIRE_HEARTBEAT_TIMEOUT. It catches what a closed connection does not:
a hung process, a host that vanished, a network partition. A silent server is failed over where it can be, a silent
worker of an elastic job re-forms it, any other silent node aborts the job naming it.
"""

from __future__ import annotations

from collections.abc import Callable

from gradwire.errors import GradwireError
from gradwire.scheduler.elastic import Reforming
from gradwire.scheduler.failover import Failover
from gradwire.scheduler.node import Node
from gradwire.scheduler.roster import Roster


class Liveness:
    def __init__(
        self, roster: Roster, failover: Failover, membership: Reforming | None, acting: Callable[[], bool]
    ) -> None:
        self.roster = roster
        self.failover = failover
        self.membership = membership
        self.acting = acting  # whether this scheduler may act for the job (scheduler/lease.py)

    def heartbeat(self, node: Node, stats: dict) -> None:
        now = self.roster.clock()
        if not isinstance(stats, dict):
            raise GradwireError(f"{node.role} {node.rank} sent a malformed heartbeat")
        try:
            moved = (stats["bytes_pushed"] + stats["bytes_pulled"]) - (
                node.stats.get("bytes_pushed", 0) + node.stats.get("bytes_pulled", 0)
            )
            elapsed = max(now - node.last_seen, 1e-6)
            node.rate = max(0.0, moved / elapsed) if node.stats else 0.0
            node.round_rate = max(0.0, (stats["rounds"] - node.stats.get("rounds", 0)) / elapsed) if node.stats else 0.0
        except (KeyError, TypeError):
            raise GradwireError(f"{node.role} {node.rank} sent a malformed heartbeat") from None
        node.stats, node.last_seen = stats, now

    def watch(self) -> None:
        """Check the heartbeats every interval until the job ends (a thread of its own)."""
        while not self.roster.done.wait(self.roster.config.heartbeat_interval):
            self.check(None)

    def check(self, now: float | None) -> list[Node]:
        """Declare lost every running node silent for longer than GRADWIRE_HEARTBEAT_TIMEOUT; returns them."""
        roster = self.roster
        now = roster.clock() if now is None else now
        timeout = roster.config.heartbeat_timeout
        with roster.lock:
            if not (roster.workers or roster.servers) or roster.over() or not self.acting():
                return []
            joiners = roster.joiners + (roster.between or [])
            silent = [
                n for n in roster.nodes if not (n.said_bye or n.lost) and now - n.heard > timeout and n not in joiners
            ]
            servers = [n for n in silent if n.role == "server" and self.failover.possible_locked(n)]
            silent = [n for n in silent if n not in servers]
            if self.membership is not None:
                for node in [n for n in silent if n.role == "worker"]:
                    self.membership.left(node, f"silent for {now - node.heard:.0f}s")
                silent = [n for n in silent if n.role != "worker"]
            for node in silent:
                node.lost = True
            if silent:
                first = silent[0]
                roster.abort_locked(
                    f"lost {first.role} {first.rank} at {first.host}: silent for {now - first.heard:.0f}s "
                    f"(GRADWIRE_HEARTBEAT_TIMEOUT={timeout:g})",
                    lost=(first.role, first.rank),
                )
        for node in servers:
            self.failover.server_lost(node, f"silent for {now - node.heard:.0f}s")
        return silent + servers
