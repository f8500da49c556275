"""Placement: which server sums each partition, balanced by bytes.

The scheduler owns the one `Placement` of a job and assigns each tensor's partitions when the tensor is
first declared, so every worker receives the same map whatever order it declares in. Each partition
goes to the server that would finish it soonest: the one with the least (load + size) / weight, ties to
the lowest rank. Weights (a server's share of the bytes, from the split model: split.server_weights) default to
1; a server of weight 0 gets nothing.
"""

from __future__ import annotations

from collections.abc import Sequence


class Placement:
    """Greedy weighted least-loaded assignment. Not thread-safe: the scheduler serialises calls."""

    def __init__(self, num_servers: int, weights: Sequence[float] | None = None) -> None:
        if num_servers < 1:
            raise ValueError("need at least one server")
        self.weights = list(weights) if weights is not None else [1.0] * num_servers
        if len(self.weights) != num_servers or min(self.weights) < 0 or max(self.weights) <= 0:
            raise ValueError(f"need {num_servers} weights >= 0, some positive; got {self.weights}")
        self.loads = [0] * num_servers
        self.local_loads = [0] * num_servers  # bytes of process sets placed on their own host's servers
        self.dead: set[int] = set()

    def remove(self, server: int) -> None:
        """A server died: nothing more is assigned to it (its partitions are re-assigned by the caller)."""
        if len(self.dead | {server}) >= len(self.loads):
            raise ValueError("cannot remove the last server")
        self.dead.add(server)
        self.loads[server] = 0

    def assign(self, sizes: Sequence[int], among: Sequence[int] = ()) -> list[int]:
        """Assign partitions of the given byte sizes; returns a server rank for each, in order. `among`: only these
        servers, whatever their weights (a process set on one host: its colocated servers), where any is alive."""
        out = []
        chosen = [s for s in among if s not in self.dead]
        for size in sizes:
            if chosen:  # bytes that never cross the network: balanced apart from the rest
                server = min(chosen, key=lambda s: (self.local_loads[s] + size, s))
                self.local_loads[server] += size
                out.append(server)
                continue
            live = [s for s in range(len(self.loads)) if s not in self.dead and self.weights[s] > 0]
            if not live:  # every server with a share is gone: the rest take over, balanced by bytes
                live = [s for s in range(len(self.loads)) if s not in self.dead]
                weights = [1.0] * len(self.loads)
            else:
                weights = self.weights
            server = min(live, key=lambda s: ((self.loads[s] + size) / weights[s], s))
            self.loads[server] += size
            out.append(server)
        return out

    def imbalance(self) -> float:
        """The most loaded server's weighted load over the mean (1.0 is perfect balance)."""
        weighted = [
            load / w
            for s, (load, w) in enumerate(zip(self.loads, self.weights, strict=True))
            if s not in self.dead and w > 0
        ]
        mean = sum(weighted) / len(weighted)
        return max(weighted) / mean if mean else 1.0
