"""End-to-end training as a benchmark: `python -m gradwire.bench.train {optimizer|hook|ddp} STEPS WARMUP`.

A microbenchmark is not the workload: here a model with layers of mixed sizes (a conv stack with BatchNorm, then a
3M-parameter MLP) trains for real, gradients leave in backward order as hooks fire, and workers drift apart in time
(each computes on its own random batch, on shared cores); with GRADWIRE_BENCH_REPLAY=PROFILE its compute is replayed
from a profile instead (gradwire/profiles: `python -m benchmarks --netem --scale`). The three ways:
- `optimizer`: gradwire's DistributedOptimizer (Horovod's shape);
- `hook`: torch's DistributedDataParallel with gradwire's comm hook (DDP's buckets through the summation servers);
- `ddp`: torch's DistributedDataParallel over gloo, the peer;
- `plain`: no distribution at all, one process (the baseline of a job of one: docs/migrating.md, "One process");
- `optimizer-onebit`, `optimizer-topk`, `optimizer-powersgd`: DistributedOptimizer with the servers' compressors
  (onebit, top-k 1%, error feedback) and PowerSGD rank 2 through the servers (docs/compression.md); `ddp-powersgd`: DDP
  over gloo with torch's PowerSGD hook (rank 2), the peer's own compression; `hook-powersgd`: DDP with gradwire's
  comm hook carrying PowerSGD rank 2 through the servers;
- `crossbarrier`: DistributedOptimizer under BytePS's CrossBarrier (gradwire.torch.cross_barrier, which a user opts
  into): `step()` returns at once and each layer's update waits for its sums at its next forward, so the next forward
  pass overlaps this step's communication (per-step times are then the pipeline's: each step's start to its `step()`);
- `optimizer-fp16`, `optimizer-bf16`: DistributedOptimizer with Horovod's `Compression.fp16` and `.bf16` (gradients
  travel in half precision; the servers sum them in float32, with numpy's or the native kernels: GRADWIRE_DATAPATH).
Rank 0 prints one JSON line: every timed step's seconds, the samples per step, the parameter count, and gradwire's
partition size at the start and at the end. With GRADWIRE_BENCH_PROGRESS set, rank 0 also writes its last finished
step there (`gradwire bench --netem --train --drift` changes the links' rate once the warmup steps are done).
"""

from __future__ import annotations

import bisect
import json
import os
import socket
import sys
import time
from typing import Any

BATCH = 32
# GRADWIRE_BENCH_MODEL (`--train-model`): `bench`, the model below; `mixed`, most of its bytes in two large matrices
# beside several small tensors (two conv layers, Linear layers of 1024x2048, 2048x1024 and 1024x10: 4.2M parameters),
# at batch 16, where each PowerSGD round's fixed cost shows (docs/compression.md)
MIXED_BATCH = 16


# every way `main` trains (the docstring above says what each is): a name not here is an error, not another way
WAYS = (
    "optimizer",
    "hook",
    "ddp",
    "plain",
    "crossbarrier",
    "optimizer-onebit",
    "optimizer-topk",
    "optimizer-powersgd",
    "optimizer-fp16",
    "optimizer-bf16",
    "ddp-powersgd",
    "hook-powersgd",
)


def batch_size() -> int:
    return MIXED_BATCH if os.environ.get("GRADWIRE_BENCH_MODEL") == "mixed" else BATCH


def model():
    import torch

    torch.manual_seed(0)
    if os.environ.get("GRADWIRE_BENCH_REPLAY"):  # `--scale`: the profiled model's compute replayed (gradwire/profiles)
        from gradwire import profiles

        return profiles.replay_model(profiles.load(os.environ["GRADWIRE_BENCH_REPLAY"])["layers"])
    if os.environ.get("GRADWIRE_BENCH_MODEL") == "mixed":
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(4),
            torch.nn.Flatten(),
            torch.nn.Linear(16 * 8 * 8, 2048),
            torch.nn.ReLU(),
            torch.nn.Linear(2048, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 10),
        )
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1),
        torch.nn.BatchNorm2d(32),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1),
        torch.nn.BatchNorm2d(64),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(4),
        torch.nn.Flatten(),
        torch.nn.Linear(64 * 8 * 8, 768),
        torch.nn.ReLU(),
        torch.nn.Linear(768, 768),
        torch.nn.ReLU(),
        torch.nn.Linear(768, 10),
    )


def _gloo(rank: int, world: int) -> None:
    import torch.distributed as dist

    init = os.environ.get("GRADWIRE_BENCH_INIT")
    if init is None:  # the hook's process group, beside a gradwire job: rank 0 picks the port, gradwire tells all
        import gradwire.torch as gw

        address = None
        if rank == 0:
            with socket.socket() as s:
                s.bind((os.environ.get("GRADWIRE_HOST", "127.0.0.1"), 0))
                address = s.getsockname()[:2]
        host, port = gw.broadcast_object(address, root_rank=0, name="bench.gloo.address")
        init = f"tcp://{host}:{port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)


def _ours(way: str) -> bool:
    """Whether `way` trains through gradwire (not DDP over gloo, not alone)."""
    return not way.startswith(("ddp", "plain"))


def _data_path(way: str) -> dict:
    """gradwire's settings now (they change where the links drift: scheduler/adapt.py)."""
    if not _ours(way):
        return {}
    from gradwire.session import current_worker

    return current_worker().status()["data_path"]


