"""Horovod's allgather_object and broadcast_object: any picklable object (tensors inside travel with it), carried as a
tensor of its bytes over allgather and broadcast.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np

import torch
from gradwire.session import current_worker

from .exchange import allgather, broadcast, broadcast_


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list:
    """Every rank's picklable `obj`, in rank order."""
    name = name or type(obj).__name__
    payload = torch.from_numpy(np.frombuffer(_dumps(obj), np.uint8).copy())
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = allgather(length, f"allgather_object.{name}.sizes", process_set)
    data = allgather(payload, f"allgather_object.{name}", process_set).numpy()
    out, start = [], 0
    for size in sizes.tolist():
        out.append(_loads(data[start : start + size].tobytes()))
        start += size
    return out


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None) -> Any:
    """The root's picklable `obj` on every rank (tensors inside travel with it)."""
    name = name or type(obj).__name__
    payload = _dumps(obj) if current_worker().rank == root_rank else b""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    size = broadcast(length, root_rank, f"broadcast_object.{name}.size", process_set)
    data = torch.zeros(int(size[0]), dtype=torch.uint8)
    if current_worker().rank == root_rank:
        data.numpy()[:] = np.frombuffer(payload, np.uint8)
    data = broadcast_(data, root_rank, f"broadcast_object.{name}", process_set)
    return obj if current_worker().rank == root_rank else _loads(data.numpy().tobytes())


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    # the bytes come from the job's ranks over authenticated connections
    return torch.load(io.BytesIO(data), weights_only=False)
