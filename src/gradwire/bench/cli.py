"""`gradwire bench`: gradwire push_pull against torch.distributed gloo all_reduce, same sizes, same run.

Jobs alternate (gradwire, gloo, gradwire over TCP only, and again) so that the machine's drift hits both alike; the
median over every timed call of every round is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from gradwire.bench.runner import MiB, Timing, run_gloo, run_gradwire


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _job_arguments(parser)
    _netem_arguments(parser)
    _training_arguments(parser)


def _job_arguments(parser: argparse.ArgumentParser) -> None:
    """The job every mode runs (workers, servers, sizes, repeats), the data-path settings it imposes, what is timed."""
    parser.add_argument("-n", "--num-workers", type=int, default=4)
    parser.add_argument("-s", "--num-servers", type=int, default=4)
    parser.add_argument("--sizes", default="4,16,64", help="MiB per tensor, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per size and round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of gradwire and gloo jobs")
    parser.add_argument("--partition-bytes", type=int, default=None)
    parser.add_argument("--window", type=int, default=None, help="GRADWIRE_WINDOW for the gradwire jobs")
    parser.add_argument(
        "--placement", choices=("model", "auto", "equal"), default=None, help="GRADWIRE_PLACEMENT for the gradwire jobs"
    )
    parser.add_argument("--pacing", type=int, default=None, help="GRADWIRE_PACING for the gradwire jobs (0: off)")
    parser.add_argument("--json", action="store_true", help="one JSON object per measurement")
    parser.add_argument(
        "--collective",
        default="allreduce",
        choices=[
            "allreduce",
            "allgather",
            "broadcast",
            "reducescatter",
            *(f"allreduce-{m}" for m in ("onebit", "topk", "randomk", "dithering")),
        ],
        help="what to time, against gloo's same collective (each rank ends with SIZE bytes; see bench/workers.py)",
    )


def _netem_arguments(parser: argparse.ArgumentParser) -> None:
    """Across an emulated network: the configurations, what to record of them."""
    parser.add_argument(
        "--netem",
        action="store_true",
        help="across an emulated network (root): the issue-4 matrix, gloo in the same cluster",
    )
    parser.add_argument(
        "--configs", default=None, help="with --netem: n:k:worker_rate:server_rate,... (default: the full matrix)"
    )
    parser.add_argument(
        "--links", default=None, metavar="DIR", help="with --netem: sample every link's use over time into DIR"
    )
    parser.add_argument("--plot", default=None, help="with --netem: write a PNG of time against n")
    parser.add_argument(
        "--hand-tuned",
        action="store_true",
        help="with --netem: impose the partition/window settings hand-tuning found (Topology.tuning()) instead of "
        "gradwire's own choice from the measured links",
    )
    parser.add_argument("--write-docs", default=None, help="with --netem: replace the netem section of this file")
    parser.add_argument(
        "--section", default="netem", help="with --write-docs: the marked section to replace (netem, placement)"
    )


def _training_arguments(parser: argparse.ArgumentParser) -> None:
    """Training on the emulated network: end to end, scaling with replayed compute, compression, Keras, drift."""
    parser.add_argument(
        "--train",
        action="store_true",
        help="with --netem: end-to-end training (a 3.8M-parameter CNN+MLP) with DistributedOptimizer and the DDP "
        "hook, against DDP over gloo",
    )
    parser.add_argument("--steps", type=int, default=8, help="with --train: timed steps per way")
    parser.add_argument(
        "--train-model",
        choices=["bench", "mixed"],
        default="bench",
        help="with --train: the 3.8M-parameter CNN+MLP, or `mixed` (two conv layers and Linear layers of 1024x2048, "
        "2048x1024 and 1024x10: most bytes in two matrices beside small tensors; batch 16)",
    )
    parser.add_argument(
        "--ways",
        default=None,
        help="with --train: only these of its ways, comma-separated (their peer included); `crossbarrier` (named "
        "only): DistributedOptimizer under the cross barrier, the next forward overlapping this step's sums",
    )
    parser.add_argument(
        "--compression",
        action="store_true",
        help="with --train: DistributedOptimizer with onebit, top-k 1%% (error feedback) and PowerSGD rank 2 beside "
        "uncompressed, against DDP over gloo plain and with torch's PowerSGD hook (rank 2)",
    )
    parser.add_argument(
        "--keras",
        action="store_true",
        help="with --train: Keras 3 on TensorFlow, gradwire.keras's DistributedOptimizer against TensorFlow's "
        "MultiWorkerMirroredStrategy over its ring (bench/train_keras.py)",
    )
    parser.add_argument(
        "--drift",
        default=None,
        metavar="FROM:TO",
        help="with --train: every link starts at rate FROM (tc's spelling) and changes to TO after the warmup steps; "
        "gradwire following the links (the default) against GRADWIRE_ADAPT=0 and DDP over gloo",
    )
    parser.add_argument(
        "--settle", type=int, default=12, help="with --drift: steps after the change that are not timed (every way)"
    )


def run(args: argparse.Namespace) -> int:
    sizes = [int(float(s) * MiB) for s in args.sizes.split(",")]
    os.environ["GRADWIRE_BENCH_COLLECTIVE"] = args.collective  # read by the benchmark's worker processes
    env = job_env(args)
    code = _run_mode(args, sizes, env)
    return _compare(args, sizes, env) if code is None else code


def job_env(args: argparse.Namespace) -> dict[str, str]:
    """The GRADWIRE_* settings the options impose on the gradwire jobs (none: the defaults)."""
    env = {"GRADWIRE_PARTITION_BYTES": str(args.partition_bytes)} if args.partition_bytes else {}
    if args.window:
        env["GRADWIRE_WINDOW"] = str(args.window)
    if args.placement:
        env["GRADWIRE_PLACEMENT"] = args.placement
    if args.pacing is not None:
        env["GRADWIRE_PACING"] = str(args.pacing)
    return env


def _run_mode(args: argparse.Namespace, sizes: list[int], env: dict[str, str]) -> int | None:
    """The benchmark a mode option names, run (its exit code); None: no mode, the plain comparison."""
    if args.netem:
        from gradwire.bench.netem_cli import run_netem

        return run_netem(args, sizes, env)
    return None


def _compare(args: argparse.Namespace, sizes: list[int], env: dict[str, str]) -> int:
    """gradwire (its own transport choice, then TCP only) against gloo's ring, alternating, per size."""
    n, k = args.num_workers, args.num_servers
    results: dict[tuple[str, int], list[Timing]] = {}
    for _ in range(args.rounds):
        timings = run_gradwire(n, k, sizes, args.repeats, args.warmup, env)
        timings += run_gloo(n, sizes, args.repeats, args.warmup)
        for t in run_gradwire(n, k, sizes, args.repeats, args.warmup, env | {"GRADWIRE_TRANSPORT": "tcp"}):
            t.system = "gradwire-tcp"  # the same job over TCP loopback only, as across machines
            timings.append(t)
        for timing in timings:
            results.setdefault((timing.system, timing.bytes), []).append(timing)
    merged = {key: _merge(ts) for key, ts in results.items()}
    if args.json:
        for t in merged.values():
            print(json.dumps(_record(t)))
    else:
        print(table(merged, sizes, n, k, args.collective))
    return 0


