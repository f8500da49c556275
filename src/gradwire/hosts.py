"""Which workers share a host, and whether local aggregation applies to the job's layout (worker/aggregation.py).

Pure: the worker decides from its address book, the scheduler reports the same decision on /status.
"""

from __future__ import annotations


def aggregation_groups(worker_hosts: list[str], colocated_hosts: set[str]) -> tuple[list[list[int]], str]:
    """The workers of each host (ranks, hosts in order of their first rank) where local aggregation applies, else
    []; and why, in words."""
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(worker_hosts):
        groups.setdefault(host, []).append(rank)
    sizes = sorted({len(g) for g in groups.values()})
    if len(groups) < 2:
        return [], "the workers share one host: nothing crosses a network link twice"
    if len(sizes) != 1:
        return [], f"hosts have different numbers of workers ({', '.join(map(str, sizes))})"
    if sizes[0] < 2:
        return [], "one worker per host: each host's link carries one copy already"
    missing = [h for h in groups if h not in colocated_hosts]
    if missing:
        return [], f"{len(missing)} worker host(s) have no colocated server to sum on"
    return sorted(groups.values()), f"{len(groups)} hosts x {sizes[0]} workers, each host's sum crosses its link once"
