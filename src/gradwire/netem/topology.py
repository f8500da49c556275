"""The emulated cluster as data: hosts, their roles, addresses and link rates, and the theoretical bounds.

Pure: no commands run here, so the model is tested without root.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SUBNET = "198.18"  # RFC 2544's range for benchmarking, used only inside namespaces this package creates

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(rate: str) -> float:
    """'100mbit' -> 1e8 bits per second (tc's spelling: kbit, mbit, gbit)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)bit\s*", rate.lower())
    if not m:
        raise ValueError(f"rate must look like 100mbit, 1gbit or 500kbit, got {rate!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class Host:
    """One emulated host: a namespace with one shaped link to the bridge."""

    name: str
    role: str  # scheduler, server or worker
    index: int
    address: str
    up: str  # tc rate of its upload (host -> bridge)
    down: str  # tc rate of its download (bridge -> host)
    delay_ms: float = 0.0


@dataclass
class Topology:
    """n worker hosts, k server hosts and a scheduler host, with per-role rates."""

    workers: int
    servers: int
    worker_rate: str = "100mbit"
    server_rate: str = "100mbit"
    delay_ms: float = 0.0
    hosts: list[Host] = field(init=False)

    def __post_init__(self) -> None:
        if self.workers < 1 or self.servers < 0 or self.workers + self.servers > 250:
            raise ValueError(f"need 1-250 hosts, got {self.workers} workers and {self.servers} servers")
        parse_rate(self.worker_rate), parse_rate(self.server_rate)
        hosts = [Host("sched", "scheduler", 0, f"{SUBNET}.0.1", "1gbit", "1gbit")]
        for i in range(self.workers):
            hosts.append(
                Host(f"w{i}", "worker", i, f"{SUBNET}.1.{i + 1}", self.worker_rate, self.worker_rate, self.delay_ms)
            )
        for i in range(self.servers):
            hosts.append(
                Host(f"s{i}", "server", i, f"{SUBNET}.2.{i + 1}", self.server_rate, self.server_rate, self.delay_ms)
            )
        self.hosts = hosts

    def of(self, role: str) -> list[Host]:
        return [h for h in self.hosts if h.role == role]

    def window_for(self, partition_bytes: int, queue_seconds: float = 0.05) -> int:
        """The largest window (1-4) such that what all workers keep in flight toward one server fits its queue.

        n x window x partition beyond the bottleneck's queue (rate x tbf latency) means drops and TCP's unfair
        fan-in, and a key's sum waits for its slowest pusher: at n = 4 and 100 Mbit/s, window 4 measured 1.28x the
        bound S/B, window 2 1.12x (docs/netem.md).
        """
        queue = parse_rate(self.server_rate) / 8 * queue_seconds
        return max(1, min(4, int(queue // (self.workers * partition_bytes))))

    # -- the model (docs/architecture.md, shared/DESIGN.md) ----------------------------------------

    def service_bound(self, nbytes: int) -> float:
        """Seconds for one push_pull of `nbytes` per worker through the k servers, at best.

        S/B when the servers together have the workers' bandwidth (k*Bs >= n*B), else the servers' links are the
        bottleneck: n*S/(k*Bs).
        """
        b, bs = parse_rate(self.worker_rate) / 8, parse_rate(self.server_rate) / 8
        if self.servers * bs >= self.workers * b:
            return nbytes / b
        return self.workers * nbytes / (self.servers * bs)

    def ring_bound(self, nbytes: int) -> float:
        """Seconds for a ring all-reduce of `nbytes` per worker, at best: 2(n-1)/n * S/B."""
        n, b = self.workers, parse_rate(self.worker_rate) / 8
        return 2 * (n - 1) / n * nbytes / b
