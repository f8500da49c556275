"""DDP with gradwire's comm hook against DDP's own allreduce_hook: the same parameters after 10 steps."""

import copy
import sys

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire.torch as gwt
import torch

torch.set_num_threads(1)
gwt.init()
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=gwt.rank(), world_size=gwt.size())
torch.manual_seed(0)
base = torch.nn.Sequential(torch.nn.Linear(10, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
models = {}
for kind in ("gradwire", "gloo"):
    model = DDP(copy.deepcopy(base), bucket_cap_mb=0.001)  # several buckets
    if kind == "gradwire":
        model.register_comm_hook(gwt.PushPullHookState(model.module), gwt.push_pull_hook)
    else:
        model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + gwt.rank())
    for _ in range(10):
        x, y = torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    models[kind] = model.module
for a, b in zip(models["gradwire"].parameters(), models["gloo"].parameters(), strict=True):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
print("DDP-HOOK-MATCH", flush=True)
dist.destroy_process_group()
gwt.shutdown()
