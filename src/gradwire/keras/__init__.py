"""gradwire for Keras 3 on any backend (TensorFlow, JAX, PyTorch), in Horovod's Keras shape.

    import gradwire.keras as gw                        # was: import horovod.tensorflow.keras as hvd
    gw.init()
    opt = gw.DistributedOptimizer(keras.optimizers.Adam(0.001 * gw.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, callbacks=[
        gw.callbacks.BroadcastGlobalVariablesCallback(0),     # every worker starts from rank 0's variables
        gw.callbacks.MetricAverageCallback(),                 # logs averaged over the workers
        gw.callbacks.LearningRateWarmupCallback(initial_lr=0.001 * gw.size(), warmup_epochs=3),
    ], verbose=1 if gw.rank() == 0 else 0)

`gradwire.tensorflow.keras` is this module (Horovod's import path). docs/keras.md says what differs from Horovod.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from gradwire import collectives, grouped, init, is_initialized, local_rank, local_size, rank, shutdown, size
from gradwire.session import current_worker

from . import callbacks, elastic
from .compression import Compression
from .exchange import broadcast_variables as _broadcast_variables
from .exchange import to_numpy
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer

__all__ = [
    "Compression",
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "allgather",
    "allreduce",
    "broadcast",
    "broadcast_variables",
    "callbacks",
    "elastic",
    "init",
    "is_initialized",
    "load_model",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool = True,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: str | None = None,
    compression: Any = Compression.none,
) -> np.ndarray:
    """The average (or, with `average=False` or `op="sum"`, the sum) of `value` over all workers, as a numpy array
    (eagerly; for a step's gradients use DistributedOptimizer)."""
    average = average if op is None else op == "average"
    array = to_numpy(value) * prescale_factor
    name = name or f"keras.allreduce.{array.dtype.name}{list(array.shape)}"
    (out,) = grouped.exchange(current_worker(), [array], name, average=average)
    return out * postscale_factor if postscale_factor != 1.0 else out


def allgather(value: Any, name: str | None = None) -> np.ndarray:
    """Every worker's `value` concatenated along the first dimension, as a numpy array (eagerly)."""
    worker = current_worker()
    array = to_numpy(value)
    name = name or f"keras.allgather.{array.dtype.name}{list(array.shape[1:])}"
    return worker.synchronize(collectives.allgather_async(worker, array, name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> np.ndarray:
    """Worker `root_rank`'s `value` on every worker, as a numpy array (eagerly)."""
    array = to_numpy(value)
    name = name or f"keras.broadcast.{array.dtype.name}{list(array.shape)}"
    (out,) = grouped.exchange(current_worker(), [array], name, root=root_rank)
    return out


def broadcast_variables(variables: list, root_rank: int = 0, name: str = "keras.broadcast_variables") -> None:
    """Assign worker `root_rank`'s values to `variables` (Keras variables, e.g. `model.variables`) on every worker,
    in one exchange (eagerly)."""
    _broadcast_variables(variables, root_rank, name)


def load_model(
    filepath: Any, custom_optimizers: list | None = None, custom_objects: dict | None = None, compression: Any = None
) -> keras.Model:
    """`keras.models.load_model`, with the model's optimizer wrapped in DistributedOptimizer (Horovod's)."""
    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in custom_optimizers or []})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    if getattr(model, "optimizer", None) is not None:
        model.optimizer = DistributedOptimizer(model.optimizer, compression=compression or Compression.none)
    return model
