"""Broadcasts built on push_pull: every rank but the root contributes zeros, so the sum is the root's value.

Exact for every dtype (adding zeros changes no bit; -0.0 + 0.0 is the one exception, and it compares equal).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from typing import Any

import numpy as np

import gradwire
import torch
from gradwire.worker import Worker

from .ops import push_pull_async

# dtypes that travel as they are; others are widened for the trip and cast back
_WIDEN = {torch.bool: torch.int32, torch.uint8: torch.int32, torch.int8: torch.int32, torch.int16: torch.int32}


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str, worker: Worker | None = None) -> torch.Tensor:
    """Overwrite `tensor` with the root's value, in place."""
    worker = worker or gradwire.current_worker()
    with torch.no_grad():
        widen = _WIDEN.get(tensor.dtype)
        in_place = widen is None and tensor.is_contiguous() and tensor.device.type == "cpu"
        travel = tensor.detach() if in_place else tensor.detach().to(widen or tensor.dtype).contiguous().cpu()
        if worker.rank != root_rank:
            travel.zero_()
        push_pull_async(travel, average=False, name=f"broadcast.{name}", worker=worker).result(worker)
        if not in_place:
            tensor.copy_(travel.to(tensor.dtype))
    return tensor


def broadcast_parameters(params: Any, root_rank: int, worker: Worker | None = None) -> None:
    """Make every rank's parameters equal to the root's: `model.state_dict()` or `named_parameters()`."""
    items: Iterable[tuple[str, Any]] = params.items() if isinstance(params, dict) else params
    pairs = list(items)
    worker = worker or gradwire.current_worker()
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise gradwire.TensorError("broadcast_parameters got duplicate names")
    for name, p in sorted(pairs, key=lambda kv: kv[0]):
        if isinstance(p, torch.Tensor):
            broadcast_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank, f"param.{name}", worker)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, worker: Worker | None = None) -> Any:
    """Return the root's `obj` on every rank (pickled; tensors inside travel with it)."""
    worker = worker or gradwire.current_worker()
    name = name or "object"
    payload = _dumps(obj) if worker.rank == root_rank else b""
    length = np.array([len(payload)], np.int64)
    if worker.rank != root_rank:
        length[0] = 0
    length = worker.push_pull(length, f"broadcast_object.{name}.length")
    size = int(length[0])
    buf = np.zeros(-(-size // 4), np.int32)  # int32 words: exact under addition with zeros
    if worker.rank == root_rank:
        buf.view(np.uint8)[:size] = np.frombuffer(payload, np.uint8)
    # a fresh name per size: declarations are fixed-shape
    out = worker.push_pull(buf, f"broadcast_object.{name}.{size}")
    return obj if worker.rank == root_rank else _loads(out.view(np.uint8)[:size].tobytes())


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, worker: Worker | None = None) -> None:
    """Give every rank the root's optimizer state (momentum buffers, Adam's moments, step counts, hyperparameters)."""
    state = broadcast_object(optimizer.state_dict(), root_rank, name="optimizer_state", worker=worker)
    optimizer.load_state_dict(state)


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    # the bytes come from the job's root rank over authenticated connections
    return torch.load(io.BytesIO(data), weights_only=False)
