"""Horovod's `broadcast_object` and `allgather_object`: any picklable Python object, eagerly."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

import gradwire
from gradwire import collectives

from .bridge import members_of, name_of


def broadcast_object(
    obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None, process_set: Any = None
) -> Any:
    """Worker `root_rank`'s `obj` (pickled), on every worker."""
    worker = gradwire.current_worker()
    name = name_of(worker, name, "broadcast_object")
    members = members_of(process_set)
    data = np.frombuffer(pickle.dumps(obj), np.uint8) if worker.rank == root_rank else np.zeros(0, np.uint8)
    length = np.array([data.size], np.int64)
    length = worker.synchronize(collectives.broadcast_async(worker, length, root_rank, f"{name}.len", members=members))
    buffer = data if worker.rank == root_rank else np.zeros(int(length[0]), np.uint8)
    buffer = worker.synchronize(collectives.broadcast_async(worker, buffer, root_rank, name, members=members))
    return obj if worker.rank == root_rank else pickle.loads(buffer.tobytes())


def allgather_object(obj: Any, session: Any = None, name: str | None = None, process_set: Any = None) -> list:
    """Every worker's `obj` (pickled), in rank order."""
    worker = gradwire.current_worker()
    name = name_of(worker, name, "allgather_object")
    members = members_of(process_set)
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = worker.synchronize(
        collectives.allgather_async(worker, np.array([data.size], np.int64), f"{name}.len", members=members)
    )
    gathered = worker.synchronize(collectives.allgather_async(worker, data, name, members=members))
    bounds = np.cumsum([0, *sizes.tolist()])
    return [pickle.loads(gathered[a:b].tobytes()) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
