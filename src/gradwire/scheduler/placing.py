"""The scheduler's placement weights: which share of the bytes each server sums (docs/placement.md).

Worker hosts are told apart by their host identity (several workers on one host share its link); a colocated
server belongs to the worker host with its identity. Rates are the nodes' GRADWIRE_LINK_RATE, or what
GRADWIRE_PLACEMENT=auto measured; when any node lacks one, every rate counts as equal (the model then gives BytePS's
split). `equal` gives every server the same weight, whatever runs where.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gradwire import split

if TYPE_CHECKING:
    from gradwire.scheduler.node import Node

log = logging.getLogger("gradwire.scheduler")


def placement_weights(
    mode: str, workers: Sequence[Node], servers: Sequence[Node], efficiency: float = 1.0
) -> tuple[list[float], dict]:
    """(one weight per server rank, a description for the address book and /status).

    `efficiency` scales the dedicated servers' rates in the model (GRADWIRE_SERVER_EFFICIENCY, default 1) when the
    exact optimum is a true mix of colocated and dedicated servers; a pure optimum is kept as it is. Since workers
    pace their links by these weights (worker/credit.py), the exact optimum measured fastest (docs/placement.md).
    """
    if mode == "equal":
        return [1.0] * len(servers), {"mode": mode, "weights": [1.0] * len(servers)}
    hosts: dict[str, int] = {}
    for worker in workers:
        hosts.setdefault(host_of(worker), len(hosts))
    sharing = link_sharers(workers, servers, hosts)
    host_rates, described, known = _rates(workers, servers, hosts)
    if mode == "auto":  # measured rates a few percent apart are one rate: noise must not tilt the split
        snapped = snap([*host_rates, *(r for _, r in described)])
        host_rates, described = (
            snapped[: len(host_rates)],
            [(h, r) for (h, _), r in zip(described, snapped[len(host_rates) :], strict=True)],
        )
    weights, best = split.server_weights(host_rates, described)
    if efficiency < 1 and 0.001 < best.dedicated_fraction < 0.999:
        derated = [(host, rate * efficiency if host is None else rate) for host, rate in described]
        weights, best = split.server_weights(host_rates, derated)
    else:
        efficiency = 1.0
    info = {
        "mode": mode,
        "weights": [round(w, 6) for w in weights],
        "rates_bytes_per_s": {"worker_hosts": host_rates, "servers": [r for _, r in described]} if known else None,
        "workers_per_host": sharing,
        "dedicated_fraction": round(best.dedicated_fraction, 6),
        "server_efficiency": efficiency,
        "colocated": [h is not None for h, _ in described],
    }
    log.info(
        "placement (%s): %.1f%% of the bytes to dedicated servers; weights %s",
        mode,
        100 * best.dedicated_fraction,
        info["weights"],
    )
    return weights, info


def _rates(
    workers: Sequence[Node], servers: Sequence[Node], hosts: dict[str, int]
) -> tuple[list[float], list[tuple[int | None, float]], bool]:
    """Each worker host's link rate (its slowest worker's), each server's (host index if colocated, rate), and whether
    the rates are known (every node gave or measured one; else all are 1: equal links)."""
    rated = list(workers) + [s for s in servers if not s.colocated]
    known = all(n.link_rate > 0 for n in rated)
    if not known and any(n.link_rate > 0 for n in rated):
        log.warning("some nodes gave GRADWIRE_LINK_RATE and some did not: placing as if every link were equal")
    host_rates = [0.0] * len(hosts)
    for worker in workers:
        i = hosts[host_of(worker)]
        rate = worker.link_rate if known else 1.0
        host_rates[i] = min(host_rates[i], rate) if host_rates[i] else rate
    described: list[tuple[int | None, float]] = []
    for server in servers:
        host = hosts.get(server.host_id) if server.colocated else None
        if server.colocated and host is None:
            log.warning(
                "server %d says it is colocated, but no worker runs on its host: placing it as dedicated", server.rank
            )
        rate = server.link_rate if known and server.link_rate > 0 else host_rates[host] if host is not None else 1.0
        described.append((host, rate))
    return host_rates, described, known


def link_sharers(workers: Sequence[Node], servers: Sequence[Node], hosts: dict[str, int]) -> list[int]:
    """Per worker host (numbered as in `hosts`), the workers that share its network link: all of the host's, where
    the job spans several hosts; 1 where every node runs on one host (nothing crosses a network link: shared memory
    and loopback, whose measured rate is not divided among the workers, as before several workers per host counted)."""
    if len({host_of(n) for n in [*workers, *servers]}) <= 1:
        return [1] * len(hosts)
    sharing = [0] * len(hosts)
    for worker in workers:
        sharing[hosts[host_of(worker)]] += 1
    return sharing


def host_of(node: Node) -> str:
    """The host a node runs on, as the job tells hosts apart: its host identity (transport/endpoints.host_identity), or
    the node alone where it gave none."""
    return node.host_id or f"{node.role}{node.rank}"


def snap(rates: Sequence[float], tolerance: float = 0.05) -> list[float]:
    """Rates within `tolerance` of a faster one they chain to are replaced by their group's mean (measurement noise:
    auto-measured links of one configured rate came out 1-4% apart, enough to turn k = n into a mix)."""
    order = sorted(range(len(rates)), key=lambda i: -rates[i])
    out = list(rates)
    group: list[int] = []
    for i in order + [-1]:
        if i >= 0 and group and rates[i] >= (1 - tolerance) * rates[group[0]]:
            group.append(i)
            continue
        if group:
            mean = sum(rates[j] for j in group) / len(group)
            for j in group:
                out[j] = mean
        group = [i]
    return out
