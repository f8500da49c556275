"""gradwire for TensorFlow 2, in Horovod's shape: changing the import is the migration.

    import gradwire.tensorflow as gw                   # was: import horovod.tensorflow as hvd
    gw.init()

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss_value = loss(labels, model(images, training=True))
        tape = gw.DistributedGradientTape(tape)        # gradients averaged over the workers
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:                                # every worker starts from rank 0's variables
            gw.broadcast_variables(model.variables, root_rank=0)
            gw.broadcast_variables(opt.variables, root_rank=0)
        return loss_value

Eagerly and inside `tf.function` (not under XLA: tensorflow/bridge.py). Keras: `gradwire.keras` (also importable as
`gradwire.tensorflow.keras`, Horovod's path). docs/tensorflow.md says what differs from Horovod.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

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
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    remove_process_set,
    rocm_built,
    start_timeline,
    stop_timeline,
)
from gradwire.objects import allgather_object, broadcast_object
from gradwire.session import current_worker

from . import elastic, util
from .collectives import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    broadcast_,
    broadcast_global_variables,
    broadcast_variables,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from .compression import Compression
from .sync_batch_norm import SyncBatchNormalization
from .tape import DistributedGradientTape, PartialDistributedGradientTape

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedGradientTape",
    "HorovodInternalError",
    "Max",
    "Min",
    "PartialDistributedGradientTape",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNormalization",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_variables",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_rank_op",
    "local_size",
    "local_size_op",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "rank_op",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "size_op",
    "start_timeline",
    "stop_timeline",
    "util",
]


# Horovod's private helper, which its own tests and some scripts call as `hvd._executing_eagerly()`
_executing_eagerly = tf.executing_eagerly


def init(config: Config | None = None, comm: Any = None, process_sets: Any = None) -> None:
    """Join the job as a worker (Horovod's `init`). Blocks through the rendezvous. `comm` (an MPI communicator) is
    not supported: gradwire does not run over MPI. `process_sets` are registered as with `add_process_set`."""
    if comm is not None:
        raise ValueError("gradwire does not run over MPI: init(comm=...) is not supported; start with gradwire launch")
    gradwire.init(config)
    for ps in process_sets or []:
        add_process_set(ps)


def join() -> tf.Tensor:
    """Horovod's join: this rank is out of data; the others' allreduces go on with zeros in its place. Blocks until
    every rank has joined; returns the last rank to join (eagerly)."""
    return tf.constant(current_worker().join(), tf.int32)


def barrier(process_set: Any = global_process_set) -> None:
    """Block until every worker (or every rank of `process_set`) has entered the barrier (eagerly)."""
    if getattr(process_set, "ranks", None) is None:
        current_worker().barrier()
        return
    # a round of a one-element sum among the set's ranks completes only once every one of them has pushed it
    allreduce(tf.zeros([1]), name="barrier", op=Sum, process_set=process_set)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of workers, as a tensor."""
    return tf.constant(size(), tf.int32)


def local_size_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(local_size(), tf.int32)


def rank_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(rank(), tf.int32)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(local_rank(), tf.int32)
