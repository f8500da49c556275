"""A list of Keras values (tensors of whichever backend Keras runs on) through the servers.

Each backend keeps its own way of leaving its compiled step: TensorFlow's a stateful `tf.numpy_function`
(gradwire.tensorflow), JAX's an ordered `io_callback` (gradwire.jax), PyTorch's none (its steps run eagerly). Either
way the values are fused, one buffer per dtype (gradwire/grouped.py), and a name is fixed by the values' shapes and
dtypes, so a step's gradients reuse the same keys every step.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

import gradwire
from gradwire import grouped
from gradwire.session import current_worker


def to_numpy(value: Any) -> np.ndarray:
    """A Keras variable's or a backend tensor's value as a numpy array (eagerly), the backend's own way: numpy 2
    warns where Keras's `convert_to_numpy` goes through an `__array__` without its `copy` keyword."""
    value = getattr(value, "value", value)  # a Keras variable: its backend tensor
    if hasattr(value, "detach"):  # torch
        return value.detach().cpu().numpy()
    if hasattr(value, "numpy"):  # tensorflow
        return np.asarray(value.numpy())
    return np.asarray(value)  # jax, numpy, Python numbers


def signature(values: list[Any]) -> str:
    """The group's name for the values' dtypes and shapes (gradwire/grouped.py)."""
    return grouped.signature([(keras.backend.standardize_dtype(v.dtype), list(v.shape)) for v in values])


def reduce_values(values: list[Any], name: str, average: bool = True, members: list[int] | None = None) -> list[Any]:
    """The sum (or average) of each value over the workers (or `members`), as values of the same backend."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from gradwire.tensorflow.collectives import Average, Sum, reduce_group

        return reduce_group(values, Average if average else Sum, 1.0, 1.0, name, members)
    if backend == "jax":
        import gradwire.jax as gradwire_jax

        if members is not None:
            raise gradwire.NotSupported("process sets are not supported with Keras on JAX; use the global set")
        return list(gradwire_jax.allreduce(list(values), average=average, name=name))
    arrays = [to_numpy(v) for v in values]
    out = grouped.exchange(current_worker(), arrays, name, average=average, members=members)
    return [keras.ops.convert_to_tensor(a) for a in out]


def broadcast_variables(variables: list[Any], root_rank: int, name: str) -> None:
    """Assign worker `root_rank`'s values to `variables` (Keras variables) on every worker, eagerly, in one exchange."""
    variables = list(variables)
    if not variables:
        return
    arrays = [to_numpy(v) for v in variables]
    values = grouped.exchange(current_worker(), arrays, f"{name}.{signature(variables)}", root=root_rank)
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value)
