"""gradwire for PyTorch, in Horovod's and BytePS's shapes: changing the import is the migration.

    import gradwire.torch as gw                       # was: import horovod.torch as hvd (or byteps.torch as bps)
    gw.init()
    optimizer = gw.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    gw.broadcast_parameters(model.state_dict(), root_rank=0)
    gw.broadcast_optimizer_state(optimizer, root_rank=0)
    loss = gw.allreduce(loss)                         # Horovod; BytePS: gw.push_pull(loss, name="loss")

Or keep DDP and swap its all-reduce: `ddp.register_comm_hook(gw.PushPullHookState(ddp), gw.push_pull_hook)`;
or use BytePS's module wrapper, `gradwire.torch.parallel.DistributedDataParallel`.
"""

from __future__ import annotations

from typing import Any

import gradwire
from gradwire import is_initialized, local_rank, local_size, rank, shutdown, size
from gradwire.collectives import Adasum, Average, Max, Min, Product, Sum
from gradwire.config import Config
from gradwire.introspection import (
    HorovodInternalError,
    ProcessSet,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    join,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    remove_process_set,
    rocm_built,
    start_timeline,
    stop_timeline,
)
from gradwire.session import current_worker

from . import cross_barrier, elastic, parallel
from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .collectives import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    declare,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    poll,
    push_pull,
    push_pull_async,
    push_pull_async_inplace,
    push_pull_inplace,
    synchronize,
)
from .compression import Compression
from .delay_compensation import dc_adam_, delay_compensation_
from .exchange import (
    allgather,
    allgather_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    sparse_allreduce_async,
)
from .hook import PushPullHookState, push_pull_hook
from .objects import allgather_object, broadcast_object
from .optimizer import DistributedOptimizer
from .scatter import (
    alltoall,
    alltoall_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from .server_optimizer import ServerOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "ServerOptimizer",
    "HorovodInternalError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "PushPullHookState",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_barrier",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "dc_adam_",
    "declare",
    "delay_compensation_",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "parallel",
    "poll",
    "push_pull",
    "push_pull_async",
    "push_pull_async_inplace",
    "push_pull_hook",
    "push_pull_inplace",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]


def barrier(process_set: Any = None) -> None:
    """Block until every worker (or every rank of `process_set`) has entered the barrier."""
    if process_set is None or getattr(process_set, "ranks", None) is None:
        current_worker().barrier()
        return
    import torch

    # a round of a one-element sum among the set's ranks completes only once every one of them has pushed it
    allreduce(torch.zeros(1), name="barrier", op=Sum, process_set=process_set)


def init(config: Config | None = None, lazy: bool = True, comm: Any = None, process_sets: Any = None) -> None:
    """Join the job as a worker (Horovod's and BytePS's `init`). Blocks through the rendezvous.

    `lazy` (BytePS) is accepted either way: gradwire's workers connect at init and declare tensors on first use.
    `comm` (an MPI communicator) is Horovod's: gradwire does not run over MPI. `process_sets` are registered as
    with `add_process_set`.
    """
    if comm is not None:
        raise ValueError("gradwire does not run over MPI: init(comm=...) is not supported; start with gradwire launch")
    gradwire.init(config)
    for ps in process_sets or []:
        add_process_set(ps)


# BytePS's scripts use `byteps.torch.cross_barrier` in place of the whole API: that module offers every name of this
# one (set from here, so that it imports nothing of this package's)
cross_barrier.__dict__.update({name: globals()[name] for name in __all__ if name not in vars(cross_barrier)})
