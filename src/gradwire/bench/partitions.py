"""`gradwire bench --partitions 16,32,...,4096`: what a partition costs, as CPU seconds per GB by partition size.

Slow links need small partitions (16-32 KiB are derived at 20-100 Mbit/s), and every partition costs work that does
not depend on its bytes: frames to build and read, acknowledgements, wake-ups, system calls. This benchmark runs the
same push_pull job (n workers, k servers, one tensor of SIZE bytes, TCP only, as across machines) once per partition
size (GRADWIRE_PARTITION_BYTES) and reports the CPU seconds the workers and the servers spent per GB reduced, and each
figure over the largest partition size's: the per-partition overhead, apart for both roles. gloo's ring on the same
tensor in the same run gives the yardstick. Rounds alternate the sizes so that the machine's drift hits them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics

from gradwire.bench.runner import MiB, Timing, run_gloo, run_gradwire

KiB = 1 << 10


def run_partitions(args: argparse.Namespace, env: dict[str, str]) -> int:
    parts = [int(float(p) * KiB) for p in args.partitions.split(",")]
    size = int(float(args.sizes.split(",")[0]) * MiB)
    n, k = args.num_workers, args.num_servers
    runs: dict[int, list[Timing]] = {p: [] for p in parts}
    gloo: list[Timing] = []
    for _ in range(args.rounds):
        for p in parts:
            job = env | {"GRADWIRE_PARTITION_BYTES": str(p), "GRADWIRE_TRANSPORT": "tcp"}
            runs[p] += run_gradwire(n, k, [size], args.repeats, args.warmup, job)
        gloo += run_gloo(n, [size], args.repeats, args.warmup)
    rows = [_row(p, runs[p]) for p in parts]
    base = rows[-1] if rows else None
    gloo_cpu = statistics.median(t.cpu_per_gb() for t in gloo)
    if args.json:
        for row in rows:
            print(json.dumps(row | {"gloo_cpu_seconds_per_gb": gloo_cpu}))
        return 0
    print(table(rows, base, gloo_cpu, n, k, size))
    return 0


def _row(partition: int, timings: list[Timing]) -> dict:
    """The medians over a partition size's runs (each run: its timed calls' CPU over their bytes)."""
    return {
        "partition_bytes": partition,
        "seconds_median": statistics.median(x for t in timings for x in t.times),
        "worker_cpu_seconds_per_gb": statistics.median(t.cpu_per_gb("workers") for t in timings),
        "server_cpu_seconds_per_gb": statistics.median(t.cpu_per_gb("servers") for t in timings),
        "runs": len(timings),
    }


def table(rows: list[dict], base: dict | None, gloo_cpu: float, n: int, k: int, size: int) -> str:
    """A markdown table: per partition size, the time of a call, workers' and servers' CPU per GB and each over the
    largest size's."""
    lines = [
        f"push_pull of {size / MiB:g} MiB, n={n} workers, k={k} servers, TCP loopback; gloo's ring: "
        f"{gloo_cpu:.2f} CPU s per GB",
        "",
        "| partition | call s | workers' CPU s/GB | x largest | servers' CPU s/GB | x largest |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        w, s = row["worker_cpu_seconds_per_gb"], row["server_cpu_seconds_per_gb"]
        w0 = base["worker_cpu_seconds_per_gb"] if base else float("nan")
        s0 = base["server_cpu_seconds_per_gb"] if base else float("nan")
        lines.append(
            f"| {row['partition_bytes'] / KiB:g} KiB | {row['seconds_median']:.4f} | {w:.2f} | {w / w0:.2f}x | "
            f"{s:.2f} | {s / s0:.2f}x |"
        )
    return "\n".join(lines)
