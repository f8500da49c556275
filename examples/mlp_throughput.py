"""Training throughput of a communication-heavy MLP (~25M parameters, synthetic data): gradwire against DDP over gloo.

    .venv/bin/python examples/mlp_throughput.py            # 4 workers, 4 servers, both systems, same run

A worker script too: `--role worker --backend gradwire|ddp` (started by the driver).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch.nn.functional as F

import torch


def make_model() -> torch.nn.Module:
    # 1024*4096 + 4096*4096 + 4096*1024 weights: 25.2M parameters, 100 MB of float32 gradient per step
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 1024),
    )


def worker(backend: str, steps: int, warmup: int, batch: int, init: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if backend == "gradwire":
        import gradwire.torch as gw

        gw.init()
        rank, size, net = gw.rank(), gw.size(), model
        opt = gw.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    else:
        import torch.distributed as dist

        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
        net = torch.nn.parallel.DistributedDataParallel(model)
    x, y = torch.randn(batch, 1024), torch.randn(batch, 1024)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        times.sort()
        print(
            "RESULT "
            + json.dumps(
                {
                    "backend": backend,
                    "workers": size,
                    "step_s": times[len(times) // 2],
                    "samples_per_s": batch * size / times[len(times) // 2],
                }
            ),
            flush=True,
        )


def run(cmd: list[str], env: dict) -> dict:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if "RESULT " in line]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{cmd[:5]} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(lines[0].split("RESULT ", 1)[1])


def driver(n: int, k: int, steps: int, rounds: int) -> None:
    me = [sys.executable, __file__, "--role", "worker", "--steps", str(steps)]
    results: dict[str, list[float]] = {"gradwire": [], "ddp": []}
    for _ in range(rounds):
        gw = run(
            [
                sys.executable,
                "-m",
                "gradwire",
                "launch",
                "-n",
                str(n),
                "-s",
                str(k),
                "--",
                *me,
                "--backend",
                "gradwire",
            ],
            os.environ.copy(),
        )
        results["gradwire"].append(gw["samples_per_s"])
        with tempfile.TemporaryDirectory() as tmp:
            init = f"file://{tmp}/rendezvous"
            procs = [
                subprocess.Popen(
                    [*me, "--backend", "ddp", "--init", init],
                    stdout=subprocess.DEVNULL,
                    env=os.environ | {"RANK": str(r), "WORLD_SIZE": str(n)},
                )
                for r in range(1, n)
            ]
            ddp = run([*me, "--backend", "ddp", "--init", init], os.environ | {"RANK": "0", "WORLD_SIZE": str(n)})
            for p in procs:
                p.wait()
        results["ddp"].append(ddp["samples_per_s"])
    g, d = sorted(results["gradwire"])[rounds // 2], sorted(results["ddp"])[rounds // 2]
    print(f"MLP 25.2M parameters, {n} workers, {k} servers, loopback, median of {rounds} alternated runs")
    print("| system | samples/s | all runs |\n|---|---:|---|")
    print(f"| gradwire | {g:.1f} | {', '.join(f'{v:.1f}' for v in results['gradwire'])} |")
    print(f"| DDP (gloo) | {d:.1f} | {', '.join(f'{v:.1f}' for v in results['ddp'])} |")
    print(f"gradwire / DDP: {g / d:.2f}x")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="driver")
    p.add_argument("--backend", default="gradwire")
    p.add_argument("--init", default="")
    p.add_argument("-n", type=int, default=4)
    p.add_argument("-s", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    if a.role == "worker":
        worker(a.backend, a.steps, 2, 32, a.init)
    else:
        driver(a.n, a.s, a.steps, a.rounds)
