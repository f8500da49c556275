"""Train a small ResNet (residual blocks with BatchNorm) on synthetic images, data-parallel, through any of
gradwire's PyTorch APIs; after every step, check that every worker holds the same parameters, bit for bit.

    gradwire launch -n 2 -s 2 -- python examples/resnet_train.py --api optimizer      # Horovod's shape
    gradwire launch -n 2 -s 2 -- python examples/resnet_train.py --api ddp-hook       # torch DDP + comm hook
    gradwire launch -n 2 -s 2 -- python examples/resnet_train.py --api byteps-ddp     # BytePS's DDP wrapper
    gradwire launch -n 2 -s 2 -- python examples/resnet_train.py --api cross-barrier  # BytePS's CrossBarrier

What it shows: BatchNorm's buffers (running statistics, the 0-dim `num_batches_tracked`) broadcast at the start,
metrics averaged with `allreduce` (Horovod) or `push_pull` (BytePS), and the images/s of the run. Rank 0 prints a
line per epoch and a JSON summary line at the end.
"""

import argparse
import json
import os
import socket
import time

import torch.nn.functional as F

import gradwire.torch as gw
import torch


class Block(torch.nn.Module):
    """conv-BN-ReLU-conv-BN plus the input (a 1x1 projection where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.skip = torch.nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = torch.nn.Sequential(
                torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


class Tempered(torch.nn.Module):
    """The logits divided by a learnt temperature: a 0-dim parameter, which every API must carry too."""

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body
        self.temperature = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) / self.temperature


def resnet(width: int = 16, classes: int = 10) -> torch.nn.Module:
    """A ResNet for 32x32 images: layers of mixed sizes (a scalar and BN vectors to a 256-wide classifier)."""
    body = torch.nn.Sequential(
        torch.nn.Conv2d(3, width, 3, 1, 1, bias=False),
        torch.nn.BatchNorm2d(width),
        torch.nn.ReLU(),
        Block(width, width, 1),
        Block(width, 2 * width, 2),
        Block(2 * width, 4 * width, 2),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * width, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, classes),
    )
    return Tempered(body)


def synthetic(n: int, classes: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose class is a bright square's position, so the model has something to learn."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.randn(n, 3, 32, 32, generator=g) * 0.5
    for i, c in enumerate(y.tolist()):
        r, col = divmod(c, 4)
        x[i, :, 8 * r : 8 * r + 8, 8 * col : 8 * col + 8] += 2.0
    return x, y


def ranks_that_differ(model: torch.nn.Module) -> list[int]:
    """The ranks whose parameters are not rank 0's, bit for bit. (Buffers are not compared: each worker's BatchNorm
    updates its running statistics from its own batch, under Horovod and torch DDP alike.)"""
    mine = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in model.parameters()])
    root = mine.clone()
    gw.broadcast_(root, root_rank=0, name="check.params")
    differs = torch.zeros(gw.size(), dtype=torch.int32)
    differs[gw.rank()] = int(not torch.equal(mine, root))
    return torch.nonzero(gw.allreduce(differs, op=gw.Sum, name="check.differs")).flatten().tolist()


def gloo_address() -> str:
    """DDP needs a process group even when the hook replaces its all-reduce: rank 0 picks a free port (on
    MASTER_ADDR, else this host) and gradwire tells the others."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = 0
    if gw.rank() == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    return f"tcp://{host}:{gw.broadcast_object(port, root_rank=0, name='gloo.port')}"


def build(api: str, model: torch.nn.Module, lr: float):
    """The model to call and the optimizer to step, for one API."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    if api in ("optimizer", "cross-barrier"):
        gw.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = gw.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        if api == "cross-barrier":
            opt = gw.cross_barrier.CrossBarrier(model, opt)
        return model, opt
    if api == "byteps-ddp":
        return gw.parallel.DistributedDataParallel(model), opt  # broadcasts rank 0's state itself
    if api == "ddp-hook":
        import torch.distributed as dist

        gw.broadcast_parameters(model.state_dict(), root_rank=0)
        dist.init_process_group("gloo", init_method=gloo_address(), rank=gw.rank(), world_size=gw.size())
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(gw.PushPullHookState(ddp), gw.push_pull_hook)
        return ddp, opt
    raise SystemExit(f"unknown --api {api}")


def average(api: str, value: torch.Tensor, name: str) -> float:
    """A metric averaged over workers, as each API's users write it."""
    if api.startswith("byteps"):
        return gw.push_pull(value, average=True, name=name).item()  # BytePS: out of place, named
    return gw.allreduce(value, name=name).item()  # Horovod


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--api", default="optimizer", choices=["optimizer", "ddp-hook", "byteps-ddp", "cross-barrier"])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--no-check", action="store_true", help="skip the per-step check (for timing)")
    args = parser.parse_args()

    gw.init()
    torch.set_num_threads(1)
    torch.manual_seed(gw.rank())  # different initial weights on purpose: the broadcast must fix them
    model = resnet()
    x, y = synthetic(args.samples)
    test_x, test_y = synthetic(256, seed=1)
    net, opt = build(args.api, model, args.lr * gw.size())
    shard = slice(gw.rank(), None, gw.size())
    x, y = x[shard], y[shard]
    steps, checks, started = 0, 0, time.monotonic()
    for epoch in range(args.epochs):
        net.train()
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in range(0, len(x) - args.batch_size + 1, args.batch_size):
            batch = order[i : i + args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(net(x[batch]), y[batch])
            loss.backward()
            opt.step()
            steps += 1
            if not args.no_check:
                if args.api == "cross-barrier":
                    opt.synchronize()  # apply the updates still in flight before comparing
                differ = ranks_that_differ(model)
                if differ:
                    raise SystemExit(f"after step {steps} the parameters of rank(s) {differ} differ from rank 0's")
                checks += 1
        loss_avg = average(args.api, loss.detach(), "loss")
        if gw.rank() == 0:
            print(f"epoch {epoch}: loss {loss_avg:.3f}", flush=True)
    elapsed = time.monotonic() - started
    model.eval()
    with torch.no_grad():
        correct = (model(test_x).argmax(1) == test_y).float().mean()
    accuracy = average(args.api, correct, "accuracy")
    images = steps * args.batch_size * gw.size()
    if gw.rank() == 0:
        summary = {"api": args.api, "workers": gw.size(), "steps": steps, "identical_after_steps": checks}
        summary |= {"accuracy": round(accuracy, 3), "images_per_s": round(images / elapsed, 1)}
        print(json.dumps(summary), flush=True)
    gw.shutdown()


if __name__ == "__main__":
    main()
