"""Train on a Ray cluster with gradwire: Horovod's RayExecutor shape, then Ray Train's TorchTrainer.

    pip install 'gradwire[ray]'
    python examples/ray_train.py                 # starts a local Ray; or RAY_ADDRESS=... for your cluster

Prints, for each way, the seconds from the start to the end of the first training step, and the final loss.
"""

import os
import tempfile
import time

import gradwire.ray as gray
import ray
import torch


def train(steps: int = 30, started: float = 0.0) -> dict:
    import gradwire.torch as gw

    torch.set_num_threads(1)
    gw.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = gw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    gw.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.Generator().manual_seed(gw.rank())
    first_step = None
    for _ in range(steps):
        x = torch.randn(64, 16, generator=data)
        y = (x[:, :4] * 2).argmax(dim=1)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        first_step = first_step or time.time() - started
    result = {"rank": gw.rank(), "first_step_s": first_step, "loss": float(loss.detach())}
    gw.shutdown()
    return result


def main() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = time.time()
    ray.init(include_dashboard=False)
    # on a 2-core machine: 2 x 0.5 CPU for workers and 2 x 0.25 for servers (Ray counts, it does not pin)
    executor = gray.RayExecutor(num_workers=2, num_servers=2, cpus_per_worker=0.5, cpus_per_server=0.25)
    executor.start()
    results = executor.run(train, kwargs={"started": started})
    executor.shutdown()
    print(f"RayExecutor: first step {results[0]['first_step_s']:.1f} s after start, loss {results[0]['loss']:.3f}")

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = TorchTrainer(
            lambda config: print("TorchTrainer:", train(started=config["started"]), flush=True),
            train_loop_config={"started": started},
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
            torch_config=gray.GradwireConfig(num_servers=2, cpus_per_server=0.25),  # was TorchConfig()
            run_config=RunConfig(storage_path=tmp),
        )
        trainer.fit()
    ray.shutdown()


if __name__ == "__main__":
    main()
