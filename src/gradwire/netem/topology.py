"""The emulated cluster as data: hosts, their roles, addresses and link rates, and the theoretical bounds.

Pure: no commands run here, so the model is tested without root.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gradwire.tuning import ETHERNET_MTU, framing, parse_rate

__all__ = ["ETHERNET_MTU", "Host", "Topology", "framing", "parse_rate"]

SUBNET = "198.18"  # RFC 2544's range for benchmarking, used only inside namespaces this package creates


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
    """n workers on n / per_host worker hosts, k (dedicated) server hosts and a scheduler host, with per-role rates.

    Every link carries frames of at most `mtu` bytes (Ethernet's 1500 by default; many GPU clusters run 9000, jumbo
    frames), and tc's rate counts whole frames: headers are part of the rate, as on a wire.

    With `colocate`, every worker host also runs a server (BytePS's colocated servers; k may then be 0). With
    `per_host` > 1, that many workers share each worker host and its one link, as torchrun's --nproc-per-node does:
    worker ranks host * per_host ... host * per_host + per_host - 1 run on worker host `host`.
    """

    workers: int
    servers: int
    worker_rate: str = "100mbit"
    server_rate: str = "100mbit"
    delay_ms: float = 0.0
    colocate: bool = False
    per_host: int = 1
    mtu: int = ETHERNET_MTU  # every link's MTU: Ethernet's 1500, or a data centre's jumbo frames (9000)
    hosts: list[Host] = field(init=False)

    def __post_init__(self) -> None:
        if self.per_host < 1 or self.workers % self.per_host:
            raise ValueError(f"{self.workers} workers do not fill hosts of {self.per_host} workers each")
        if self.workers < 1 or self.servers < 0 or self.worker_hosts + self.servers > 250:
            raise ValueError(f"need 1-250 hosts, got {self.worker_hosts} worker hosts and {self.servers} servers")
        if self.servers == 0 and not self.colocate:
            raise ValueError("need a server: k >= 1, or colocated servers")
        if not 576 <= self.mtu <= 9216:
            raise ValueError(f"an MTU of {self.mtu}: give 576-9216 (Ethernet's 1500, jumbo frames' 9000)")
        parse_rate(self.worker_rate), parse_rate(self.server_rate)
        hosts = [Host("sched", "scheduler", 0, f"{SUBNET}.0.1", "1gbit", "1gbit")]
        for i in range(self.worker_hosts):
            hosts.append(
                Host(f"w{i}", "worker", i, f"{SUBNET}.1.{i + 1}", self.worker_rate, self.worker_rate, self.delay_ms)
            )
        for i in range(self.servers):
            hosts.append(
                Host(f"s{i}", "server", i, f"{SUBNET}.2.{i + 1}", self.server_rate, self.server_rate, self.delay_ms)
            )
        self.hosts = hosts

    @property
    def worker_hosts(self) -> int:
        return self.workers // self.per_host

    def of(self, role: str) -> list[Host]:
        return [h for h in self.hosts if h.role == role]

    def ranks(self, host: Host) -> range:
        """The worker ranks that run on worker host `host`."""
        return range(host.index * self.per_host, (host.index + 1) * self.per_host)

    def placed_workers(self) -> list[tuple[int, Host]]:
        """(rank, host) of every worker, in rank order."""
        return [(rank, h) for h in self.of("worker") for rank in self.ranks(h)]

    def tuning(self) -> dict[str, str]:
        """gradwire's settings for links of 25-100 Mbit/s, by the number of workers (measured, 16 MiB per worker).

        What mattered, in order: a cap on unanswered partitions per server (n = 4, window 4: 1.28x the bound S/B
        without it, 1.11x with 4), then enough partitions per worker-server pair that rounds keep completing while
        the next are pushed. At n = 8 on 50 Mbit/s: 64 KiB partitions 1.42-1.47x S/B whatever the window; 32 KiB,
        window 8, cap 8: 1.29x; 16 KiB, window 8, cap 16: 1.22x. At n = 4 on 100 Mbit/s, 64 KiB with window 4 and
        cap 4: 1.11x. A window alone sized to the link's queue (what we tried first) starved the pipeline:
        window 1 measured 1.53x at n = 8 and 1.65x with 25 Mbit/s servers. docs/netem.md has the sweeps.
        Once workers paced their links (GRADWIRE_PACING), 32 KiB partitions beat 64 KiB at n = 4 (n = 4, k = 2 with
        colocated servers: 1.74 s against 1.81 s): less in flight, a shorter start and end of each step.
        """
        if self.workers >= 8:
            return {"GRADWIRE_PARTITION_BYTES": "16384", "GRADWIRE_WINDOW": "8", "GRADWIRE_UNANSWERED": "16"}
        return {"GRADWIRE_PARTITION_BYTES": "32768", "GRADWIRE_WINDOW": "4", "GRADWIRE_UNANSWERED": "4"}

    # -- the model (docs/architecture.md, shared/DESIGN.md) ----------------------------------------

    def model_bound(self, nbytes: int) -> float:
        """Seconds for one push_pull at best with gradwire's placement: the optimal split (split.py) over the k
        dedicated servers and, with `colocate`, a server on every worker host. Equals `service_bound` without."""
        from gradwire import split

        b, bs = parse_rate(self.worker_rate) / 8, parse_rate(self.server_rate) / 8
        colocated = [self.colocate] * self.worker_hosts
        return split.optimal(nbytes, [b] * self.worker_hosts, [bs] * self.servers, colocated).seconds

    def service_bound(self, nbytes: int) -> float:
        """Seconds for one push_pull of `nbytes` per worker through the k servers, at best.

        S/B when the servers together have the worker hosts' bandwidth (k*Bs >= h*B), else the servers' links are the
        bottleneck: h*S/(k*Bs). With several workers per host, the bound of a host's sum crossing its link once each
        way (local aggregation); each worker pushing its own copy takes per_host times that.
        """
        b, bs = parse_rate(self.worker_rate) / 8, parse_rate(self.server_rate) / 8
        if self.servers * bs >= self.worker_hosts * b:
            return nbytes / b
        return self.worker_hosts * nbytes / (self.servers * bs)

    def ring_bound(self, nbytes: int) -> float:
        """Seconds for a ring all-reduce of `nbytes` per worker, at best: 2(n-1)/n * S/B. With several workers per
        host, ranks in order, one ring edge leaves each host each way, so the bound is the same."""
        n, b = self.workers, parse_rate(self.worker_rate) / 8
        return 2 * (n - 1) / n * nbytes / b
