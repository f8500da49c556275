"""Horovod's helpers that bring every rank to the root's state: parameters, optimizer state, any object. They are
broadcasts on the servers (gradwire/collectives.py: only the root pushes; every rank pulls)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import gradwire
import torch

from .exchange import broadcast_
from .objects import broadcast_object


def broadcast_parameters(params: Any, root_rank: int, process_set: Any = None) -> None:
    """Make every rank's parameters equal to the root's: `model.state_dict()` or `named_parameters()`."""
    items: Iterable[tuple[str, Any]] = params.items() if isinstance(params, dict) else params
    pairs = list(items)
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise gradwire.TensorError("broadcast_parameters got duplicate names")
    for name, p in sorted(pairs, key=lambda kv: kv[0]):
        if isinstance(p, torch.Tensor):
            broadcast_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank, f"param.{name}")


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None, process_set: Any = None
) -> None:
    """Give every rank the root's optimizer state (momentum buffers, Adam's moments, step counts, hyperparameters).

    As Horovod's: a new optimizer's state is first made by one step with zero gradients (so every parameter that
    requires a gradient gets a zero `.grad` and its state, on every rank), then the root's is sent (as one object).
    """
    from .optimizer import _DistributedOptimizer

    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state_dict()["state"]:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p.data)
        # the wrapped optimizer's own step: the distributed one would push gradients, which other callers may not
        if isinstance(optimizer, _DistributedOptimizer):
            super(_DistributedOptimizer, optimizer).step()  # type: ignore[misc]
        else:
            optimizer.step()
    state = broadcast_object(optimizer.state_dict(), root_rank, name="optimizer_state")
    optimizer.load_state_dict(state)


__all__ = ["broadcast_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]
