"""DDP with gradwire's comm hook carrying PowerSGD (rank 2), against DDP's own allreduce_hook: the same parameters
after 10 steps, where rank 2 loses nothing.

Every rank trains on the same two inputs with labels of its own, so each weight's gradient on each rank has its rows
in the span of the same two vectors (the inputs, or the hidden activations of them), and so has their sum: rank-2
PowerSGD rebuilds that sum exactly (P spans its columns, and P P^T projects onto them), error feedback included (the
workers' residuals add up to zero and keep the same rows). Both ways of the hook: the state built on the inner
module (each bucket through PowerSGD when the hook is called) and on the DDP module (matrices pushed alone as
backward produces them, once DDP's layout is steady). Then the parameters are bit-identical on every rank."""

import copy
import os
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
# two weight matrices PowerSGD rank 2 compresses (64x32, 48x64), a head too small to gain, and biases: plain sums
base = torch.nn.Sequential(
    torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 3)
)  # fmt: skip
inputs = torch.randn(2, 32, generator=torch.Generator().manual_seed(7))  # the same on every rank


def train(kind: str, state_on: str) -> tuple[torch.nn.Module, object]:
    model = DDP(copy.deepcopy(base), bucket_cap_mb=0.004)  # several buckets
    state, compressor = None, gwt.Compression.powersgd(rank=2, start_iter=2)
    if kind == "gradwire":
        state = gwt.PushPullHookState(model if state_on == "ddp" else model.module, compression=compressor)
        model.register_comm_hook(state, gwt.push_pull_hook)
    else:
        model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + gwt.rank())
    for _ in range(10):
        labels = torch.randint(0, 3, (2,), generator=g)
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        opt.step()
        opt.zero_grad()
    if state is not None:
        assert (state.sync is not None) == (state_on == "ddp"), f"{state_on}: overlapped={state.sync is not None}"
    return model.module, compressor


for state_on in ("module", "ddp"):
    (ours, compressor), (theirs, _) = train("gradwire", state_on), train("gloo", state_on)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, s=state_on: f"{s}: {m}")
    # PowerSGD carried both matrices from the third step on, with error feedback of its own on each rank
    states = {name: s for (_, name), s in compressor._tensors.items()}
    compressed = sorted(n.removeprefix("ddp.module.") for n, s in states.items() if s.error.abs().sum() > 0)
    assert compressed == ["ddp.0.weight", "ddp.2.weight"] if state_on == "module" else ["0.weight", "2.weight"], (
        f"{state_on}: {sorted(states)} {compressed}"
    )
    assert all(s.steps == 10 for s in states.values()), f"{state_on}: {[s.steps for s in states.values()]}"
    packed = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    every = [torch.empty_like(packed) for _ in range(gwt.size())]
    dist.all_gather(every, packed)
    assert all(torch.equal(every[0], other) for other in every), f"{state_on}: ranks differ"
    print(f"DDP-POWERSGD-MATCH {state_on}", flush=True)
dist.destroy_process_group()
gwt.shutdown()
os._exit(0)  # as bench/train.py: gloo's threads must not be torn down under a callback
