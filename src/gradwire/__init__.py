"""gradwire: gradient aggregation through pipelined CPU summation servers.

The numpy API, in the shape of Horovod's and BytePS's::

    import gradwire as gw
    gw.init()                                    # reads GRADWIRE_* / DMLC_* / torchrun variables
    total = gw.push_pull(grad, name="layer1.weight")
    mean = gw.push_pull(grad, name="layer1.weight", average=True)
    h = gw.push_pull_async(grad, name="b"); ...; out = gw.synchronize(h)
    gw.shutdown()

The module functions act on one default `Worker` made by `init()`; tests and embedders can make their
own `Worker` objects instead (see `gradwire.testing.LocalCluster`).
"""

from __future__ import annotations

import numpy as np

from gradwire import collectives
from gradwire import compression as _compression
from gradwire._version import VERSION
from gradwire.config import Config
from gradwire.errors import (
    AuthenticationError,
    ConfigError,
    GradwireError,
    GradwireTimeout,
    JobAborted,
    LocalProtocolError,
    MembershipChanged,
    NotSupported,
    ProtocolError,
    RemoteProtocolError,
    TensorError,
    TensorMismatch,
    WorkerLost,
    WorkersJoining,
)
from gradwire.local_job import run
from gradwire.parameters import init_parameter, optimizer_state, set_optimizer, update, update_async
from gradwire.session import current_worker, init, is_initialized, shutdown, use_worker
from gradwire.worker import Handle, Worker

__version__ = VERSION

__all__ = [
    "AuthenticationError",
    "Config",
    "ConfigError",
    "GradwireError",
    "GradwireTimeout",
    "Handle",
    "JobAborted",
    "LocalProtocolError",
    "MembershipChanged",
    "NotSupported",
    "ProtocolError",
    "RemoteProtocolError",
    "TensorError",
    "TensorMismatch",
    "Worker",
    "WorkerLost",
    "WorkersJoining",
    "allgather",
    "alltoall",
    "barrier",
    "broadcast",
    "current_worker",
    "declare",
    "init",
    "init_parameter",
    "is_initialized",
    "local_rank",
    "local_size",
    "optimizer_state",
    "poll",
    "push_pull",
    "push_pull_async",
    "push_pull_inplace",
    "rank",
    "reducescatter",
    "run",
    "set_optimizer",
    "shutdown",
    "size",
    "synchronize",
    "update",
    "update_async",
    "use_worker",
]


def rank() -> int:
    """This worker's rank in [0, size())."""
    return current_worker().rank


def size() -> int:
    """The number of workers."""
    return current_worker().size


def local_rank() -> int:
    """This worker's rank among the workers on its host."""
    return current_worker().local_rank


def local_size() -> int:
    """The number of workers on this host."""
    return current_worker().local_size


def declare(name: str, shape: tuple[int, ...], dtype: object) -> None:
    """Declare a tensor ahead of its first push_pull (optional; push_pull declares on first use)."""
    current_worker().declare(name, shape, dtype)


def push_pull(
    array: np.ndarray, name: str, average: bool = False, priority: int = 0, op: str = "sum", compression: object = None
) -> np.ndarray:
    """Sum (or average) `array` across all workers; returns a new array. Blocks. `op`: "sum", "min", "max" or
    "product". `compression`: a compressor of gradwire.compression (or BytePS's dict), docs/compression.md."""
    return current_worker().push_pull(array, name, average, priority, op, _compression.args_of(compression))


def push_pull_inplace(
    array: np.ndarray, name: str, average: bool = False, priority: int = 0, compression: object = None
) -> np.ndarray:
    """Sum (or average) `array` across all workers into itself. Blocks."""
    return current_worker().push_pull_inplace(array, name, average, priority, _compression.args_of(compression))


def push_pull_async(
    array: np.ndarray,
    name: str,
    average: bool = False,
    priority: int = 0,
    out: np.ndarray | None = None,
    op: str = "sum",
    compression: object = None,
) -> Handle:
    """Start a push_pull; returns a handle for `poll` and `synchronize`. Higher priority leaves first."""
    args = _compression.args_of(compression)
    return current_worker().push_pull_async(array, name, average, priority, out, op=op, compression=args)


def allgather(array: np.ndarray, name: str) -> np.ndarray:
    """Every worker's `array` concatenated along the first dimension (which may differ by worker). Blocks."""
    worker = current_worker()
    return worker.synchronize(collectives.allgather_async(worker, array, name))


def broadcast(array: np.ndarray, root: int, name: str) -> np.ndarray:
    """The root worker's `array`, on every worker (a new array). Blocks."""
    worker = current_worker()
    return worker.synchronize(collectives.broadcast_async(worker, array, root, name))


def reducescatter(array: np.ndarray, name: str, average: bool = False, op: str = "sum") -> np.ndarray:
    """Reduce `array` over all workers; returns this worker's rows of the result (as Horovod splits them). Blocks."""
    worker = current_worker()
    return worker.synchronize(collectives.reducescatter_async(worker, array, name, average, op))


def alltoall(array: np.ndarray, name: str, splits: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Send `splits[j]` rows of `array` to worker j (equal splits when None); returns the rows received, in rank
    order, and how many came from each worker. Blocks."""
    worker = current_worker()
    handle, received = collectives.alltoall_async(worker, array, splits, name)
    return worker.synchronize(handle), received


def poll(handle: Handle) -> bool:
    """True if the handle's result is ready (never blocks)."""
    return handle.done()


def synchronize(handle: Handle) -> np.ndarray:
    """Wait for a handle and return its output array."""
    return current_worker().synchronize(handle)


def barrier() -> None:
    """Block until every worker reaches the barrier."""
    current_worker().barrier()
