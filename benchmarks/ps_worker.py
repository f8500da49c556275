"""One worker of `python -m benchmarks --ps` (under `gradwire launch`): parameter-server mode against local optimizers.

    python -m benchmarks.ps_worker memory --mode server     # a 25M-parameter MLP with Adam; prints peak RSS
    python -m benchmarks.ps_worker digits --mode server --staleness 2 --slow-ms 20
    python -m benchmarks.ps_worker digits --mode local --compression onebit --seed 3   # python -m benchmarks --accuracy
    python -m benchmarks.ps_worker digits --mode server --compression topk               # bench --ps --compression
    python -m benchmarks.ps_worker digits --mode ddp --curve    # under netem's gloo jobs: bench --netem --accuracy

Rank 0 prints one line `PS {json}`; every rank prints `RSS {json}` in the memory task.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from typing import Any

import gradwire.torch as gw
import torch
from gradwire.session import current_worker

# `--compression`: DistributedOptimizer's compressor (docs/compression.md), as `python -m benchmarks --accuracy`
# compares them; ServerOptimizer's (onebit, topk) for `python -m benchmarks --ps --compression`
COMPRESSORS = {
    "none": lambda: gw.Compression.none,
    "onebit": gw.Compression.onebit,
    "topk": lambda: gw.Compression.topk(0.01),
    "powersgd": lambda: gw.Compression.powersgd(rank=2),
}


def _optimizer(
    model: torch.nn.Module,
    mode: str,
    name: str,
    staleness: int,
    compression: str = "none",
    dc: float = 0.0,
    **hyper: float,
) -> torch.optim.Optimizer:
    if mode == "server":
        compressor = None if compression == "none" else COMPRESSORS[compression]()
        return gw.ServerOptimizer(
            model, name, staleness=staleness, delay_compensation=dc, compression=compressor, **hyper
        )
    cls = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[name]
    gw.broadcast_parameters(model.state_dict(), root_rank=0)
    named, compressor = model.named_parameters(), COMPRESSORS[compression]()
    return gw.DistributedOptimizer(cls(model.parameters(), **hyper), named_parameters=named, compression=compressor)


def memory(args: argparse.Namespace) -> None:
    """A 25M-parameter MLP (float32) trained a few steps with Adam; every rank reports its peak RSS."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
        torch.nn.Linear(4096, 10),
    )  # fmt: skip
    params = sum(p.numel() for p in model.parameters())
    optimizer = _optimizer(model, args.mode, "adam", 0, lr=1e-4)
    x, y = torch.randn(16, 2048), torch.randint(0, 10, (16,))
    start = time.perf_counter()
    for _ in range(args.steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    seconds = (time.perf_counter() - start) / args.steps
    local_state = sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RSS " + json.dumps({"rank": gw.rank(), "peak_rss": peak}), flush=True)
    if gw.rank() == 0:
        summary = {"mode": args.mode, "params": params, "step_s": seconds, "optimizer_state_bytes_here": local_state}
        print("PS " + json.dumps(summary), flush=True)


def _digits_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits: train images, train labels, test images, test labels (a fixed 80/20 split)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits_data = load_digits()
    x = torch.tensor(digits_data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits_data.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return x_train, y_train, x_test, y_test


def _distributed(args: argparse.Namespace, model: torch.nn.Module) -> tuple[torch.nn.Module, Any, int, int]:
    """What trains the model `args.mode`'s way (the module called, the optimizer), this rank and the size. `ddp`:
    torch's DistributedDataParallel over gloo (with its PowerSGD hook for `--compression powersgd`), as a peer."""
    hyper = {"lr": 0.05, "momentum": args.momentum}
    if args.mode == "ddp":
        from gradwire.bench.train import _gloo, ddp_of

        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _gloo(rank, size)
        return ddp_of(model, args.compression == "powersgd"), torch.optim.SGD(model.parameters(), **hyper), rank, size
    optimizer = _optimizer(model, args.mode, "sgd", args.staleness, args.compression, args.dc, **hyper)
    return model, optimizer, gw.rank(), gw.size()


def _digits_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(64 * 4 * 4, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )  # fmt: skip


def digits(args: argparse.Namespace) -> None:
    """A classifier trained with SGD and momentum, test accuracy at the end (and, `--curve`, after every epoch, with
    the training seconds so far: evaluation is not counted): `digits`, the README demo's CNN on scikit-learn's digits
    at a constant learning rate; `mnist1d`, the larger task (benchmarks/mnist1d.py), its rate on a cosine schedule."""
    from benchmarks import mnist1d

    x_train, y_train, x_test, y_test = mnist1d.load(args.data) if args.task == "mnist1d" else _digits_data()
    torch.manual_seed(args.seed)
    model = mnist1d.model() if args.task == "mnist1d" else _digits_model()
    net, optimizer, rank, size = _distributed(args, model)
    steps = len(x_train[rank::size]) // 32
    metrics = current_worker().state.metrics if args.mode != "ddp" else None
    pushed = metrics.bytes_pushed if metrics else 0
    seconds = _epochs(args, net, optimizer, rank, size, (x_train, y_train, x_test, y_test))
    pushed = metrics.bytes_pushed - pushed if metrics else 0
    _barrier(args.mode)  # every worker's last push is in
    if args.mode == "server":
        optimizer.pull_parameters()  # the newest (a worker of an asynchronous job may hold older ones)
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    if rank == 0:
        summary = {
            "mode": args.mode,
            "staleness": args.staleness,
            "delay_compensation": args.dc,
            "slow_ms": args.slow_ms,
            "momentum": args.momentum,
            "compression": args.compression,
            "task": args.task,
            "seed": args.seed,
            "test_accuracy": accuracy,
            "seconds": seconds,
            "steps_per_s": steps * args.epochs / seconds,
            "bytes_pushed_per_step": pushed / (steps * args.epochs),
        }
        print("PS " + json.dumps(summary), flush=True)


def _epochs(args: argparse.Namespace, net: torch.nn.Module, optimizer: Any, rank: int, size: int, data: tuple) -> float:
    """`args.epochs` epochs of this rank's share of the training set, batches of 32; the seconds they took (with
    `--curve`, rank 0 prints the test accuracy after each, not counted)."""
    x_train, y_train, x_test, y_test = data
    xs, ys = x_train[rank::size], y_train[rank::size]
    g = torch.Generator().manual_seed(rank + 1000 * args.seed)
    steps, seconds = len(xs) // 32, 0.0
    model = getattr(net, "module", net)  # DDP's: evaluated without a collective
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs) if args.task == "mnist1d" else None
    for epoch in range(args.epochs):
        start = time.perf_counter()
        order = torch.randperm(len(xs), generator=g)
        for i in range(steps):
            if rank == size - 1 and args.slow_ms:
                time.sleep(args.slow_ms / 1e3)
            idx = order[i * 32 : (i + 1) * 32]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(xs[idx]), ys[idx]).backward()
            optimizer.step()
        if cosine is not None:
            cosine.step()
        seconds += time.perf_counter() - start
        if args.curve and rank == 0:
            with torch.no_grad():
                accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
            point = {"epoch": epoch + 1, "seconds": seconds, "test_accuracy": accuracy}
            print("EPOCH " + json.dumps(point), flush=True)
    return seconds


def _barrier(mode: str) -> None:
    if mode != "ddp":
        gw.barrier()
        return
    import torch.distributed as dist

    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("task", choices=["memory", "digits", "mnist1d"])
    p.add_argument("--mode", choices=["local", "server", "ddp"], default="server")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--staleness", type=int, default=0)
    p.add_argument("--dc", type=float, default=0.0, help="delay compensation's lambda (asynchronous server mode)")
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--compression", choices=sorted(COMPRESSORS), default="none")
    p.add_argument("--seed", type=int, default=0, help="the model's initialisation and the data's order")
    p.add_argument("--curve", action="store_true", help="digits: test accuracy after every epoch (EPOCH lines)")
    p.add_argument(
        "--data", default=None, help="mnist1d: the data set's file (benchmarks/mnist1d.py save); else made here"
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.mode == "ddp":  # started by the emulated network's gloo jobs (netem/jobs.py start_gloo)
        digits(args)
        sys.stdout.flush()
        os._exit(0)  # as bench/train.py: gloo's threads (PowerSGD's hook) must not be torn down under a callback
    gw.init()
    (memory if args.task == "memory" else digits)(args)
    gw.shutdown()


if __name__ == "__main__":
    main()
