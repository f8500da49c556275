"""Replayed compute (`gradwire bench --netem --scale`, docs/scaling.md): a real model's layers, profiled once, stand
in for the model in a scaling benchmark, so that two cores do not bound the curve.

`profile(net, batch)` times each layer with parameters, forward and backward, on this process's device (the layers
without parameters, an activation or a pool, count toward the layer before them). A
`ReplayModel` of that table has one parameter of each profiled size per layer, in the same order, and sleeps each
layer's measured time in its forward and its backward: its gradients become ready in backward order, each after its
layer's backward time, as the real model's do, with the same sizes, while the cores stay free (a sleep takes none)
for the data path. DDP's and gradwire's hooks fire on them as on any model.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

TABLES = Path(__file__).parent / "tables"
BENCH_MODEL = TABLES / "bench_model_cpu.json"  # bench/train.py's model, profiled on this project's 2-core machine
GPT_MEDIUM = TABLES / "gpt2_medium_100tflops.json"  # bench --large's model, by arithmetic (`write_gpt_profile`)


def profile(net, batch, repeats: int = 10) -> list[dict]:  # noqa: ANN001 - a torch module and its input
    """Per layer with parameters, in forward order: its name, its parameters' sizes (elements), and the median of
    `repeats` timings of its forward and its backward (seconds), layers without parameters folded into the one
    before."""
    import torch

    layers = [(name, m) for name, m in net.named_modules() if not list(m.children())]
    marks: dict[str, list[float]] = {}

    def stamp(key: str):
        return lambda *_: marks.setdefault(key, []).append(time.perf_counter())

    handles = []
    for name, m in layers:
        handles += [m.register_forward_pre_hook(stamp(f"f0 {name}")), m.register_forward_hook(stamp(f"f1 {name}"))]
        handles += [m.register_full_backward_pre_hook(stamp(f"b0 {name}"))]
        handles += [m.register_full_backward_hook(stamp(f"b1 {name}"))]
    batch = batch.requires_grad_(True)  # every layer's full backward hook fires, the first one's too
    for _ in range(repeats + 2):
        net.zero_grad()
        net(batch).square().mean().backward()
    for h in handles:
        h.remove()

    def median(key0: str, key1: str) -> float:
        spans = sorted(b - a for a, b in zip(marks[key0][2:], marks[key1][2:], strict=True))
        return spans[len(spans) // 2]

    table: list[dict] = []
    for name, m in layers:
        forward, backward = median(f"f0 {name}", f"f1 {name}"), median(f"b0 {name}", f"b1 {name}")
        params = [p.numel() for p in m.parameters(recurse=False) if p.requires_grad]
        if params or not table:
            table.append({"layer": name, "elements": params, "forward_s": 0.0, "backward_s": 0.0})
        # a layer without parameters counts toward the one before it: in backward it runs just before that one's,
        # whose gradients are then ready after both, as in the real model
        table[-1]["forward_s"] += forward
        table[-1]["backward_s"] += backward
    del torch
    return table


def layers(profile: dict, compute_scale: float = 1.0) -> list:
    """A profile's layers as the step-time model takes them (gradwire/predict.py): float32 gradients, the compute
    times divided by `compute_scale` (a faster device)."""
    from gradwire.predict import Layer

    return [
        Layer(4 * sum(la["elements"]), la["forward_s"] / compute_scale, la["backward_s"] / compute_scale)
        for la in profile["layers"]
    ]


def load(path: str | Path = BENCH_MODEL) -> dict:
    """A profile written by `write_profile`: {"device", "model", "batch", "layers": [...]}."""
    with open(path) as f:
        return json.load(f)


def write_profile(path: str | Path, net, batch, model: str, repeats: int = 20) -> dict:  # noqa: ANN001
    """Profile `net` on `batch` on this process's CPU (one thread) and write the table (`python -m
    gradwire.bench.train profile` does it for bench/train.py's model)."""
    import platform

    import torch

    torch.set_num_threads(1)
    table = profile(net, batch, repeats)
    out = {
        "device": f"CPU, 1 thread ({platform.processor() or platform.machine()}), torch {torch.__version__}",
        "model": model,
        "batch": len(batch),
        "layers": table,
    }
    _write(path, out)
    return out


def _write(path: str | Path, profile: dict) -> None:
    with open(path, "w") as f:
        json.dump(profile, f, indent=1)
        f.write("\n")


def flops_profile(net, tokens: int, flops_per_s: float) -> list[dict]:  # noqa: ANN001 - a torch module
    """A profile by arithmetic, for a device this machine does not have: per layer with parameters, forward
    2 x parameters x tokens FLOPs and backward twice that (the usual 6PT per step of a transformer; attention's
    score products left out), at `flops_per_s`. Build `net` on torch's meta device: no memory is taken."""
    table = []
    for name, m in net.named_modules():
        params = [p.numel() for p in m.parameters(recurse=False) if p.requires_grad]
        if params:
            forward = 2 * sum(params) * tokens / flops_per_s
            table.append({"layer": name, "elements": params, "forward_s": forward, "backward_s": 2 * forward})
    return table


def write_gpt_profile(path: str | Path, tokens: int = 8 * 1024, flops_per_s: float = 100e12) -> dict:
    """`flops_profile` of `gradwire bench --large`'s GPT-2-medium-sized model (bench/large_worker.py)."""
    import torch
    from gradwire.bench.large_worker import GPT

    with torch.device("meta"):
        net = GPT()
    out = {
        "device": f"by arithmetic: a device sustaining {flops_per_s / 1e12:g} TFLOP/s, {tokens} tokens per worker",
        "model": "GPT-2-medium-sized transformer (bench/large_worker.py)",
        "batch": tokens // 1024,
        "layers": flops_profile(net, tokens, flops_per_s),
    }
    _write(path, out)
    return out


def summary(profile: dict) -> None:
    layers = profile["layers"]
    total = sum(sum(layer["elements"]) for layer in layers)
    forward, backward = sum(la["forward_s"] for la in layers), sum(la["backward_s"] for la in layers)
    print(f"{len(layers)} layers, {total:,} parameters, forward {forward * 1e3:.1f} ms, backward {backward * 1e3:.1f}")


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


if __name__ == "__main__":  # python -m gradwire.bench.replay: write the GPT-2-medium profile by arithmetic
    summary(write_gpt_profile(GPT_MEDIUM))
