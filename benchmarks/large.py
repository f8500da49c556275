"""`python -m benchmarks --large`: a large gradient and a 0.35B-parameter model, gradwire against gloo, side by side.

Each way runs as its own job on this machine, one after the other (2 workers; gradwire with 2 dedicated servers by
`gradwire launch`, gloo's ranks meeting through a file):
- a float32 tensor of `--large-elements` (300M: 1.2 GB) summed `--calls` times: push_pull_inplace, push_pull (out of
  place), and, for what a failover costs, push_pull_inplace with the sums kept by replica servers rather than held
  in the outputs (GRADWIRE_FAILOVER_HOLD=0), with the workers keeping every sum (a GRADWIRE_FAILOVER_COPY_BYTES past
  the tensor) and with failover off, against torch.distributed's all_reduce;
- a GPT-2-medium-sized transformer (benchmarks/large_worker.py) trained `--steps` steps with SGD: DistributedOptimizer
  against DDP over gloo.
Reported per way: the first and second call (or step), the steady one (the median from the third on: the second
was a first too while a key's two round buffers served alternate calls), the time to set up a model
(wrapping it, broadcasting rank 0's parameters), and the peak RSS per worker (the largest over the workers), each
beside gloo's; and the largest peak RSS of gradwire's servers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GB = 1e9


def _gradwire(n: int, k: int, task: list[str], env: dict[str, str]) -> list[dict]:
    """The workers' rows, each with the largest peak RSS of the job's servers (`servers_rss`)."""
    cmd = [sys.executable, "-m", "gradwire", "launch", "-n", str(n), "-s", str(k), "--"]
    cmd += [sys.executable, "-m", "benchmarks.large_worker", *task]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | env) as p:
        peaks: dict[int, int] = {}
        watch = threading.Thread(target=_watch_servers, args=(p, peaks), daemon=True)
        watch.start()
        out, err = p.communicate(timeout=1200)
        watch.join()
    rows = _rows(subprocess.CompletedProcess(cmd, p.returncode, out, err), task)
    return [row | {"servers_rss": max(peaks.values(), default=0)} for row in rows]


def _watch_servers(launch: subprocess.Popen, peaks: dict[int, int]) -> None:
    """Until the launcher exits: the peak RSS (VmHWM) of each `gradwire server` it started, read from /proc."""
    while launch.poll() is None:
        for pid in _children(launch.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"gradwire\0server" not in f.read():
                        continue
                with open(f"/proc/{pid}/status") as f:
                    hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
            except (OSError, StopIteration):
                continue
            peaks[pid] = max(peaks.get(pid, 0), hwm)
        time.sleep(0.2)


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return found


def _gloo(n: int, task: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{Path(tmp) / 'rendezvous'}"
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.large_worker", *task],
                env=os.environ | {"RANK": str(r), "WORLD_SIZE": str(n), "GRADWIRE_BENCH_INIT": init},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(n)
        ]
        rows = []
        for proc in procs:
            out, err = proc.communicate(timeout=1200)
            rows += _rows(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), task)
        return rows


def _rows(proc: subprocess.CompletedProcess, task: list[str]) -> list[dict]:
    lines = [line.split("] ", 1)[-1] for line in proc.stdout.splitlines()]  # the launcher prefixes "[worker r] "
    rows = [json.loads(line[6:]) for line in lines if line.startswith("LARGE ")]
    if proc.returncode != 0 or not rows:
        raise SystemExit(f"{' '.join(task)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return rows


def _summary(rows: list[dict]) -> dict:
    """The first, second and steady time (the median from the third on: the second call was a first too while a key's
    two round buffers served alternate calls), the slowest rank's; the largest peak RSS; setup."""
    times = [max(r["times"][i] for r in rows) for i in range(len(rows[0]["times"]))]
    return {
        "first": times[0],
        "second": times[min(1, len(times) - 1)],
        "steady": statistics.median(times[2:]) if len(times) > 2 else times[-1],
        "rss": max(r["peak_rss"] for r in rows),
        "servers_rss": max(r.get("servers_rss", 0) for r in rows),
        "setup": max(r.get("setup", 0.0) for r in rows),
        "parameters": rows[0].get("parameters"),
    }


def _print(name: str, s: dict, peer: dict) -> None:
    print(
        f"| {name} | {s['first']:.2f} | {s['second']:.2f} | {s['steady']:.2f} | {s['first'] / s['steady']:.2f}x | "
        f"{peer['steady'] / s['steady']:.2f}x | {s['rss'] / GB:.2f} | {s['rss'] / peer['rss']:.2f}x |"
        + (f" {s['servers_rss'] / GB:.2f} |" if s["servers_rss"] else " - |")
        + (f" {s['setup']:.1f} |" if s["setup"] else "")
    )


def run_large(args: argparse.Namespace) -> int:
    n, k = 2, 2
    elements = args.large_elements
    task = ["tensor", "--elements", str(elements), "--calls", str(args.calls)]
    print(f"one float32 tensor of {elements / 1e6:.0f}M elements ({elements * 4 / GB:.2f} GB), {args.calls} calls, ")
    print(f"{n} workers (gradwire: {k} servers), this machine; slowest rank's times, largest peak RSS per worker\n")
    print(
        "| way | 1st call s | 2nd call s | steady s | 1st / steady | speed x gloo | peak RSS GB | RSS x gloo "
        "| a server's peak RSS GB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    gloo = _summary(_gloo(n, [*task, "--way", "gloo"]))
    _print("gloo all_reduce", gloo, gloo)
    ways = [
        ("push_pull_inplace", "inplace", {}),
        ("push_pull (out of place)", "outofplace", {}),
        ("push_pull_inplace, replicas keep the sums", "inplace", {"GRADWIRE_FAILOVER_HOLD": "0"}),
        ("push_pull_inplace, workers keep the copies", "inplace", {"GRADWIRE_FAILOVER_COPY_BYTES": str(1 << 40)}),
        ("push_pull_inplace, failover off", "inplace", {"GRADWIRE_SERVER_FAILOVER": "0"}),
    ]
    for name, way, env in ways:
        _print(name, _summary(_gradwire(n, k, [*task, "--way", way], env)), gloo)
    task = ["model", "--steps", str(args.steps)]
    print(f"\nGPT-2-medium-sized transformer, SGD, {args.steps} steps of one 64-token sequence per worker\n")
    print(
        "| way | 1st step s | 2nd step s | steady s | 1st / steady | speed x DDP | peak RSS GB | RSS x DDP "
        "| a server's peak RSS GB | setup s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ddp = _summary(_gloo(n, [*task, "--way", "ddp"]))
    _print(f"DDP over gloo ({ddp['parameters'] / 1e6:.0f}M parameters)", ddp, ddp)
    mine = _summary(_gradwire(n, k, [*task, "--way", "optimizer"], {}))
    _print("DistributedOptimizer", mine, ddp)
    for name, env in (
        ("DistributedOptimizer, replicas keep the sums", {"GRADWIRE_FAILOVER_HOLD": "0"}),
        ("DistributedOptimizer, workers keep the copies", {"GRADWIRE_FAILOVER_COPY_BYTES": str(1 << 40)}),
        ("DistributedOptimizer, failover off", {"GRADWIRE_SERVER_FAILOVER": "0"}),
    ):
        _print(name, _summary(_gradwire(n, k, [*task, "--way", "optimizer"], env)), ddp)
    print(f"\nfirst step (defaults): DistributedOptimizer / DDP {mine['first'] / ddp['first']:.2f}x")
    return 0
