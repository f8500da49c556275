"""`python -m benchmarks --partitions 16,32,...,4096`: what a partition costs, as CPU seconds per GB by partition size.

Slow links need small partitions (16-32 KiB are derived at 20-100 Mbit/s), and every partition costs work that does
not depend on its bytes: frames to build and read, acknowledgements, wake-ups, system calls. This benchmark runs the
same push_pull job (n workers, k servers, one tensor of SIZE bytes, TCP only, as across machines) once per partition
size (GRADWIRE_PARTITION_BYTES) and reports the CPU seconds the workers and the servers spent per GB reduced, and each
figure over the largest partition size's: the per-partition overhead, apart for both roles. gloo's ring on the same
tensor in the same run gives the yardstick. Rounds alternate the sizes so that the machine's drift hits them alike.

Both ways run with the defaults (server failover on: each sum kept as its key's seed): the Python data path
(GRADWIRE_DATAPATH=python: workers and servers) and, where gradwire-native is installed, the native one (every
worker's and every server's own data path by default: worker/native_path.py, server/native_path.py). What the rule
costs natively, beside the floor.

Beside it, the floor (benchmarks/floor.py): the same partition sizes through a Python data path with nothing else in it,
one worker and one server, the worker with one thread and with two (a sender woken by its receiver, as gradwire's
links are built), in the same rounds: what Python itself sets, and what the data path's shape adds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from benchmarks.floor import available_modes
from gradwire import native
from gradwire.bench.runner import MiB, Timing, run_gloo, run_gradwire

KiB = 1 << 10


def run_partitions(args: argparse.Namespace, env: dict[str, str]) -> int:
    parts = [int(float(p) * KiB) for p in args.partitions.split(",")]
    size = int(float(args.sizes.split(",")[0]) * MiB)
    n, k = args.num_workers, args.num_servers
    workers = ["python", "native"] if native.load().module is not None else ["python"]
    runs: dict[tuple[str, int], list[Timing]] = {(w, p): [] for w in workers for p in parts}
    gloo: list[Timing] = []
    modes = available_modes()  # the native shapes too, where gradwire-native is installed
    floors: dict[tuple[str, int], list[dict]] = {(mode, p): [] for mode in modes for p in parts}
    for _ in range(args.rounds):
        for p in parts:
            job = env | {
                "GRADWIRE_PARTITION_BYTES": str(p),
                "GRADWIRE_TRANSPORT": "tcp",
            }
            for w in workers:
                way = job | {"GRADWIRE_DATAPATH": "python"} if w == "python" else job
                runs[w, p] += run_gradwire(n, k, [size], args.repeats, args.warmup, way)
            for mode in modes:
                floors[mode, p].append(run_floor(p, size, FLOOR_REPEATS, mode))
        gloo += run_gloo(n, [size], args.repeats, args.warmup)
    rows = [_row(w, p, runs[w, p]) for w in workers for p in parts]
    base = rows[len(parts) - 1] if rows else None  # the Python data path's largest partitions
    gloo_cpu = statistics.median(t.cpu_per_gb() for t in gloo)
    floor_rows = [_floor_row(mode, p, floors[mode, p]) for mode in modes for p in parts]
    if args.json:
        for row in rows + floor_rows:
            print(json.dumps(row | {"gloo_cpu_seconds_per_gb": gloo_cpu}))
        return 0
    print(table(rows, base, gloo_cpu, n, k, size))
    print()
    print(floor_table(floor_rows, size))
    return 0


FLOOR_REPEATS = 40  # calls per floor measurement (each a few tens of milliseconds)


def run_floor(partition: int, size: int, repeats: int, mode: str) -> dict:
    """One floor measurement (benchmarks/floor.py) in a process of its own."""
    argv = [sys.executable, "-m", "benchmarks.floor", str(partition), str(size), str(repeats), mode]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _floor_row(mode: str, partition: int, runs: list[dict]) -> dict:
    """The medians of a floor shape's runs at one partition size."""
    row = {"floor": mode, "partition_bytes": partition, "runs": len(runs)}
    for field in ("seconds_per_call", "worker_cpu_seconds_per_gb", "server_cpu_seconds_per_gb"):
        row[field] = statistics.median(r[field] for r in runs)
    return row


def floor_table(rows: list[dict], size: int) -> str:
    """The floor's markdown table: per shape and partition size, CPU per GB and each over the largest size's."""
    lines = [
        f"the floor (benchmarks/floor.py): push_pull of {size / MiB:g} MiB, one worker, one server, TCP loopback",
        "",
        "| worker | partition | workers' CPU s/GB | x largest | servers' CPU s/GB | x largest |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode in dict.fromkeys(r["floor"] for r in rows):
        mine = [r for r in rows if r["floor"] == mode]
        for row in mine:
            lines.append(f"| {mode} | {row['partition_bytes'] / KiB:g} KiB | {_cpu_cells(row, mine[-1])} |")
    return "\n".join(lines)


def _row(worker: str, partition: int, timings: list[Timing]) -> dict:
    """The medians over a partition size's runs (each run: its timed calls' CPU over their bytes)."""
    return {
        "worker": worker,
        "partition_bytes": partition,
        "seconds_median": statistics.median(x for t in timings for x in t.times),
        "worker_cpu_seconds_per_gb": statistics.median(t.cpu_per_gb("workers") for t in timings),
        "server_cpu_seconds_per_gb": statistics.median(t.cpu_per_gb("servers") for t in timings),
        "runs": len(timings),
    }


def table(rows: list[dict], base: dict | None, gloo_cpu: float, n: int, k: int, size: int) -> str:
    """A markdown table: per worker (Python, native) and partition size, the time of a call, workers' and servers' CPU
    per GB and each over the Python data path's at the largest size."""
    lines = [
        f"push_pull of {size / MiB:g} MiB, n={n} workers, k={k} servers, TCP loopback; gloo's ring: "
        f"{gloo_cpu:.2f} CPU s per GB",
        "",
        "| worker | partition | call s | workers' CPU s/GB | x Python largest | servers' CPU s/GB | x Python largest |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['worker']} | {row['partition_bytes'] / KiB:g} KiB | {row['seconds_median']:.4f} | "
            f"{_cpu_cells(row, base)} |"
        )
    return "\n".join(lines)


def _cpu_cells(row: dict, base: dict | None) -> str:
    """A row's workers' and servers' CPU per GB, each also over `base`'s (the largest partition size's)."""
    w, s = row["worker_cpu_seconds_per_gb"], row["server_cpu_seconds_per_gb"]
    w0 = base["worker_cpu_seconds_per_gb"] if base else float("nan")
    s0 = base["server_cpu_seconds_per_gb"] if base else float("nan")
    return f"{w:.2f} | {w / w0:.2f}x | {s:.2f} | {s / s0:.2f}x"
