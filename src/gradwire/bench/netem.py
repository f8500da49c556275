"""`gradwire bench --netem`: gradwire push_pull against gloo's ring all_reduce across emulated links.

For each configuration both systems run in the same emulated cluster, one after the other, with the same sizes.
Each measurement is reported beside its theoretical bound (topology.py) and the CPU use of the job's processes, over
the whole job and over the timed calls alone, so that a result limited by this machine's two cores rather than by
the links is visible.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from gradwire.bench.runner import CpuSampler
from gradwire.netem import EmulatedCluster, Topology, links, parse_rate
from gradwire.netem.jobs import start_gloo, start_gradwire
from gradwire.netem.links import LinkSampler
from gradwire.tuning import ETHERNET_MTU, framing

MiB = 1 << 20
# The default matrix: n = k at equal rates, n = 4 with k = 2, and servers at a quarter of the workers' rate.
DEFAULT_CONFIGS = [
    (2, 2, "100mbit", "100mbit"),
    (4, 4, "100mbit", "100mbit"),
    (8, 8, "50mbit", "50mbit"),  # at 100 Mbit/s, 16 processes kept both cores 93% busy: the CPU, not the links
    (4, 2, "100mbit", "100mbit"),
    (4, 4, "100mbit", "25mbit"),
]


@dataclass
class Record:
    system: str
    workers: int
    servers: int
    worker_rate_bps: float
    server_rate_bps: float
    bytes: int
    seconds_median: float
    bound_seconds: float
    seconds_all: list[float]
    cpu_utilization: float  # CPU seconds of the job's processes over (wall seconds x cores)
    window: int = 0  # gradwire's GRADWIRE_WINDOW (0 for gloo)
    partition_bytes: int = 0
    colocated: bool = False  # gradwire ran a server beside each worker too
    placement: str = ""  # GRADWIRE_PLACEMENT of the gradwire job
    links_busy: dict[str, float] = field(default_factory=dict)  # with --links: mean use per kind of link (links.py)
    per_host: int = 1  # workers per worker host, sharing its link
    calls_cpu_utilization: float | None = None  # the same over the timed calls alone (`timed_calls`)
    call_cpu_seconds: float | None = None  # CPU seconds of all the job's processes per timed call: the work itself
    mtu: int = ETHERNET_MTU  # every link's MTU

    @property
    def layout(self) -> str:
        """n, or 'n (hosts x per host)' where workers share hosts."""
        return (
            str(self.workers)
            if self.per_host == 1
            else f"{self.workers} ({self.workers // self.per_host}x{self.per_host})"
        )

    @property
    def ratio_to_bound(self) -> float:
        return self.seconds_median / self.bound_seconds


def _worker_argv(system: str, sizes: list[int], repeats: int, warmup: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gradwire.bench.workers",
        system,
        ",".join(map(str, sizes)),
        str(repeats),
        str(warmup),
    ]


def timed(job_start, timeout: float) -> tuple[list[dict], float]:
    """Run a job: rank 0's rows, and the CPU use of the job's processes over (its wall time x cores)."""
    rows, whole, _ = timed_calls(job_start, timeout)
    return rows, whole


def timed_calls(job_start, timeout: float) -> tuple[list[dict], float, dict[int, CallsCpu]]:
    """`timed`, and per size the CPU over the timed calls alone: the workers' own CPU in their timed calls (their
    CPU lines, bench/workers.py) and the job's other processes' (servers, scheduler; sampled from /proc) over the
    same span; empty where the workers print no CPU lines. The whole job's figure includes each process's start
    (imports, rendezvous) and warm-up; this one is the data path's."""
    before, t0 = os.times(), time.monotonic()
    job = job_start()
    sampler, stop = CpuSampler([p.pid for p in job.services]), threading.Event()
    thread = threading.Thread(target=_sample, args=(sampler, stop), name="cpu-sampler", daemon=True)
    thread.start()
    try:
        outputs = job.wait(timeout)
    finally:
        stop.set()
        thread.join()
    after, wall = os.times(), time.monotonic() - t0
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    rows = [json.loads(line) for line in outputs[0].splitlines() if line.startswith("{")]
    lines = [json.loads(line[4:]) for out in outputs for line in out.splitlines() if line.startswith("CPU ")]
    cores = os.cpu_count() or 1
    calls = {row["bytes"]: len(row["times"]) for row in rows if "bytes" in row and "times" in row}  # not training's
    return rows, cpu / (wall * cores), _calls_cpu(lines, calls, sampler, cores)


