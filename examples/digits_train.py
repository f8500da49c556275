"""Train a small CNN on scikit-learn's bundled digits (8x8 images, no download), data-parallel.

    gradwire launch -n 4 -s 2 -- python examples/digits_train.py --backend gradwire
    (or DDP over gloo: RANK/WORLD_SIZE set, --backend ddp --init file:///tmp/x)

Rank 0 prints a line per epoch and, at the end, one JSON summary line.
"""

import argparse
import json
import time

import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import torch


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(64 * 4 * 4, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )


def load():
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    return train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["gradwire", "ddp"], default="gradwire")
    p.add_argument("--init", default="", help="torch.distributed init_method for --backend ddp")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="per worker")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.backend == "gradwire":
        import gradwire.torch as gw

        gw.init()
        rank, size = gw.rank(), gw.size()
        gw.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = gw.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        net = model
    else:
        import os

        import torch.distributed as dist

        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", init_method=args.init, rank=rank, world_size=size)
        net = torch.nn.parallel.DistributedDataParallel(model)
    x_train, x_test, y_train, y_test = load()
    shard = slice(rank, None, size)  # every worker its own share of the training set
    xs, ys = x_train[shard], y_train[shard]
    g = torch.Generator().manual_seed(rank)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        t0, seen, total_loss, correct = time.perf_counter(), 0, 0.0, 0
        order = torch.randperm(len(xs), generator=g)
        steps = len(xs) // args.batch  # the same on every worker, so every step has every worker
        for i in range(steps):
            idx = order[i * args.batch : (i + 1) * args.batch]
            opt.zero_grad()
            out = net(xs[idx])
            loss = F.cross_entropy(out, ys[idx])
            loss.backward()
            opt.step()
            seen += len(idx)
            total_loss += loss.item() * len(idx)
            correct += int((out.argmax(1) == ys[idx]).sum())
        rate = seen * size / (time.perf_counter() - t0)
        if rank == 0:
            print(
                f"[{args.backend}] epoch {epoch + 1}/{args.epochs}  loss {total_loss / seen:.4f}  "
                f"train acc {correct / seen:.3f}  {rate:,.0f} samples/s",
                flush=True,
            )
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        test_acc = float((model(x_test).argmax(1) == y_test).float().mean())
    if rank == 0:
        print(f"[{args.backend}] test accuracy {test_acc:.3f}", flush=True)
        print(
            "SUMMARY "
            + json.dumps(
                {
                    "backend": args.backend,
                    "workers": size,
                    "test_accuracy": test_acc,
                    "seconds": elapsed,
                    "samples_per_s": len(xs) * size * args.epochs / elapsed,
                }
            ),
            flush=True,
        )
    if args.backend == "gradwire":
        gw.shutdown()
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
