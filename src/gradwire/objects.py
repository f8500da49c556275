"""Horovod's `broadcast_object` and `allgather_object` for every adapter but torch's (which pickles tensors with
torch.save): any picklable Python object, as a numpy array of its bytes, eagerly."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from gradwire import collectives
from gradwire.session import current_worker


def broadcast_object(
    obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None, process_set: Any = None
) -> Any:
    """Worker `root_rank`'s `obj` (pickled), on every worker."""
    worker = current_worker()
    name = name or "broadcast_object"  # not by type: non-root workers often pass None
    members = _members(process_set)
    data = np.frombuffer(pickle.dumps(obj), np.uint8) if worker.rank == root_rank else np.zeros(0, np.uint8)
    length = np.array([data.size], np.int64)
    length = worker.synchronize(collectives.broadcast_async(worker, length, root_rank, f"{name}.len", members=members))
    buffer = data if worker.rank == root_rank else np.zeros(int(length[0]), np.uint8)
    buffer = worker.synchronize(collectives.broadcast_async(worker, buffer, root_rank, name, members=members))
    return obj if worker.rank == root_rank else pickle.loads(buffer.tobytes())


def allgather_object(obj: Any, session: Any = None, name: str | None = None, process_set: Any = None) -> list:
    """Every worker's `obj` (pickled), in rank order."""
    worker = current_worker()
    name = name or "allgather_object"
    members = _members(process_set)
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = worker.synchronize(
        collectives.allgather_async(worker, np.array([data.size], np.int64), f"{name}.len", members=members)
    )
    gathered = worker.synchronize(collectives.allgather_async(worker, data, name, members=members))
    bounds = np.cumsum([0, *sizes.tolist()])
    return [pickle.loads(gathered[a:b].tobytes()) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _members(process_set: Any) -> list[int] | None:
    ranks = getattr(process_set, "ranks", None)
    return None if ranks is None else list(ranks)
