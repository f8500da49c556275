"""`horovod.tensorflow.util`'s helpers, so that code importing them from Horovod (Horovod's own TensorFlow test suite
does: `from horovod.tensorflow.util import _executing_eagerly`) runs with the import changed (docs/horovod.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here (not inside a tf.function or a TensorFlow 1 graph)."""
    return tf.executing_eagerly()


def _make_subgraph(f: Callable) -> Callable:
    """`f` as a TensorFlow graph function."""
    return tf.function(f)


def _cache(f: Callable) -> Callable:
    """`f` memoised on its (hashable) arguments, apart for eager and graph mode (a graph's tensors are not eager's)."""
    seen: dict[tuple, Any] = {}

    @functools.wraps(f)
    def cached(*args: Any) -> Any:
        key = (args, _executing_eagerly())
        if key not in seen:
            seen[key] = f(*args)
        return seen[key]

    return cached


def vars_to_refs(variables: Any) -> Any:
    """Variables (nested in lists) as their hashable references (`Variable.ref()`), lists as tuples."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return variables.ref()


def refs_to_vars(refs: Any) -> Any:
    """`vars_to_refs` undone."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
