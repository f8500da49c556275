"""`python -m benchmarks --gil`: what a busy data path takes from the training thread of its own process.

A worker's training thread runs Python between its kernels (the model's modules, autograd's hooks, the optimizer), so
a data path that takes the GIL per partition slows the step even where the link and the cores have room to spare.
Measured as a user's process has it: a job of 2 workers and 1 server on this machine (`gradwire launch`, the
defaults), where rank 0's main thread trains bench/train.py's model alone (forward, backward, SGD: no gradient leaves
it; one torch thread) while another thread of the same process keeps the data path busy: push_pull of one float32
tensor (`--sizes`' first, MiB) at `--gil-rate` MB/s, every rank alike, far below what the path moves on this host
(so neither the link nor the cores bound it: rank 1 does not train, one core is left to the data path). The steps
run three times: quiet (nothing else in the process), busy, quiet again; the step's slowdown is the busy steps'
median over the quiet ones' (both quiet runs: drift on a shared machine shows as their difference). Each data path
(GRADWIRE_DATAPATH native, then python) is its own job, alternated `--rounds` times.

The busy thread's calls agree on when to stop through their own sums: rank 0 adds 1 in the tensor's last element
once its steps are done, and every rank stops after the call whose sum says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

PATHS = ("native", "python")


def worker(steps: int, mib: float, rate: float) -> None:
    """One rank of the job (`python -m benchmarks.gil STEPS MIB RATE` under `gradwire launch`)."""
    import numpy as np
    import torch.nn.functional as F

    import gradwire
    import torch
    from gradwire.bench.train import batch_size, model
    from gradwire.session import current_worker

    torch.set_num_threads(1)
    gradwire.init()
    rank = gradwire.rank()
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    batch = batch_size()
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def train(count: int = steps) -> list[float]:
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        return times

    tensor = np.ones(max(2, int(mib * (1 << 18))), np.float32)
    period = tensor.nbytes / (rate * 1e6)
    done = threading.Event()  # rank 0's steps are over: its next call says so
    moved = []  # (seconds, bytes) of the busy thread's calls

    def busy() -> None:
        start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            tensor[-1] = 1.0 if rank == 0 and done.is_set() else 0.0
            total = gradwire.push_pull(tensor, name="gil.busy")
            moved.append((time.perf_counter() - t0, tensor.nbytes))
            if total[-1] > 0:
                break
            time.sleep(max(0.0, start + len(moved) * period - time.perf_counter()))

    train(10)  # warm: the model's first steps allocate
    gradwire.barrier()
    quiet = train() if rank == 0 else []
    gradwire.barrier()
    thread = threading.Thread(target=busy, name="gil-busy")
    cpu0, wall0 = time.process_time(), time.perf_counter()
    thread.start()
    loaded = train() if rank == 0 else []
    done.set()
    thread.join()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    gradwire.barrier()
    again = train() if rank == 0 else []
    if rank == 0:
        path = current_worker().status()["data_path"]
        row = {"quiet": quiet, "busy": loaded, "again": again, "calls": len(moved), "moved": sum(b for _, b in moved)}
        row |= {"call_seconds": statistics.median(s for s, _ in moved), "wall": wall, "cpu": cpu, "path": path}
        print("GIL " + json.dumps(row), flush=True)
    gradwire.shutdown()


def _job(path: str, steps: int, mib: float, rate: float, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "gradwire", "launch", "-n", "2", "-s", "1", "--"]
    cmd += [sys.executable, "-m", "benchmarks.gil", str(steps), str(mib), str(rate)]
    job_env = os.environ | env | {"GRADWIRE_DATAPATH": path}
    done = subprocess.run(cmd, capture_output=True, text=True, env=job_env, timeout=900)
    lines = [line.split("] ", 1)[-1] for line in done.stdout.splitlines()]  # the launcher prefixes "[worker r] "
    rows = [json.loads(line[4:]) for line in lines if line.startswith("GIL ")]
    if done.returncode != 0 or not rows:
        raise SystemExit(f"the {path} job failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return rows[0]


def run_gil(args: argparse.Namespace, env: dict[str, str]) -> int:
    """`env`: the GRADWIRE_* settings the options impose (bench/cli.py's; none by default)."""
    mib, rate, steps = float(args.sizes.split(",")[0]), args.gil_rate, args.steps
    print(f"rank 0 trains bench/train.py's model ({steps} steps, one torch thread) while a thread of its process")
    print(f"push_pulls {mib:g} MiB at {rate:g} MB/s; 2 workers, 1 server, this machine; median step, ms")
    print(f"partition bytes: {args.partition_bytes or 'the default'}\n")
    print("| data path | quiet | busy | again | busy / quiet | calls | MB/s moved | call ms | process CPU while busy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios: dict[str, list[float]] = {path: [] for path in PATHS}
    for _ in range(args.rounds):
        for path in PATHS:
            row = _job(path, steps, mib, rate, env)
            quiet = statistics.median(row["quiet"] + row["again"])
            busy = statistics.median(row["busy"])
            ratios[path].append(busy / quiet)
            running = row["path"].get("worker", "?")  # what the worker ran, where it is not what was asked
            name = path if running.startswith(path) else f"{path} ({running})"
            print(
                f"| {name} | {statistics.median(row['quiet']) * 1e3:.1f} | {busy * 1e3:.1f} | "
                f"{statistics.median(row['again']) * 1e3:.1f} | {busy / quiet:.3f} | {row['calls']} | "
                f"{row['moved'] / row['wall'] / 1e6:.0f} | {row['call_seconds'] * 1e3:.1f} | "
                f"{row['cpu'] / row['wall'] * 100:.0f}% |",
                flush=True,
            )
    print()
    for path, values in ratios.items():
        print(f"{path}: busy / quiet {', '.join(f'{v:.3f}' for v in values)}")
    return 0


if __name__ == "__main__":
    worker(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))
