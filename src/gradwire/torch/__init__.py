"""gradwire for PyTorch, in Horovod's and BytePS's shapes: changing the import is the migration.

    import gradwire.torch as gw                       # was: import horovod.torch as hvd
    gw.init()
    optimizer = gw.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    gw.broadcast_parameters(model.state_dict(), root_rank=0)
    gw.broadcast_optimizer_state(optimizer, root_rank=0)

Or keep DDP and swap its all-reduce: `model.register_comm_hook(gw.PushPullHookState(model), gw.push_pull_hook)`.
"""

from __future__ import annotations

import gradwire
import torch
from gradwire import barrier, init, is_initialized, local_rank, local_size, rank, shutdown, size

from . import elastic
from .broadcast import broadcast_, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .compression import Compression
from .hook import PushPullHookState, push_pull_hook
from .ops import TorchHandle
from .ops import push_pull_async as _push_pull_async
from .optimizer import Average, DistributedOptimizer, Sum

__all__ = [
    "Average",
    "Compression",
    "DistributedOptimizer",
    "PushPullHookState",
    "Sum",
    "barrier",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "elastic",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "poll",
    "push_pull",
    "push_pull_async",
    "push_pull_hook",
    "rank",
    "shutdown",
    "size",
    "synchronize",
]


def push_pull_async(
    tensor: torch.Tensor,
    average: bool = True,
    name: str | None = None,
    priority: int = 0,
    compression: type = Compression.none,
) -> TorchHandle:
    """Start averaging (or summing) `tensor` over all workers, in place; returns a handle."""
    return _push_pull_async(tensor, average, name, priority, compression)


def poll(handle: TorchHandle) -> bool:
    """True once the handle's result is ready (never blocks)."""
    return handle.done()


def synchronize(handle: TorchHandle) -> torch.Tensor:
    """Wait for a handle; returns the tensor, which now holds the result."""
    return handle.result(gradwire.current_worker())


def push_pull(
    tensor: torch.Tensor,
    average: bool = True,
    name: str | None = None,
    priority: int = 0,
    compression: type = Compression.none,
) -> torch.Tensor:
    """Average (or sum) `tensor` over all workers, in place (blocking); returns it."""
    return synchronize(push_pull_async(tensor, average, name, priority, compression))
