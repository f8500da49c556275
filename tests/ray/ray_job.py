"""A small torch training job, the same under Ray (imported by the actors) and under `gradwire launch` (run as a
script): an MLP trained STEPS steps with DistributedOptimizer on each rank's own synthetic data. Returns (or prints)
the digest of the final parameters."""

import hashlib
import os
import sys
import time

import torch


def train(steps: int = 20, pause: float = 0.0) -> tuple[int, str]:
    import gradwire.torch as gw

    torch.set_num_threads(1)
    gw.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    gw.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = gw.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), named_parameters=model.named_parameters()
    )
    data = torch.Generator().manual_seed(100 + gw.rank())
    for _ in range(steps):
        x = torch.randn(32, 16, generator=data)
        y = (x[:, :4] * 2).argmax(dim=1)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        time.sleep(pause)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    rank = gw.rank()
    gw.shutdown()
    return rank, digest


if __name__ == "__main__":
    rank, digest = train(int(os.environ.get("STEPS", "20")))
    print(f"DIGEST {rank} {digest}", flush=True)
    sys.exit(0)