def _merge(timings: list[Timing]) -> Timing:
    first = timings[0]
    times = [x for t in timings for x in t.times]
    peak = max(t.server_peak_rss for t in timings)
    worker_cpu, server_cpu = sum(t.worker_cpu for t in timings), sum(t.server_cpu for t in timings)
    return Timing(first.system, first.workers, first.servers, first.bytes, times, peak, worker_cpu, server_cpu)


def _record(t: Timing) -> dict:
    return {
        "system": t.system,
        "workers": t.workers,
        "servers": t.servers,
        "bytes": t.bytes,
        "seconds_median": t.median,
        "seconds_stdev": statistics.pstdev(t.times),
        "samples": len(t.times),
        "throughput_bytes_per_s": t.bytes / t.median,
        "server_peak_rss_bytes": t.server_peak_rss or None,
        "cpu_seconds_per_gb": t.cpu_per_gb(),
        "worker_cpu_seconds_per_gb": t.cpu_per_gb("workers"),
        "server_cpu_seconds_per_gb": t.cpu_per_gb("servers") if t.servers else None,
    }


def table(
    merged: dict[tuple[str, int], Timing], sizes: list[int], n: int, k: int, collective: str = "allreduce"
) -> str:
    """A markdown table: per size, both systems' median time, per-worker throughput, and the ratio."""
    lines = [
        f"{collective}: n={n} workers, k={k} servers, loopback",
        "",
        "| size | gradwire s | gradwire-tcp s | gloo s | gradwire MB/s per worker | gloo MB/s per worker "
        "| gradwire/gloo throughput | gradwire-tcp/gloo |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in sizes:
        gw, tcp, gl = merged[("gradwire", size)], merged[("gradwire-tcp", size)], merged[("gloo", size)]
        lines.append(
            f"| {size / MiB:g} MiB | {gw.median:.4f} | {tcp.median:.4f} | {gl.median:.4f} | "
            f"{size / gw.median / 1e6:.0f} | {size / gl.median / 1e6:.0f} | {gl.median / gw.median:.2f}x "
            f"| {gl.median / tcp.median:.2f}x |"
        )
    lines += [
        "",
        "CPU seconds per GB reduced (all processes' CPU in the timed calls, over n x SIZE x calls; gradwire: workers + "
        "servers):",
        "",
        "| size | gradwire | gradwire-tcp | gloo | gradwire/gloo | gradwire-tcp/gloo |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for size in sizes:
        gw, tcp, gl = merged[("gradwire", size)], merged[("gradwire-tcp", size)], merged[("gloo", size)]
        parts = [
            f"{t.cpu_per_gb():.2f} ({t.cpu_per_gb('workers'):.2f} + {t.cpu_per_gb('servers'):.2f})" for t in (gw, tcp)
        ]
        base = gl.cpu_per_gb() or float("nan")
        lines.append(
            f"| {size / MiB:g} MiB | {parts[0]} | {parts[1]} | {gl.cpu_per_gb():.2f} | "
            f"{gw.cpu_per_gb() / base:.2f}x | {tcp.cpu_per_gb() / base:.2f}x |"
        )
    peak = max(merged[("gradwire", s)].server_peak_rss for s in sizes)
    lines.append("")
    lines.append(f"largest server peak RSS: {peak / MiB:.0f} MiB")
    return "\n".join(lines)
