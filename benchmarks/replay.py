"""Replay profiling (docs/scaling.md): a real model's layers timed once, written as a profile (gradwire/profiles/) that
the step-time model reads and `gradwire.profiles.replay_model` replays in a scaling benchmark (`python -m benchmarks
--netem --scale`).

`profile(net, batch)` times each layer with parameters, forward and backward, on this process's device (the layers
without parameters, an activation or a pool, count toward the layer before them); `flops_profile` writes one by
arithmetic for a device this machine does not have.

    python -m benchmarks.replay bench    # gradwire/bench/train.py's model, timed here (profiles.BENCH_MODEL)
    python -m benchmarks.replay gpt      # the GPT-2-medium-sized model at 100 TFLOP/s, by arithmetic (GPT_MEDIUM)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from gradwire import profiles


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


def write_profile(path: str | Path, net, batch, model: str, repeats: int = 20) -> dict:  # noqa: ANN001
    """Profile `net` on `batch` on this process's CPU (one thread) and write the table (`python -m
    benchmarks.replay bench` does it for gradwire/bench/train.py's model)."""
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
    """`flops_profile` of `python -m benchmarks --large`'s GPT-2-medium-sized model (benchmarks/large_worker.py)."""
    import torch
    from benchmarks.large_worker import GPT

    with torch.device("meta"):
        net = GPT()
    out = {
        "device": f"by arithmetic: a device sustaining {flops_per_s / 1e12:g} TFLOP/s, {tokens} tokens per worker",
        "model": "GPT-2-medium-sized transformer (benchmarks/large_worker.py)",
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


def write_bench_profile() -> dict:
    """gradwire/bench/train.py's model (`--train`'s), profiled on this machine's CPU, one thread."""
    import torch
    from gradwire.bench.train import BATCH, model

    torch.manual_seed(0)
    net, batch = model(), torch.randn(BATCH, 3, 32, 32)
    return write_profile(profiles.BENCH_MODEL, net, batch, "bench/train.py's model (conv stack, then an MLP)")


if __name__ == "__main__":
    which = sys.argv[1:] or ["gpt"]
    if which not in (["bench"], ["gpt"]):
        sys.exit("usage: python -m benchmarks.replay {bench|gpt}")
    summary(write_bench_profile() if which == ["bench"] else write_gpt_profile(profiles.GPT_MEDIUM))
