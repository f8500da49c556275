"""Worker script: init, sum, barrier, shutdown, three times in one process (Horovod's tests and notebooks do it);
each generation uses the same names with a new shape, and the last one ends at process exit without shutdown()."""

import sys
import time

import gradwire.torch as gw
import torch

marker = sys.argv[1]
for generation in range(3):
    started = time.monotonic()
    gw.init()
    t = torch.full((generation + 2,), float(gw.rank() + 1))
    total = gw.allreduce(t, op=gw.Sum, name="value")
    assert total.tolist() == [sum(range(1, gw.size() + 1))] * (generation + 2), total
    gw.broadcast_parameters({"scalar": torch.tensor(gw.rank())}, root_rank=0)
    gw.barrier()
    print(f"GENERATION {generation} rank {gw.rank()} of {gw.size()} in {time.monotonic() - started:.2f}s", flush=True)
    if generation < 2:
        gw.shutdown()
print(f"DONE {marker}", flush=True)
