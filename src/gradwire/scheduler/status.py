"""The scheduler's view of the cluster: /status JSON and the node gauges of /metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwire.admin.metrics import prom
from gradwire.hosts import aggregation_groups
from gradwire.scheduler.placing import host_of

if TYPE_CHECKING:
    from gradwire.scheduler.adapt import Adaptation
    from gradwire.scheduler.elastic import Reforming
    from gradwire.scheduler.node import Node
    from gradwire.scheduler.roster import Roster


def node_state(node: Node) -> str:
    """alive, left (said bye) or lost (dropped without a bye)."""
    return "left" if node.said_bye else "lost" if node.lost else "alive"


def heartbeat_age(node: Node, now: float) -> float:
    return now - node.last_seen


def describe(node: Node, now: float) -> dict:
    return {
        "role": node.role,
        "rank": node.rank,
        "host": node.host,
        "port": node.port or None,
        "admin": f"http://{node.admin_host}:{node.admin}" if node.admin >= 0 else None,
        "state": node_state(node),
        "heartbeat_age_seconds": round(heartbeat_age(node, now), 3),
        "throughput_bytes_per_s": round(node.rate, 1),
        "rounds_per_s": round(node.round_rate, 2),
        "stats": node.stats,
    }


def local_aggregation(s: Roster) -> dict:
    """Whether the workers sum on each host first (worker/aggregation.py decides the same from the address book),
    why, and each host's workers and colocated servers."""
    hosts, colocated = [host_of(w) for w in s.workers], s.colocated_servers()
    groups, why = aggregation_groups(hosts, set(colocated))
    on = bool(groups) and s.config.local_aggregation
    return {
        "on": on,
        "why": why if s.config.local_aggregation else "GRADWIRE_LOCAL_AGGREGATION=0",
        "hosts": [{"workers": g, "colocated_servers": colocated.get(hosts[g[0]], [])} for g in groups],
    }


def _server(n: Node, loads: list[int]) -> dict:
    """A server's line in /status: the bytes placed on it, its rate, its state."""
    placed = loads[n.rank] if n.rank < len(loads) else 0
    return {"rank": n.rank, "placed_bytes": placed, "throughput_bytes_per_s": round(n.rate, 1), "state": node_state(n)}


def cluster_status(
    s: Roster, adaptation: Adaptation, membership: Reforming | None, failovers: list[dict], refusals: int
) -> dict:
    """The whole job: nodes with roles, addresses and admin ports, epoch, health, per-server load and throughput."""
    now = s.clock()
    with s.lock:
        nodes = sorted(s.nodes, key=lambda n: (n.role, n.rank))
        decls = s.declarations
        loads = list(decls.placement.loads) if decls else []
        servers = [_server(n, loads) for n in s.servers]
        phase = "aborted" if s.abort_reason else "done" if s.done.is_set() else "running" if s.workers else "rendezvous"
        return {
            "phase": phase,
            "epoch": s.epoch,
            "abort_reason": s.abort_reason,
            "expected": {
                "workers": s.config.num_workers,
                "servers": s.config.num_servers,
                "standby": s.config.num_standby,
            },
            # the current members (a failed-over server or a worker an elastic job re-formed without is history)
            "healthy": not s.abort_reason and all(node_state(n) != "lost" for n in s.workers + s.live_servers()),
            "failovers": list(failovers),
            "placement": s.placement_info,
            # the settings derived from the measured links, and why (tuning.py)
            "data_path": s.tuning and s.tuning.as_dict(),
            "local_aggregation": local_aggregation(s),
            # the drift check: the rate measured last interval against the settings', and the re-derivations so far
            "adaptation": adaptation.status() if s.config.adapt else None,
            "elastic": None
            if membership is None
            else {
                "min_workers": s.config.min_workers,
                "max_workers": s.config.worker_limit,
                "joining": len(s.joiners),
                "resets": list(membership.history),
            },
            "nodes": [describe(n, now) for n in nodes],
            "servers": servers,
            "tensors": len(decls.tensors) if decls else 0,
            "declared_bytes": decls.declared_bytes if decls else 0,
            "refused_connections": refusals,
        }


def node_families(s: Roster) -> list:
    """gradwire_nodes{role,state} and gradwire_heartbeat_age_seconds{role,rank}, computed when scraped."""
    if prom is None:
        return []
    from prometheus_client.core import GaugeMetricFamily

    now = s.clock()
    counts = GaugeMetricFamily("gradwire_nodes", "Nodes by role and state", labels=["role", "state"])
    ages = GaugeMetricFamily(
        "gradwire_heartbeat_age_seconds", "Seconds since each node was last heard from", labels=["role", "rank"]
    )
    with s.lock:
        nodes = list(s.nodes)
    tally: dict[tuple[str, str], int] = {}
    for n in nodes:
        tally[(n.role, node_state(n))] = tally.get((n.role, node_state(n)), 0) + 1
        ages.add_metric([n.role, str(n.rank)], heartbeat_age(n, now))
    for (role, state), count in sorted(tally.items()):
        counts.add_metric([role, state], count)
    return [counts, ages]
