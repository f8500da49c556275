"""From TensorFlow to the worker and back: a host function on numpy arrays, run now or as a step of a graph.

Eagerly the function runs at once on the tensors' values. Inside `tf.function` it becomes a stateful
`tf.numpy_function`: TensorFlow runs a function's stateful operations in program order, so every worker makes its
calls in the same order, once per call of the compiled function. The worker is the one current when the function is
traced (the graph may run the host function on another thread), and names are fixed then too. An unnamed call is
named, as Horovod names it, by its input's name in the graph (the same on every worker running the same program, however
often each one retraces: workers whose shapes differ retrace differently), or eagerly by a counter per kind of call.
XLA cannot run a Python function: under `jit_compile=True` TensorFlow refuses the graph (docs/tensorflow.md).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

import gradwire
from gradwire.session import current_worker
from gradwire.worker import Worker

_counters: weakref.WeakKeyDictionary[Worker, dict[str, itertools.count]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_last_call: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # graph -> its latest host call
_errors: weakref.WeakKeyDictionary[Worker, BaseException] = (
    weakref.WeakKeyDictionary()
)  # the last a graph's call raised


def name_of(worker: Worker, name: str | None, kind: str, tensor: Any = None) -> str:
    """`name`; for an unnamed call inside a graph its kind and `tensor`'s name there; eagerly its kind and how many
    such calls this worker made before it."""
    if name is not None:
        return name
    if tensor is not None and not tf.executing_eagerly() and getattr(tensor, "name", None):
        return f"tf.{kind}.{tensor.name.replace(':', '_')}"
    with _lock:
        counters = _counters.setdefault(worker, {})
        return f"tf.{kind}.noname.{next(counters.setdefault(kind, itertools.count()))}"


def members_of(process_set: Any) -> list[int] | None:
    """The ranks of a Horovod process set (None: every worker)."""
    ranks = getattr(process_set, "ranks", None)
    if ranks is not None and current_worker().rank not in ranks:
        raise ValueError(
            f"worker {current_worker().rank} called a collective of {process_set!r}, which it is not part of"
        )
    return None if ranks is None else list(ranks)


def host_call(fn: Callable[..., list[np.ndarray]], inputs: list[Any], touts: list[tf.DType]) -> list[tf.Tensor]:
    """`fn(*arrays)` -> arrays of the dtypes `touts`: run now (eagerly) or as a stateful op of the graph."""
    inputs = [tf.convert_to_tensor(x) for x in inputs]
    if tf.executing_eagerly():
        try:
            results = fn(*[x.numpy() for x in inputs])
        except gradwire.TensorMismatch as e:  # Horovod's types; gradwire's error is the cause
            raise tf.errors.FailedPreconditionError(None, None, str(e)) from e  # the workers called it differently
        except gradwire.TensorError as e:
            if isinstance(e, gradwire.NotSupported):
                raise
            raise tf.errors.InvalidArgumentError(None, None, str(e)) from e  # this worker's call is wrong
        return [tf.convert_to_tensor(r, dtype=t) for r, t in zip(results, touts, strict=True)]
    fn = _recording(fn, current_worker())
    if tf.inside_function():  # tf.function runs stateful operations in program order by itself
        return list(tf.numpy_function(fn, inputs, touts, stateful=True))
    # a TensorFlow 1 graph (a Session) runs independent operations in any order, in parallel: each call would block
    # an executor thread waiting for workers that run another one first. Chained, they run in program order.
    graph = tf.compat.v1.get_default_graph()
    last = _last_call.get(graph)
    with tf.control_dependencies([] if last is None else [last]):
        outs = list(tf.numpy_function(fn, inputs, touts, stateful=True))
    _last_call[graph] = outs[0].op
    return outs


def scaled(tensor: tf.Tensor, factor: float) -> tf.Tensor:
    """`tensor * factor` in its dtype, computed as Horovod scales: 16-bit floats in float32, integers in float64
    (truncated)."""
    if factor == 1.0:
        return tensor
    if tensor.dtype in (tf.float16, tf.bfloat16):
        return tf.cast(tf.cast(tensor, tf.float32) * tf.cast(factor, tf.float32), tensor.dtype)
    if tensor.dtype.is_floating or tensor.dtype.is_complex:
        return tensor * tf.cast(factor, tensor.dtype)
    return tf.cast(tf.cast(tensor, tf.float64) * factor, tensor.dtype)


_SIGNED = {np.dtype(np.uint16): np.int16, np.dtype(np.uint32): np.int32, np.dtype(np.uint64): np.int64}


def moved(fn: Callable[..., list[np.ndarray]]) -> Callable[..., list[np.ndarray]]:
    """`fn`, a collective that only moves bytes (a gather, a broadcast, an alltoall), taking unsigned integers the
    wire has no type for as the signed ones of their size (the same bits), and giving them back as they came."""

    def wrapped(array: np.ndarray, *rest: np.ndarray) -> list[np.ndarray]:
        signed = _SIGNED.get(array.dtype)
        if signed is None:
            return fn(array, *rest)
        out = fn(array.view(signed), *rest)
        return [out[0].view(array.dtype), *out[1:]]

    return wrapped


def _recording(fn: Callable[..., list[np.ndarray]], worker: Worker) -> Callable[..., list[np.ndarray]]:
    """`fn`, keeping what gradwire error it raises: TensorFlow hands a graph's caller only an OpError with its text."""

    def recorded(*arrays: np.ndarray) -> list[np.ndarray]:
        try:
            return fn(*arrays)
        except gradwire.GradwireError as e:
            _errors[worker] = e
            raise

    return recorded


def original_error(error: BaseException) -> BaseException:
    """The gradwire error behind `error`, a TensorFlow OpError a graph's host call raised (MembershipChanged, ...),
    else `error` itself."""
    if isinstance(error, tf.errors.OpError):
        worker = current_worker()
        return _errors.pop(worker, None) or error
    return error
