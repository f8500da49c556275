"""The processes a benchmark starts: `python -m gradwire.bench.workers {gradwire|gloo} SIZES REPEATS WARMUP`.

Each times one collective per size: buffers are refilled outside the timed region, every timed call
starts after a barrier, and rank 0 prints one JSON line per size with every timing.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


def run_gradwire(sizes: list[int], repeats: int, warmup: int) -> None:
    import gradwire as gw

    gw.init()
    for nbytes in sizes:
        buf = np.empty(nbytes // 4, np.float32)
        name = f"bench-{nbytes}"
        times = []
        for i in range(warmup + repeats):
            buf.fill(1.0)
            gw.barrier()
            t0 = time.perf_counter()
            gw.push_pull_inplace(buf, name)
            elapsed = time.perf_counter() - t0
            if i >= warmup:
                times.append(elapsed)
        assert buf[0] == gw.size() and buf[-1] == gw.size(), (buf[0], gw.size())
        if gw.rank() == 0:
            chosen = gw.current_worker().status()["data_path"]  # what gradwire chose (or was told), and why
            print(json.dumps({"bytes": nbytes, "times": times, "data_path": chosen}), flush=True)
    gw.shutdown()


def run_gloo(sizes: list[int], repeats: int, warmup: int) -> None:
    import torch.distributed as dist

    import torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ["GRADWIRE_BENCH_INIT"], rank=rank, world_size=world)
    for nbytes in sizes:
        buf = torch.empty(nbytes // 4, dtype=torch.float32)
        times = []
        for i in range(warmup + repeats):
            buf.fill_(1.0)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            elapsed = time.perf_counter() - t0
            if i >= warmup:
                times.append(elapsed)
        assert buf[0].item() == world
        if rank == 0:
            print(json.dumps({"bytes": nbytes, "times": times}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    system, sizes_arg, repeats_arg, warmup_arg = sys.argv[1:5]
    sizes = [int(s) for s in sizes_arg.split(",")]
    {"gradwire": run_gradwire, "gloo": run_gloo}[system](sizes, int(repeats_arg), int(warmup_arg))
