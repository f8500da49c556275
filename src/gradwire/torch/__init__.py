"""gradwire for PyTorch, in Horovod's and BytePS's shapes: changing the import is the migration.

    import gradwire.torch as gw                       # was: import horovod.torch as hvd (or byteps.torch as bps)
    gw.init()
    optimizer = gw.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    gw.broadcast_parameters(model.state_dict(), root_rank=0)
    gw.broadcast_optimizer_state(optimizer, root_rank=0)
    loss = gw.allreduce(loss)                         # Horovod; BytePS: gw.push_pull(loss, name="loss")

Or keep DDP and swap its all-reduce: `model.register_comm_hook(gw.PushPullHookState(model), gw.push_pull_hook)`;
or use BytePS's module wrapper, `gradwire.torch.parallel.DistributedDataParallel`.
"""

from __future__ import annotations

from typing import Any

import gradwire
from gradwire import barrier, is_initialized, local_rank, local_size, rank, shutdown, size
from gradwire.config import Config

from . import cross_barrier, elastic, parallel
from .broadcast import broadcast_, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .collectives import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    declare,
    poll,
    push_pull,
    push_pull_async,
    push_pull_async_inplace,
    push_pull_inplace,
    synchronize,
)
from .compression import Compression
from .hook import PushPullHookState, push_pull_hook
from .optimizer import DistributedOptimizer

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Max",
    "Min",
    "Product",
    "PushPullHookState",
    "Sum",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "cross_barrier",
    "declare",
    "elastic",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "parallel",
    "poll",
    "push_pull",
    "push_pull_async",
    "push_pull_async_inplace",
    "push_pull_hook",
    "push_pull_inplace",
    "rank",
    "shutdown",
    "size",
    "synchronize",
]


def init(config: Config | None = None, lazy: bool = True, comm: Any = None, process_sets: Any = None) -> None:
    """Join the job as a worker (Horovod's and BytePS's `init`). Blocks through the rendezvous.

    `lazy` (BytePS) is accepted either way: gradwire's workers connect at init and declare tensors on first use.
    `comm` (an MPI communicator) and `process_sets` are Horovod's; gradwire runs over all workers of its job.
    """
    if comm is not None:
        raise ValueError("gradwire does not run over MPI: init(comm=...) is not supported; start with gradwire launch")
    if process_sets not in (None, []):
        raise ValueError("gradwire runs every collective over all workers: process_sets are not supported")
    gradwire.init(config)
