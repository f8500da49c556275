"""Horovod's `DistributedGradientTape`: a `tf.GradientTape` whose `gradient` returns the gradients averaged over the
workers.

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = gw.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)     # the average over the workers

The wrapped tape is the same tape (its state is shared, not copied), of a subclass of its own class, so it is used
exactly as before. A step's dense gradients travel in one grouped allreduce (one fused buffer per dtype, named by the
gradients' shapes and dtypes, so every step reuses the same keys); sparse ones (`tf.IndexedSlices`, an embedding's)
are allgathered unless `sparse_as_dense`. Communication starts once backward has produced every gradient: TensorFlow
computes a tape's gradients in one call, so nothing overlaps backward (docs/tensorflow.md).
"""

from __future__ import annotations

import warnings
from typing import Any

import tensorflow as tf

from gradwire.introspection import global_process_set
from gradwire.keras.optimizer import local_layers_of
from gradwire.session import current_worker

from .collectives import Average, Sum, _signature, allreduce, grouped_allreduce
from .compression import Compression


class _DistributedGradientTape:
    """The methods a tape's subclass gets (mixed in by `DistributedGradientTape`)."""

    _gw: dict

    def register_local_source(self, source: Any) -> None:
        """Keep `source`'s gradient on this worker: never reduced, divided by the number of workers where
        `scale_local_gradients` (Horovod's rule: a local layer then learns at the rate the reduced ones do)."""
        self._gw["local"].add(id(source))

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, **kwargs: Any) -> Any:
        grads = super().gradient(target, sources, output_gradients, **kwargs)  # type: ignore[misc]
        flat = tf.nest.flatten(grads)
        local = self._gw["local"]
        if not local:
            return tf.nest.pack_sequence_as(grads, self._gw_reduce(flat))
        mine = [id(s) in local for s in tf.nest.flatten(sources)]
        reduced = iter(self._gw_reduce([g for g, m in zip(flat, mine, strict=True) if not m]))
        scale = 1.0 / _size(self._gw["process_set"]) if self._gw["scale_local"] else 1.0
        out = [_scaled(g, scale) if m else next(reduced) for g, m in zip(flat, mine, strict=True)]
        return tf.nest.pack_sequence_as(grads, out)

    def get_local_and_global_gradients(
        self, target: Any, sources: Any, output_gradients: Any = None, **kwargs: Any
    ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """`gradient`'s (source, gradient) pairs, those of the local sources apart from the reduced ones."""
        sources = tf.nest.flatten(sources)
        grads = tf.nest.flatten(self.gradient(target, sources, output_gradients, **kwargs))
        pairs = list(zip(sources, grads, strict=True))
        local = self._gw["local"]
        return [p for p in pairs if id(p[0]) in local], [p for p in pairs if id(p[0]) not in local]

    def _gw_reduce(self, grads: list[Any]) -> list[Any]:
        o = self._gw
        if current_worker().size == 1 and o["process_set"].ranks is None:
            return grads
        if o["sparse_as_dense"]:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        op, pre, post = o["op"], 1.0, 1.0
        if o["predivide"] != 1.0:  # Horovod's split of the average: 1/f before the sum, f/n after
            op, pre, post = Sum, 1.0 / o["predivide"], o["predivide"] / _size(o["process_set"])
        dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
        out = list(grads)
        if dense:
            group = [grads[i] for i in dense]
            name = "tf.DistributedGradientTape." + _signature(group)
            summed = grouped_allreduce(group, None, "", "", o["compression"], op, pre, post, o["process_set"], name)
            for i, g in zip(dense, summed, strict=True):
                out[i] = g
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                out[i] = allreduce(g, None, "", "", o["compression"], o["op"], process_set=o["process_set"])
        return out


def _scaled(grad: Any, scale: float) -> Any:
    if grad is None or scale == 1.0:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * scale, grad.indices, grad.dense_shape)
    return grad * scale


def _size(process_set: Any) -> int:
    return current_worker().size if process_set.ranks is None else len(process_set.ranks)


def DistributedGradientTape(  # noqa: N802 - Horovod's name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: str = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = global_process_set,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """`gradtape`, whose `gradient` returns gradients averaged (or `op`) over the workers, but for the sources given
    to `register_local_source` (scaled by 1/workers if `scale_local_gradients`). `device_*` and `groups` are accepted
    for Horovod's signature: a step's gradients always travel as one group."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op not in (Average, Sum):
        raise ValueError(f"DistributedGradientTape reduces gradients by Average or Sum, not {op!r}")
    if num_groups:
        warnings.warn("num_groups has been replaced by groups", DeprecationWarning, stacklevel=2)
    cls = type(type(gradtape).__name__, (_DistributedGradientTape, type(gradtape)), {})
    tape = object.__new__(cls)
    tape.__dict__ = gradtape.__dict__  # the same tape: entering, watching and recording act on it
    tape._gw = {
        "compression": compression,
        "sparse_as_dense": sparse_as_dense,
        "op": op,
        "predivide": gradient_predivide_factor,
        "process_set": process_set,
        "local": set(),  # id() of the sources kept local (a tf.Variable or a Keras 3 variable, which has no ref())
        "scale_local": scale_local_gradients,
    }
    return tape


def PartialDistributedGradientTape(  # noqa: N802 - Horovod's name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: str = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """`DistributedGradientTape` whose `local_layers` (a Keras layer or several) keep their trainable weights'
    gradients on each worker (a per-worker head, say), as Horovod's."""
    tape = DistributedGradientTape(
        gradtape,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
    )
    for layer in local_layers_of(local_layers):
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
