"""A job's step time, predicted (`gradwire plan --predict`, docs/scaling.md): pure functions from a model's layers
(their gradient bytes and compute times), the links, n, k and the layout, for gradwire and for ring all-reduce (DDP).

The step: the forward pass, then the backward pass, which makes each layer's gradient ready in backward order (the
last layer's first); communication begins as gradients become ready and the step ends when the last sum is back (or
the backward pass ends, whichever is later), then the optimizer's step.

- gradwire: every byte of gradient goes through the summation servers like a fluid through a pipe, at the rate the
  split model gives the layout (split.py: S bytes per worker take `split.optimal`'s seconds; the pure service
  `split.service_seconds`), capped by what the window lets through a round trip (window x partition per RTT). The
  pipe drains in readiness order, so the last byte is back at max over layers of (ready time + the bytes ready from
  then on / rate), plus the last partition's trip: its pull after its push (partition / worker rate) and a round
  trip of delay.
- ring (DDP over gloo): gradients are gathered into buckets in backward order (the first 1 MiB, then 25 MiB, as
  torch's DDP does); a bucket is all-reduced once its last gradient is ready and the bucket before it is done, in
  2(n - 1)/n x bytes / rate plus 2(n - 1) one-way delays.

What it leaves out: the CPU (two cores here; the servers' CPU past one machine is given apart: `server_cores`),
the kernel's and the switch's queues, stragglers. docs/scaling.md compares it with every measured point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gradwire import split, tuning

DDP_FIRST_BUCKET = 1 << 20  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET = 25 << 20  # DistributedDataParallel's bucket_cap_mb default


@dataclass(frozen=True)
class Layer:
    """One layer of the model: its gradient's bytes, its forward and backward seconds."""

    nbytes: int
    forward_s: float
    backward_s: float


TCP_PAYLOAD = 1 / tuning.framing(tuning.ETHERNET_MTU)  # 1448 / 1514: TCP payload per frame at a 1,500-byte MTU


@dataclass(frozen=True)
class Links:
    """The job's links: each worker host's and each dedicated server's rate (bytes/s, as the link counts them:
    frames), the one-way delay (s), and the share of a frame that is payload (`TCP_PAYLOAD`; 1.0: rates are
    goodput already)."""

    worker_rate: float
    server_rate: float = 0.0
    delay: float = 0.0
    payload: float = TCP_PAYLOAD

    def goodput(self) -> Links:
        """The same links, their rates in payload bytes per second."""
        return Links(self.worker_rate * self.payload, self.server_rate * self.payload, self.delay, 1.0)


@dataclass(frozen=True)
class Prediction:
    """A step's seconds, when its communication ends (from the step's start), and the bound: the larger of the
    compute alone and the bytes alone at the layout's rate."""

    step_s: float
    comm_end_s: float
    bound_s: float

    def samples_per_s(self, batch_per_worker: int, n: int) -> float:
        return batch_per_worker * n / self.step_s


def ready_times(layers: Sequence[Layer]) -> list[tuple[float, int]]:
    """(when its gradient is ready from the step's start, its bytes), per layer in backward order."""
    t = sum(layer.forward_s for layer in layers)
    out = []
    for layer in reversed(layers):
        t += layer.backward_s
        out.append((t, layer.nbytes))
    return out


def compute_s(layers: Sequence[Layer]) -> float:
    return sum(layer.forward_s + layer.backward_s for layer in layers)


def gradwire_rate(n: int, k: int, colocated: bool, links: Links, partitions: int = 1 << 30) -> float:
    """Bytes per second of one worker's gradient through the summation servers, as the split model gives it (the
    optimal split where colocated servers run beside k dedicated ones; else the pure service). A step of fewer
    `partitions` than servers keeps only that many busy (each partition has one server)."""
    workers = [links.worker_rate] * n
    servers = [links.server_rate] * min(k, partitions)
    if colocated:
        hosts = [i < max(0, partitions - len(servers)) for i in range(n)]
        seconds = split.optimal(1.0, workers, servers, hosts if any(hosts) else None).seconds
    else:
        seconds = split.service_seconds(1.0, workers, servers)
    return float("inf") if seconds <= 0 else 1.0 / seconds