def _sample(sampler: CpuSampler, stop: threading.Event) -> None:
    while not stop.wait(0.05):
        sampler.sample()


@dataclass
class CallsCpu:
    """The CPU of a job's timed calls of one size: over (their span x cores), and in CPU seconds per call. A faster
    job spends the same work in less time, so its share of the cores rises; the seconds per call are the cost."""

    utilization: float
    seconds_per_call: float


def _calls_cpu(lines: list[dict], calls: dict[int, int], sampler: CpuSampler, cores: int) -> dict[int, CallsCpu]:
    shares = {}
    for size, count in calls.items():
        mine = [line for line in lines if line["bytes"] == size]
        if not mine or not count:
            continue
        start, end = min(line["start"] for line in mine), max(line["end"] for line in mine)
        spent = sum(line["cpu"] for line in mine) + sampler.between(start, end)
        if end > start:
            shares[size] = CallsCpu(spent / ((end - start) * cores), spent / count)
    return shares


def run_config(
    topo: Topology,
    sizes: list[int],
    repeats: int,
    warmup: int,
    env: dict[str, str],
    timeout: float = 1800,
    links_dir: str | None = None,
) -> list[Record]:
    """Both systems, all sizes, in one emulated cluster built for `topo`. With `links_dir`, every link's use over
    time is sampled during each job and written there (JSON and PNG per system), and summarised in the records."""
    records = []
    with EmulatedCluster(topo) as cluster:
        for system, start in (("gradwire", start_gradwire), ("gloo", start_gloo)):
            argv = _worker_argv(system, sizes, repeats, warmup)
            sampler = LinkSampler(cluster).start() if links_dir else None
            try:
                rows, cpu, calls_cpu = timed_calls(
                    lambda start=start, argv=argv: start(cluster, argv, os.environ | env), timeout
                )
            finally:
                if sampler is not None:
                    sampler.stop()
            busy = _links(sampler, topo, system, links_dir) if sampler is not None and links_dir else {}
            for row in rows:
                bound = topo.model_bound(row["bytes"]) if system == "gradwire" else topo.ring_bound(row["bytes"])
                records.append(
                    Record(
                        system,
                        topo.workers,
                        topo.servers if system == "gradwire" else 0,
                        parse_rate(topo.worker_rate),
                        parse_rate(topo.server_rate),
                        row["bytes"],
                        statistics.median(row["times"]),
                        bound,
                        row["times"],
                        cpu,
                        int(row.get("data_path", {}).get("window", 0)),
                        int(row.get("data_path", {}).get("partition_bytes", 0)),
                        topo.colocate and system == "gradwire",
                        env.get("GRADWIRE_PLACEMENT", "model") if system == "gradwire" else "",
                        busy,
                        topo.per_host,
                        *_cpu_fields(calls_cpu.get(row["bytes"])),
                        topo.mtu,
                    )
                )
    return records


def _cpu_fields(calls: CallsCpu | None) -> tuple[float | None, float | None]:
    return (None, None) if calls is None else (calls.utilization, calls.seconds_per_call)


def _links(sampler: LinkSampler, topo: Topology, system: str, links_dir: str) -> dict[str, float]:
    """Write one job's link samples and plot; return the mean use of each kind of link while data moved."""
    shared = f"x{topo.per_host}" if topo.per_host > 1 else ""
    colocated = "c" if topo.colocate else ""
    mtu = mtu_label(topo.mtu, "-mtu{}")
    name = f"{topo.workers}{shared}x{topo.servers}{colocated}-{topo.worker_rate}-{topo.server_rate}{mtu}-{system}"
    os.makedirs(links_dir, exist_ok=True)
    sampler.write(os.path.join(links_dir, name + ".json"))
    links.plot(sampler, os.path.join(links_dir, name + ".png"), f"{system}: {name}")
    kinds = {}
    for role, prefix in (("workers", "w"), ("servers", "s")):
        for direction in ("up", "down"):
            chosen = [k for k in sampler.rates if k.startswith(prefix) and k.endswith(" " + direction)]
            if chosen:
                use = sampler.busy(chosen)
                kinds[f"{role} {direction}"] = round(sum(use.values()) / len(use), 3)
    print(
        f"{system} {name}: links busy while data moved: " + ", ".join(f"{k} {v:.0%}" for k, v in kinds.items()),
        file=sys.stderr,
        flush=True,
    )
    return kinds


def to_json(record: Record) -> str:
    return json.dumps(asdict(record) | {"ratio_to_bound": record.ratio_to_bound})


