"""`python -m benchmarks --ps`: parameter-server mode (docs/ps-mode.md) against the local optimizer, side by side.

Two measurements, each way run one after the other on this machine with `gradwire launch` (n workers, k servers):
- worker memory: peak RSS of each worker training a 25M-parameter MLP with Adam, DistributedOptimizer (the Adam
  state on every worker) against ServerOptimizer (the state on the servers);
- training: the README demo's CNN on digits, SGD with momentum, DistributedOptimizer against ServerOptimizer
  synchronous and asynchronous (staleness 2), without and with a slow worker: test accuracy and time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MiB = 1 << 20


def launch_task(n: int, k: int, task: list[str], env: dict[str, str] | None = None) -> tuple[dict, list[dict]]:
    cmd = [sys.executable, "-m", "gradwire", "launch", "-n", str(n), "-s", str(k), "--"]
    cmd += [sys.executable, "-m", "benchmarks.ps_worker", *task]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ | (env or {}))
    lines = [line.split("] ", 1)[-1] for line in proc.stdout.splitlines()]  # the launcher prefixes "[worker r] "
    summary = [json.loads(line[3:]) for line in lines if line.startswith("PS ")]
    rss = [json.loads(line[4:]) for line in lines if line.startswith("RSS ")]
    if proc.returncode != 0 or not summary:
        raise SystemExit(f"{' '.join(task)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return summary[0], rss


def run_delay_compensation(args: argparse.Namespace) -> int:
    """The digits CNN with the last worker slowed: synchronous, asynchronous (staleness 2) and asynchronous with delay
    compensation, each with the same seeds (a seed: the model's initialisation and the data's order), rounds
    alternating the three ways: test accuracy (mean, spread) and time."""
    n, k, lam = args.num_workers, args.num_servers, args.dc
    ways = [("synchronous", 0, 0.0), ("async staleness 2", 2, 0.0), (f"async staleness 2 + DC {lam:g}", 2, lam)]
    print(f"digits CNN, SGD momentum 0.9, {args.epochs} epochs, {n} workers, {k} servers, worker {n - 1} sleeping "
          f"{args.slow_ms:g} ms a step; {args.async_runs} seeds, each way on each seed")  # fmt: skip
    found: dict[str, list[dict]] = {name: [] for name, _, _ in ways}
    for seed in range(args.async_runs):
        for name, staleness, dc in ways:
            task = ["digits", "--mode", "server", "--staleness", str(staleness), "--dc", str(dc)]
            task += ["--slow-ms", str(args.slow_ms), "--epochs", str(args.epochs), "--seed", str(seed)]
            found[name].append(launch_task(n, k, task)[0])
    for name, runs in found.items():
        accuracy = [r["test_accuracy"] for r in runs]
        spread = statistics.pstdev(accuracy)
        print(
            f"  {name:28s} test acc mean {statistics.mean(accuracy):.4f} (sd {spread:.4f}, {min(accuracy):.3f}-"
            f"{max(accuracy):.3f})   {statistics.median(r['seconds'] for r in runs):6.2f} s   runs: "
            + ", ".join(f"{a:.3f}" for a in accuracy)
        )
    return 0


def run_compressed(args: argparse.Namespace) -> int:
    """The digits CNN with ServerOptimizer (synchronous), its gradients pushed as they are, as signs (onebit) and as
    the top 1% (top-k), each with the workers' error feedback: test accuracy (mean, spread over seeds), time, and the
    bytes a worker pushes per step."""
    n, k = args.num_workers, args.num_servers
    print(f"digits CNN, ServerOptimizer SGD momentum 0.9, {args.epochs} epochs, {n} workers, {k} servers; "
          f"{args.async_runs} seeds, each way on each seed")  # fmt: skip
    ways = ("none", "onebit", "topk")
    found: dict[str, list[dict]] = {way: [] for way in ways}
    for seed in range(args.async_runs):
        for way in ways:
            task = ["digits", "--mode", "server", "--compression", way, "--epochs", str(args.epochs)]
            found[way].append(launch_task(n, k, [*task, "--seed", str(seed)])[0])
    plain = statistics.median(r["bytes_pushed_per_step"] for r in found["none"])
    for way, runs in found.items():
        accuracy = [r["test_accuracy"] for r in runs]
        pushed = statistics.median(r["bytes_pushed_per_step"] for r in runs)
        print(
            f"  {way:7s} test acc mean {statistics.mean(accuracy):.4f} (sd {statistics.pstdev(accuracy):.4f})   "
            f"{statistics.median(r['seconds'] for r in runs):6.2f} s   pushed {pushed / 1024:8.1f} KiB/step "
            f"(1/{plain / pushed:.1f})   runs: " + ", ".join(f"{a:.3f}" for a in accuracy)
        )
    return 0


def run_ps(args: argparse.Namespace) -> int:
    if args.dc:
        return run_delay_compensation(args)
    if args.compression:
        return run_compressed(args)
    n, k = args.num_workers, args.num_servers
    print(f"parameter-server mode: {n} workers, {k} servers (gradwire launch), this machine\n")
    print("worker memory, a 25M-parameter MLP with Adam (peak RSS, the largest over the workers):")
    peaks = {}
    for mode in ("local", "server"):
        summary, rss = launch_task(n, k, ["memory", "--mode", mode])
        peaks[mode] = max(r["peak_rss"] for r in rss)
        print(
            f"  {mode:6s}  peak RSS {peaks[mode] / MiB:7.0f} MiB   optimizer state on the worker "
            f"{summary['optimizer_state_bytes_here'] / MiB:5.0f} MiB   {summary['step_s']:.2f} s/step "
            f"({summary['params'] / 1e6:.1f}M parameters)"
        )
    print(f"  ServerOptimizer / DistributedOptimizer peak RSS: {peaks['server'] / peaks['local']:.2f}x\n")
    print(f"digits CNN, SGD momentum 0.9, {args.epochs} epochs (test accuracy; time); asynchronous runs repeated:")
    no_failover = {"GRADWIRE_SERVER_FAILOVER": "0"}  # no replicas (and no failover: a dead server ends the job)
    ways = [
        ("DistributedOptimizer", "local", 0, 0.0, {}, 1),
        ("ServerOptimizer sync", "server", 0, 0.0, {}, 1),
        ("ServerOptimizer sync, no replicas", "server", 0, 0.0, no_failover, 1),
        ("ServerOptimizer async staleness 2", "server", 2, 0.0, {}, args.async_runs),
        ("DistributedOptimizer", "local", 0, args.slow_ms, {}, 1),
        ("ServerOptimizer sync", "server", 0, args.slow_ms, {}, 1),
        ("ServerOptimizer async staleness 2", "server", 2, args.slow_ms, {}, args.async_runs),
    ]
    for name, mode, staleness, slow, env, runs in ways:
        task = ["digits", "--mode", mode, "--staleness", str(staleness), "--slow-ms", str(slow)]
        found = [launch_task(n, k, [*task, "--epochs", str(args.epochs)], env)[0] for _ in range(runs)]
        accuracy = [r["test_accuracy"] for r in found]
        seconds = statistics.median(r["seconds"] for r in found)
        spread = f" (runs: {', '.join(f'{a:.3f}' for a in accuracy)})" if runs > 1 else ""
        print(
            f"  {name:34s} slow worker {slow:3.0f} ms/step   test acc {statistics.median(accuracy):.3f}   "
            f"{seconds:6.2f} s{spread}"
        )
    return 0