def gradwire_step(
    layers: Sequence[Layer],
    n: int,
    k: int,
    links: Links,
    colocated: bool = False,
    partition: int = 4 << 20,
    window: int = 0,
    optimizer_s: float = 0.0,
) -> Prediction:
    """gradwire's step (the module's docstring). `window`: partitions in flight per link (0: no cap); `partition`:
    the partition size, which also says how many servers a step's partitions can keep busy."""
    links = links.goodput()
    ready = ready_times(layers)
    total = sum(b for _, b in ready)
    rate = gradwire_rate(n, k, colocated, links, servers_used(1 << 30, layers, partition))
    rtt = 2 * links.delay + partition / links.worker_rate
    if window > 0 and rtt > 0 and rate != float("inf"):
        rate = min(rate, window * partition / rtt)
    if rate == float("inf"):  # one worker beside its own server: nothing crosses a link
        end = ready[-1][0] if ready else 0.0
    else:
        after, end = float(total), 0.0
        for t, nbytes in ready:
            end = max(end, t + after / rate)
            after -= nbytes
        end += min(partition, total) / links.worker_rate + 2 * links.delay
    compute = compute_s(layers)
    bound = max(compute, total / rate if rate != float("inf") else 0.0)
    return Prediction(max(compute, end) + optimizer_s, end, bound + optimizer_s)


def derived(n: int, k: int, links: Links) -> tuple[int, int]:
    """The partition size and window gradwire derives for these links (tuning.py), as a job's defaults would (from
    their goodput, which is what the scheduler measures)."""
    links = links.goodput()
    servers = k or n  # colocated servers only: one on each worker host
    t = tuning.derive([links.worker_rate] * n, 2 * links.delay, server_rates=[links.server_rate] * k, servers=servers)
    return t.partition_bytes, t.window


def buckets(layers: Sequence[Layer]) -> list[tuple[float, int]]:
    """DDP's buckets in backward order: (when the bucket's last gradient is ready, its bytes)."""
    out: list[tuple[float, int]] = []
    cap, filled, last = DDP_FIRST_BUCKET, 0, 0.0
    for t, nbytes in ready_times(layers):
        filled, last = filled + nbytes, t
        if filled >= cap:
            out.append((last, filled))
            cap, filled = DDP_BUCKET, 0
    if filled:
        out.append((last, filled))
    return out


def ring_step(layers: Sequence[Layer], n: int, links: Links, optimizer_s: float = 0.0) -> Prediction:
    """DDP over a ring all-reduce (the module's docstring)."""
    links = links.goodput()
    end = 0.0
    for ready, nbytes in buckets(layers) if n > 1 else []:
        end = max(end, ready) + 2 * (n - 1) / n * nbytes / links.worker_rate + 2 * (n - 1) * links.delay
    compute = compute_s(layers)
    total = sum(layer.nbytes for layer in layers)
    bound = max(compute, split.ring_seconds(total, [links.worker_rate] * n))
    return Prediction(max(compute, end) + optimizer_s, end, bound + optimizer_s)


def efficiency(step_at_n: float, step_at_1: float) -> float:
    """Scaling efficiency: samples/s at n over n times samples/s at 1 (the batch per worker fixed)."""
    return step_at_1 / step_at_n


def servers_used(k: int, layers: Sequence[Layer], partition: int) -> int:
    """How many of k dedicated servers a step's partitions keep busy (each partition has one server)."""
    return min(k, max(1, sum(-(-layer.nbytes // partition) for layer in layers)))


# CPU seconds a dedicated server spends per GB reduced, by its data path: 16 MiB calls of 4 MiB partitions, 4 workers
# and 4 servers over TCP on one host (`python -m benchmarks --partitions 32,4096 -n 4 -s 4 --sizes 16`, 2026-12-07:
# native 0.49-0.50, Python 0.58-0.75; docs/benchmarks.md)
SERVER_CPU_S_PER_GB = {"native": 0.5, "python": 0.7}


def server_cores(n: int, k: int, nbytes: int, step_s: float, cpu_s_per_gb: float) -> float:
    """CPU cores one of k dedicated servers keeps busy: the GB it sums per second (n x S / k per step) times the
    CPU seconds a server spends per GB reduced (measured: `gradwire bench`)."""
    return n * nbytes / k / step_s / 1e9 * cpu_s_per_gb if k and step_s > 0 else 0.0
