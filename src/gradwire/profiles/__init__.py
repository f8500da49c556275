"""Layer profiles: a model's layers with parameters, their sizes and their forward and backward times, profiled once
(docs/scaling.md). The step-time model reads them (`gradwire plan --predict`, gradwire/predict.py), and a
`replay_model` of one stands in for the model it was taken from (`gradwire bench --netem --train` with
GRADWIRE_BENCH_REPLAY), so that two cores do not bound a scaling curve.

A `replay_model` has one parameter of each profiled size per layer, in the same order, and sleeps each layer's measured
time in its forward and its backward: its gradients become ready in backward order, each after its layer's backward
time, as the real model's do, with the same sizes, while the cores stay free (a sleep takes none) for the data path.
DDP's and gradwire's hooks fire on them as on any model. The profiles here are written by the lab's profiler
(benchmarks/replay.py, `python -m benchmarks.replay`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

HERE = Path(__file__).parent
BENCH_MODEL = (
    HERE / "bench_model_cpu.json"
)  # gradwire/bench/train.py's model, profiled on this project's 2-core machine
GPT_MEDIUM = HERE / "gpt2_medium_100tflops.json"  # benchmarks/large_worker.py's model, by arithmetic


def load(path: str | Path = BENCH_MODEL) -> dict:
    """A profile: {"device", "model", "batch", "layers": [{"layer", "elements", "forward_s", "backward_s"}, ...]}."""
    with open(path) as f:
        return json.load(f)


def layers(profile: dict, compute_scale: float = 1.0) -> list:
    """A profile's layers as the step-time model takes them (gradwire/predict.py): float32 gradients, the compute
    times divided by `compute_scale` (a faster device)."""
    from gradwire.predict import Layer

    return [
        Layer(4 * sum(la["elements"]), la["forward_s"] / compute_scale, la["backward_s"] / compute_scale)
        for la in profile["layers"]
    ]


def replay_model(table: list[dict]):
    """A torch module that replays `table`'s layers: their parameters' sizes, their forward and backward times."""
    import torch

    class Replayed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, forward_s: float, backward_s: float, *params):  # noqa: ANN001
            ctx.backward_s = backward_s
            ctx.shapes = [p.shape for p in params]
            time.sleep(forward_s)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001
            time.sleep(ctx.backward_s)
            return (grad, None, None, *(torch.full(s, 1e-3) for s in ctx.shapes))

    class ReplayModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = table
            self.params = torch.nn.ParameterList(
                torch.nn.Parameter(torch.zeros(n)) for layer in table for n in layer["elements"]
            )

        def forward(self, x):  # noqa: ANN001
            params = iter(self.params)
            for layer in self.layers:
                own = [next(params) for _ in layer["elements"]]
                x = Replayed.apply(x, layer["forward_s"], layer["backward_s"], *own)
            return x

    return ReplayModel()
