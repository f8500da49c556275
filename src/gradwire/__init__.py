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

import atexit

import numpy as np

from gradwire.config import Config
from gradwire.errors import (
    AuthenticationError,
    ConfigError,
    GradwireError,
    GradwireTimeout,
    JobAborted,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    TensorError,
)
from gradwire.worker import Handle, Worker

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "Config",
    "ConfigError",
    "GradwireError",
    "GradwireTimeout",
    "Handle",
    "JobAborted",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "TensorError",
    "Worker",
    "barrier",
    "declare",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "poll",
    "push_pull",
    "push_pull_async",
    "push_pull_inplace",
    "rank",
    "shutdown",
    "size",
    "synchronize",
]

_worker: Worker | None = None


def init(config: Config | None = None) -> None:
    """Join the job as a worker (blocks through rendezvous and the first barrier)."""
    global _worker
    if _worker is not None:
        return
    config = config or Config.from_env()
    if config.role != "worker":
        raise ConfigError(
            f"init() starts a worker, but GRADWIRE_ROLE={config.role}; run servers with `gradwire server`"
        )
    _worker = Worker(config).start()
    atexit.register(shutdown)


def shutdown() -> None:
    """Leave the job. Idempotent."""
    global _worker
    if _worker is not None:
        _worker.shutdown()
        _worker = None


def is_initialized() -> bool:
    """True between init() and shutdown()."""
    return _worker is not None


def _current() -> Worker:
    if _worker is None:
        raise ConfigError("gradwire is not initialized: call gradwire.init() first")
    return _worker


def rank() -> int:
    """This worker's rank in [0, size())."""
    return _current().rank


def size() -> int:
    """The number of workers."""
    return _current().size


def local_rank() -> int:
    """This worker's rank among the workers on its host."""
    return _current().local_rank


def local_size() -> int:
    """The number of workers on this host."""
    return _current().local_size


def declare(name: str, shape: tuple[int, ...], dtype: object) -> None:
    """Declare a tensor ahead of its first push_pull (optional; push_pull declares on first use)."""
    _current().declare(name, shape, dtype)


def push_pull(array: np.ndarray, name: str, average: bool = False, priority: int = 0) -> np.ndarray:
    """Sum (or average) `array` across all workers; returns a new array. Blocks."""
    return _current().push_pull(array, name, average, priority)


def push_pull_inplace(array: np.ndarray, name: str, average: bool = False, priority: int = 0) -> np.ndarray:
    """Sum (or average) `array` across all workers into itself. Blocks."""
    return _current().push_pull_inplace(array, name, average, priority)


def push_pull_async(
    array: np.ndarray, name: str, average: bool = False, priority: int = 0, out: np.ndarray | None = None
) -> Handle:
    """Start a push_pull; returns a handle for `poll` and `synchronize`. Higher priority leaves first."""
    return _current().push_pull_async(array, name, average, priority, out)


def poll(handle: Handle) -> bool:
    """True if the handle's result is ready (never blocks)."""
    return handle.done()


def synchronize(handle: Handle) -> np.ndarray:
    """Wait for a handle and return its output array."""
    return _current().synchronize(handle)


def barrier() -> None:
    """Block until every worker reaches the barrier."""
    _current().barrier()