def _pushed(way: str) -> int:
    """The bytes this worker has pushed so far (gradwire's metrics; 0 for DDP)."""
    if not _ours(way):
        return 0
    from gradwire.session import current_worker

    return current_worker().state.metrics.bytes_pushed


def main(way: str, steps: int, warmup: int) -> None:
    import torch.nn.functional as F

    import torch

    if way not in WAYS:
        raise SystemExit(f"gradwire.bench.train: no way {way!r} (these are: {', '.join(WAYS)})")
    torch.set_num_threads(1)
    net, opt, rank, world = _distributed(way, warmup + steps)
    g = torch.Generator().manual_seed(rank)
    batch = batch_size()
    times = []
    partitions = [_data_path(way).get("partition_bytes")]
    starts = []  # each step's wall-clock start: the step a re-cut came in
    pushed = 0  # bytes this worker pushed in the timed steps (gradwire's ways)
    for step in range(warmup + steps):
        if step == warmup:
            pushed = -_pushed(way)
        x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
        if os.environ.get("GRADWIRE_BENCH_REPLAY"):
            x = torch.randn(batch, 10, generator=g)  # the replayed model passes its input through
        t0 = time.perf_counter()
        starts.append(time.time())
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
        if rank == 0 and os.environ.get("GRADWIRE_BENCH_PROGRESS"):
            with open(os.environ["GRADWIRE_BENCH_PROGRESS"], "w") as f:
                f.write(str(step + 1))
    pushed += _pushed(way)
    params = sum(p.numel() for p in net.parameters())
    data_path = _data_path(way)
    partitions.append(data_path.get("partition_bytes"))
    if rank == 0:
        row = {"way": way, "times": times, "samples_per_step": batch * world, "parameters": params}
        row["optimizer"] = type(opt).__name__  # what stepped: a torch optimizer, DistributedOptimizer, CrossBarrier
        recuts = [bisect.bisect(starts, r["at"]) - 1 for r in data_path.get("recuts") or []]
        row |= {"partition_bytes": partitions, "derived_again": data_path.get("derived_again"), "recut_steps": recuts}
        row["window"] = data_path.get("window")
        if _ours(way):
            row["pushed_bytes_per_step"] = pushed / max(1, steps)
        print(json.dumps(row))
        sys.stdout.flush()
    _end(way)


def _end(way: str) -> None:
    """Leave the job: gradwire's shutdown, or gloo's barrier and an immediate exit."""
    import torch.distributed as dist

    if _ours(way):
        import gradwire.torch as gw

        gw.shutdown()
    if dist.is_initialized():
        # gloo's threads (PowerSGD's hook chains its callbacks on them) abort the process when the group is destroyed,
        # or left to the interpreter's exit, while one of them is still winding down: the job is done, so end at once
        dist.barrier()
        sys.stdout.flush()
        os._exit(0)


def ddp_of(net: Any, powersgd: bool = False) -> Any:
    """`net` in torch's DistributedDataParallel (the process group started), with torch's PowerSGD hook (rank 2, from
    the third step) where asked."""
    import torch

    if not powersgd:
        return torch.nn.parallel.DistributedDataParallel(net)
    # one bucket: over gloo, PowerSGD's chained collectives of several buckets go out in a different order on
    # different ranks (a collective mismatch at n = 4 here; pytorch/pytorch#58467 lists gloo's failures)
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook

    dist._DEFAULT_FIRST_BUCKET_BYTES = 1 << 30
    ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1024)
    state = hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, hook.powerSGD_hook)
    return ddp


def _distributed(way: str, steps: int) -> tuple:
    """The model and its optimizer made distributed `way`'s way (ddp, optimizer, hook, ...), and this rank and the size;
    `steps`: how many the job runs (the cross barrier applies every update at the last)."""
    import torch

    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    if way == "plain":
        return net, opt, 0, 1
    if way.startswith("ddp"):
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _gloo(rank, world)
        return ddp_of(net, way == "ddp-powersgd"), opt, rank, world
    import gradwire.torch as gw

    gw.init()
    rank, world = gw.rank(), gw.size()
    if way == "crossbarrier":
        wrapped = gw.DistributedOptimizer(opt, net.named_parameters())
        return net, gw.cross_barrier.CrossBarrier(net, wrapped, num_steps=steps), rank, world
    if way.startswith("optimizer"):
        compression = {
            "optimizer-onebit": gw.Compression.onebit(),
            "optimizer-topk": gw.Compression.topk(0.01),
            "optimizer-powersgd": gw.Compression.powersgd(rank=2, start_iter=2),  # as the ddp-powersgd way
            "optimizer-fp16": gw.Compression.fp16,
            "optimizer-bf16": gw.Compression.bf16,
        }
        named = net.named_parameters()
        return (
            net,
            gw.DistributedOptimizer(opt, named, compression=compression.get(way, gw.Compression.none)),
            rank,
            world,
        )
    _gloo(rank, world)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    compression = gw.Compression.powersgd(rank=2, start_iter=2) if way == "hook-powersgd" else gw.Compression.none
    ddp.register_comm_hook(gw.PushPullHookState(ddp, compression=compression), gw.push_pull_hook)
    return ddp, opt, rank, world


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
