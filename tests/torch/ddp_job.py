"""DDP with gradwire's comm hook against DDP's own allreduce_hook: the same parameters after 10 steps.

Three ways: the state built on the inner module (each bucket pushed whole), on the DDP module (gradients pushed as
backward produces them, once DDP's layout is steady), and the DDP module with `find_unused_parameters` and a branch
some ranks skip. Steps 6 and 7 accumulate under `no_sync()`. Then the hook with a compressor the servers run (onebit):
every rank's parameters identical, and moved. Then PowerSGD in the hook, where rank 2 is exact (below)."""

import copy
import os
import sys

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire.torch as gwt
import torch

torch.set_num_threads(1)
os.environ["GRADWIRE_COMPRESSION_MIN_BYTES"] = "0"  # this model's buckets are small: compress them all the same
gwt.init()
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=gwt.rank(), world_size=gwt.size())


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(10, 64)
        self.b = torch.nn.Linear(64, 3)
        self.side = torch.nn.Linear(10, 3)  # with find_unused_parameters: used on odd steps by rank 0 only

    def forward(self, x: torch.Tensor, branch: bool = False) -> torch.Tensor:
        out = self.b(torch.relu(self.a(x)))
        return out + self.side(x) if branch else out


torch.manual_seed(0)
base = Net()


def train(kind: str, state_on: str, unused: bool) -> torch.nn.Module:
    model = DDP(copy.deepcopy(base), bucket_cap_mb=0.001, find_unused_parameters=unused)  # several buckets
    state = None
    if kind.startswith("gradwire"):
        compression = gwt.Compression.onebit() if kind == "gradwire-onebit" else gwt.Compression.none
        state = gwt.PushPullHookState(model if state_on == "ddp" else model.module, compression=compression)
        model.register_comm_hook(state, gwt.push_pull_hook)
    else:
        model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + gwt.rank())
    for step in range(10):
        x, y = torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)
        branch = not unused or (gwt.rank() == 0 and step % 2 == 1)
        if step in (6, 7):
            with model.no_sync():
                torch.nn.functional.cross_entropy(model(x, branch), y).backward()
            continue
        torch.nn.functional.cross_entropy(model(x, branch), y).backward()
        opt.step()
        opt.zero_grad()
    if state is not None:
        overlapped = state.sync is not None
        assert overlapped == (state_on == "ddp"), f"{state_on}: overlapped={overlapped}"
    return model.module


for state_on, unused in (("module", False), ("ddp", False), ("ddp", True)):
    ours, theirs = train("gradwire", state_on, unused), train("gloo", state_on, unused)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, s=state_on, u=unused: f"{s} {u}: {m}")
print("DDP-HOOK-MATCH", flush=True)
packed = torch.cat([p.detach().reshape(-1) for p in train("gradwire-onebit", "ddp", False).parameters()])
every = [torch.empty_like(packed) for _ in range(gwt.size())]
dist.all_gather(every, packed)
assert all(torch.equal(every[0], other) for other in every), "compressed: ranks differ"
assert not torch.equal(packed, torch.cat([p.detach().reshape(-1) for p in base.parameters()]))
print("DDP-HOOK-COMPRESSED-IDENTICAL", flush=True)

# PowerSGD (rank 2) in the hook, against DDP's allreduce_hook, where rank 2 loses nothing: every rank trains on the
# same two inputs with labels of its own, so each weight's gradient on each rank has its rows in the span of the same
# two vectors (the inputs, or their hidden activations), and so has their sum: rank-2 PowerSGD rebuilds that sum
# exactly (P spans its columns, and P P^T projects onto them), error feedback included (the workers' residuals add
# up to zero and keep the same rows). Both ways of the hook; then the parameters are bit-identical on every rank.
torch.manual_seed(0)
# two weight matrices PowerSGD rank 2 compresses (64x32, 48x64), a head too small to gain, and biases: plain sums
mlp = torch.nn.Sequential(
    torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 3)
)  # fmt: skip
inputs = torch.randn(2, 32, generator=torch.Generator().manual_seed(7))  # the same on every rank


def train_powersgd(kind: str, state_on: str) -> tuple[torch.nn.Module, object]:
    model = DDP(copy.deepcopy(mlp), bucket_cap_mb=0.004)  # several buckets
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
    (ours, compressor), (theirs, _) = train_powersgd("gradwire", state_on), train_powersgd("gloo", state_on)
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