def table(configs: list[list[Record]]) -> str:
    """Markdown: per configuration and size, both systems' time, bound and ratio, and gloo's time over ours."""
    lines = [
        "| n | k | worker / server rate | partition, window | size | gradwire s | x its bound | gloo s | x its bound "
        "| gloo / gradwire | CPU use (gradwire, gloo): whole job; timed calls | CPU s a call: gradwire / gloo |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for records in configs:
        gloo = {r.bytes: r for r in records if r.system == "gloo"}
        for r in (r for r in records if r.system == "gradwire"):
            g = gloo[r.bytes]
            servers = f"{r.servers} + {r.workers // r.per_host} colocated" if r.colocated else str(r.servers)
            if r.placement and r.placement != "model":
                servers += f" ({r.placement})"
            lines.append(
                f"| {r.layout} | {servers} | {r.worker_rate_bps / 1e6:g} / {r.server_rate_bps / 1e6:g} Mbit/s"
                f"{mtu_label(r.mtu)} "
                f"| {r.partition_bytes // 1024} KiB, {r.window} | {r.bytes / MiB:g} MiB "
                f"| {r.seconds_median:.2f} | {r.ratio_to_bound:.2f} "
                f"| {g.seconds_median:.2f} | {g.ratio_to_bound:.2f} | {g.seconds_median / r.seconds_median:.2f}x "
                f"| {r.cpu_utilization:.0%}, {g.cpu_utilization:.0%}; {_pct(r.calls_cpu_utilization)}, "
                f"{_pct(g.calls_cpu_utilization)} | {_per_call(r.call_cpu_seconds, g.call_cpu_seconds)} |"
            )
    mtus = sorted({r.mtu for records in configs for r in records if r.system == "gradwire"})
    lines += [
        f"\nAt MTU {mtu} TCP's headers alone put every job at {framing(mtu):.3f}x its bound or more (tc counts them)."
        for mtu in mtus
    ]
    return "\n".join(lines)


def mtu_label(mtu: int, form: str = ", MTU {}") -> str:
    """How a table or a file name says a run's MTU: nothing at Ethernet's 1500, else `form` with it."""
    return "" if mtu == ETHERNET_MTU else form.format(mtu)


def _per_call(ours: float | None, peer: float | None) -> str:
    if ours is None or peer is None or peer <= 0:
        return "?"
    return f"{ours:.2f} / {peer:.2f} = {ours / peer:.2f}x"


def _pct(share: float | None) -> str:
    return "?" if share is None else f"{share:.0%}"


def plot(records: list[Record], path: str) -> None:
    """Time in units of S/B against n, for both systems and both bounds (k = n, equal rates), per size.

    In units of S/B (S the bytes per worker, B the worker's link rate) configurations at different rates compare:
    the service's bound is 1 and the ring's 2(n-1)/n.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r.bytes for r in records})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        equal = [r for r in records if r.bytes == size and r.worker_rate_bps == r.server_rate_bps]
        ours = sorted(
            (r.workers, r) for r in equal if r.system == "gradwire" and r.servers == r.workers and not r.colocated
        )
        ns = [n for n, _ in ours]
        gloo = [
            next(g for g in equal if g.system == "gloo" and g.workers == n and g.worker_rate_bps == r.worker_rate_bps)
            for n, r in ours
        ]
        unit = [size * 8 / r.worker_rate_bps for _, r in ours]  # S/B in seconds
        ax.plot(ns, [r.seconds_median / u for (_, r), u in zip(ours, unit, strict=True)], "o-", label="gradwire")
        ax.plot(ns, [g.seconds_median / u for g, u in zip(gloo, unit, strict=True)], "s-", label="gloo ring")
        ax.plot(ns, [1.0] * len(ns), "o--", alpha=0.5, label="service bound S/B")
        ax.plot(ns, [2 * (n - 1) / n for n in ns], "s--", alpha=0.5, label="ring bound 2(n-1)/n S/B")
        for n, (_, r) in zip(ns, ours, strict=True):
            ax.annotate(
                f"{r.worker_rate_bps / 1e6:g} Mbit/s",
                (n, r.seconds_median / (size * 8 / r.worker_rate_bps)),
                textcoords="offset points",
                xytext=(4, -12),
                fontsize=7,
            )
        ax.set_title(f"{size / MiB:g} MiB per worker, k = n servers")
        ax.set_xlabel("workers n")
        ax.set_ylabel("time / (S/B)")
        ax.set_xticks(ns)
        ax.set_ylim(0, 2.2)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
