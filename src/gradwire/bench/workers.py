"""The processes a benchmark starts: `python -m gradwire.bench.workers {gradwire|gloo} SIZES REPEATS WARMUP`.

Each times one collective per size: buffers are refilled outside the timed region, every timed call
starts after a barrier, and rank 0 prints one JSON line per size with every timing. Every rank also prints the CPU
seconds its process (all threads) spent in the timed calls, and when they began and ended (wall clock), so the
runner can charge the servers' CPU of that span too: CPU seconds per GB.

GRADWIRE_BENCH_COLLECTIVE picks the collective (default allreduce), each defined so that a rank ends with SIZE
bytes: allreduce (SIZE in, SIZE out), allgather (SIZE/n in), broadcast (SIZE from rank 0), reducescatter (SIZE in,
SIZE/n out: half an allreduce's traffic for a summation server). gloo runs its own same collective.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

COLLECTIVE = os.environ.get("GRADWIRE_BENCH_COLLECTIVE", "allreduce")
COMPRESSED = COLLECTIVE.split("-", 1)[1] if COLLECTIVE.startswith("allreduce-") else None


def run_gradwire(sizes: list[int], repeats: int, warmup: int) -> None:
    import gradwire as gw

    gw.init()
    worker, n = gw.current_worker(), gw.size()
    compressor = getattr(gw.compression, COMPRESSED)() if COMPRESSED else None
    for nbytes in sizes:
        count = nbytes // 4 // n * n  # divisible by n: every rank's share is equal
        buf = np.empty(count, np.float32)
        name = f"bench-{COLLECTIVE}-{nbytes}"
        times: list[float] = []
        span = [0.0, 0.0]
        cpu = _time_calls(worker, buf, name, warmup, repeats, compressor, times, span)
        span[1] = time.time()
        _cpu_line(gw.rank(), nbytes, cpu, span)
        if gw.rank() == 0:
            chosen = worker.status()["data_path"]  # what ran, and why
            print(json.dumps({"bytes": nbytes, "times": times, "data_path": chosen}), flush=True)
    gw.shutdown()


def _time_calls(
    worker: Any,
    buf: np.ndarray,
    name: str,
    warmup: int,
    repeats: int,
    compressor: object,
    times: list[float],
    span: list[float],
) -> float:
    """One size's calls: the timed ones' seconds into `times`, when they began into span[0]; returns their CPU
    seconds."""
    import gradwire as gw
    from gradwire import collectives

    n, count = gw.size(), buf.size
    part = np.empty(count // n, np.float32)
    cpu = 0.0
    for i in range(warmup + repeats):
        buf.fill(1.0)
        part.fill(1.0)
        gw.barrier()
        if i == warmup:
            span[0] = time.time()
        c0 = time.process_time()
        t0 = time.perf_counter()
        if COLLECTIVE == "allreduce":
            gw.push_pull_inplace(buf, name)
            check = buf[-1] == n
        elif compressor is not None:
            gw.push_pull_inplace(buf, name, compression=compressor)
            check = bool(np.isfinite(buf).all()) and buf.max() > 0
        elif COLLECTIVE == "allgather":
            out = worker.synchronize(collectives.allgather_async(worker, part, name))
            check = out.size == count
        elif COLLECTIVE == "broadcast":
            worker.synchronize(collectives.broadcast_async(worker, buf, 0, name, out=buf))
            check = buf[-1] == 1.0
        else:
            out = worker.synchronize(collectives.reducescatter_async(worker, buf.reshape(n, -1), name))
            check = out.size == count // n and out.reshape(-1)[-1] == n
        elapsed = time.perf_counter() - t0
        spent = time.process_time() - c0
        assert check, COLLECTIVE
        if i >= warmup:
            times.append(elapsed)
            cpu += spent
    return cpu


def run_gloo(sizes: list[int], repeats: int, warmup: int) -> None:
    import torch.distributed as dist

    import torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ["GRADWIRE_BENCH_INIT"], rank=rank, world_size=world)
    for nbytes in sizes:
        count = nbytes // 4 // world * world
        buf = torch.empty(count, dtype=torch.float32)
        parts = [torch.empty(count // world, dtype=torch.float32) for _ in range(world)]
        times, cpu, span = [], 0.0, [0.0, 0.0]
        for i in range(warmup + repeats):
            buf.fill_(1.0)
            parts[rank].fill_(1.0)
            dist.barrier()
            if i == warmup:
                span[0] = time.time()
            c0 = time.process_time()
            t0 = time.perf_counter()
            if COLLECTIVE.startswith("allreduce"):
                dist.all_reduce(buf)
            elif COLLECTIVE == "allgather":
                dist.all_gather(parts, parts[rank].clone())
            elif COLLECTIVE == "broadcast":
                dist.broadcast(buf, 0)
            else:
                dist.reduce_scatter_tensor(parts[rank], buf)
            elapsed = time.perf_counter() - t0
            spent = time.process_time() - c0
            if i >= warmup:
                times.append(elapsed)
                cpu += spent
        span[1] = time.time()
        _cpu_line(rank, nbytes, cpu, span)
        if rank == 0:
            print(json.dumps({"bytes": nbytes, "times": times}), flush=True)
    dist.destroy_process_group()


def _cpu_line(rank: int, nbytes: int, cpu: float, span: list[float]) -> None:
    print(
        "CPU " + json.dumps({"rank": rank, "bytes": nbytes, "cpu": cpu, "start": span[0], "end": span[1]}), flush=True
    )


if __name__ == "__main__":
    system, sizes_arg, repeats_arg, warmup_arg = sys.argv[1:5]
    sizes = [int(s) for s in sizes_arg.split(",")]
    {"gradwire": run_gradwire, "gloo": run_gloo}[system](sizes, int(repeats_arg), int(warmup_arg))
