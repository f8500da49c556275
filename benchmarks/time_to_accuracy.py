"""`python -m benchmarks --netem --accuracy`: time to accuracy on the emulated network (docs/compression.md).

The README demo's CNN on scikit-learn's digits (benchmarks/ps_worker.py `digits --curve`), trained the same epochs six
ways in one emulated cluster (default: 4 workers and 4 servers, each on its own host, 100 Mbit/s links): DDP over
gloo, plain and with torch's PowerSGD hook (rank 2), and gradwire's DistributedOptimizer uncompressed, with onebit and
top-k 1% (error feedback) and with PowerSGD rank 2. Rank 0 evaluates after every epoch (not counted in the time), so
each run gives a curve of test accuracy against training seconds; per way the bench prints the time to each target
accuracy (median over the seeds that reach it), the final accuracy and the time per epoch, beside DDP's and
DDP + PowerSGD's. Seeds alternate the ways, so the machine's drift falls on every way alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from gradwire.netem import EmulatedCluster, Topology
from gradwire.netem.jobs import start_gloo, start_gradwire

# (name, the digits worker's --mode, its --compression)
WAYS = (
    ("DDP", "ddp", "none"),
    ("DDP + PowerSGD r2", "ddp", "powersgd"),
    ("gradwire", "local", "none"),
    ("gradwire onebit", "local", "onebit"),
    ("gradwire top-k 1%", "local", "topk"),
    ("gradwire PowerSGD r2", "local", "powersgd"),
)
TARGETS = (0.95, 0.97)


def curve(output: str) -> list[dict]:
    """Rank 0's EPOCH lines: [{epoch, seconds, test_accuracy}] in epoch order."""
    return [json.loads(line[6:]) for line in output.splitlines() if line.startswith("EPOCH ")]


def time_to(points: list[dict], target: float) -> float | None:
    """The training seconds when the test accuracy first reached `target` (None: never)."""
    return next((p["seconds"] for p in points if p["test_accuracy"] >= target), None)


def run_time_to_accuracy(args: argparse.Namespace, env: dict[str, str]) -> int:
    from gradwire.bench.netem_cli import parse_configs

    topo = parse_configs(args.configs)[0] if args.configs else Topology(4, 4, "100mbit", "100mbit")
    runs, epochs = args.accuracy_runs, args.epochs
    print(
        f"digits CNN, SGD momentum 0.9, {epochs} epochs, {topo.workers} workers, {topo.servers} servers, "
        f"{topo.worker_rate} links (emulated); {runs} seeds per way, alternating"
    )
    curves: dict[str, list[list[dict]]] = {name: [] for name, _, _ in WAYS}
    with EmulatedCluster(topo) as cluster:
        for seed in range(runs):
            for name, mode, compression in WAYS:
                argv = [sys.executable, "-m", "benchmarks.ps_worker", "digits", "--mode", mode, "--curve"]
                argv += ["--compression", compression, "--epochs", str(epochs), "--seed", str(seed)]
                if mode == "ddp":
                    job = start_gloo(cluster, argv, os.environ | env)
                else:
                    job = start_gradwire(cluster, argv, os.environ | env | {"GLOO_SOCKET_IFNAME": "eth0"})
                with job:
                    outputs = job.wait(900)
                curves[name].append(curve(outputs[0]))
                print(f"  seed {seed} {name}: " + _summary(curves[name][-1]), flush=True)
    print()
    print(table(curves))
    return 0


def _summary(points: list[dict]) -> str:
    last = points[-1]
    return f"{last['test_accuracy']:.4f} after {last['seconds']:.1f} s"


def table(curves: dict[str, list[list[dict]]]) -> str:
    """Per way: time to each target (median over the seeds that reached it, and how many did), the final accuracy
    (mean), seconds per epoch, and the time to the last target against DDP's and DDP + PowerSGD's."""
    heads = " | ".join(f"to {t:.0%}" for t in TARGETS)
    lines = [f"| way | {heads} | final accuracy | s per epoch | x DDP | x DDP + PowerSGD |", "|---|" + "---:|" * 6]
    reference = {name: _median_time(curves[name], TARGETS[-1]) for name in ("DDP", "DDP + PowerSGD r2")}
    for name, runs in curves.items():
        cells = []
        for target in TARGETS:
            reached = _reached(runs, target)
            median = f"{statistics.median(reached):.1f} s" if reached else "not reached"
            cells.append(f"{median} ({len(reached)}/{len(runs)})")
        final = statistics.mean(points[-1]["test_accuracy"] for points in runs)
        per_epoch = statistics.median(points[-1]["seconds"] / points[-1]["epoch"] for points in runs)
        mine = _median_time(runs, TARGETS[-1])
        ratios = [f"{ref / mine:.2f}x" if ref and mine else "-" for ref in reference.values()]
        lines.append(f"| {name} | {' | '.join(cells)} | {final:.4f} | {per_epoch:.2f} | {' | '.join(ratios)} |")
    lines.append("")
    lines.append(f"x DDP: DDP's time to {TARGETS[-1]:.0%} over this way's (above 1: this way gets there sooner).")
    return "\n".join(lines)


def _reached(runs: list[list[dict]], target: float) -> list[float]:
    """The times to `target` of the runs that reached it."""
    return [t for t in (time_to(points, target) for points in runs) if t is not None]


def _median_time(runs: list[list[dict]], target: float) -> float | None:
    reached = _reached(runs, target)
    return statistics.median(reached) if reached else None
