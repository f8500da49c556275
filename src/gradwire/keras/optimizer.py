"""Horovod's `DistributedOptimizer` for Keras 3 on any backend: a Keras optimizer whose updates use the gradients
averaged over the workers.

    opt = gw.DistributedOptimizer(keras.optimizers.Adam(0.001 * gw.size()))
    model.compile(optimizer=opt, loss=..., metrics=[...])
    model.fit(..., callbacks=[gw.callbacks.BroadcastGlobalVariablesCallback(0)])

Every Keras backend's training step reaches the optimizer through `apply` (TensorFlow and PyTorch directly, JAX
through `stateless_apply`, which calls it), so that is the one method replaced: the gradients are averaged there,
before clipping, weight decay, gradient accumulation and the optimizer's own moments, as Horovod's wrapper averages
them before the wrapped optimizer sees them. The wrapped optimizer is the same optimizer (its state is shared, not
copied) of a subclass of its own class, named and saved as that class, so a saved model loads without gradwire.
"""

from __future__ import annotations

import warnings
from typing import Any

from gradwire.introspection import global_process_set
from gradwire.session import current_worker

from .compression import Compression
from .exchange import reduce_values, signature


class _DistributedOptimizer:
    """The method a Keras optimizer's subclass gets (mixed in by `DistributedOptimizer`)."""

    _gw: dict

    @property
    def variables(self) -> list:
        """Keras 3's list of the optimizer's variables; called as Keras 2's `variables()` (Horovod's examples do:
        `hvd.broadcast_variables(opt.variables(), root_rank=0)`) it gives the same list, with a DeprecationWarning."""
        return _CallableList(super().variables)  # type: ignore[misc]

    def register_local_var(self, var: Any) -> None:
        """Keep `var`'s gradient on this worker: never reduced, divided by the number of workers where
        `scale_local_gradients` (Horovod's rule: a local layer then learns at the rate the reduced ones do)."""
        self._gw["local"].add(id(var))

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        grads = list(grads)
        if self._gw["local"]:
            variables = self._trainable_variables if trainable_variables is None else trainable_variables  # type: ignore[attr-defined]
            trainable_variables = list(variables)
            local = [id(v) in self._gw["local"] for v in trainable_variables]
        else:
            local = [False] * len(grads)
        return super().apply(self._gw_average(grads, local), trainable_variables)  # type: ignore[misc]

    def _gw_average(self, grads: list[Any], local: list[bool]) -> list[Any]:
        o = self._gw
        out = list(grads)
        if any(local):
            scale = 1.0 / o["workers"]() if o["scale_local"] else 1.0
            for i, g in enumerate(grads):
                if local[i] and g is not None and scale != 1.0:
                    out[i] = g * scale
        present = [i for i, g in enumerate(grads) if g is not None and not local[i]]
        if not present:
            return out
        compression = o["compression"]
        wire = [compression.compress(grads[i]) for i in present]
        values = [w for w, _ in wire]
        name = f"keras.DistributedOptimizer.{o['name']}.{signature(values)}"
        reduced = reduce_values(values, name, average=o["average"], members=o["members"])
        for i, value, (_, ctx) in zip(present, reduced, wire, strict=True):
            out[i] = compression.decompress(value, ctx)
        return out


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: str = "average",
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """`optimizer` (a Keras 3 optimizer), applying the gradients averaged (`op="sum"`: summed) over the workers.

    `backward_passes_per_step` > 1 is Keras's own `gradient_accumulation_steps` (set on the optimizer): the average
    is taken every pass and accumulated by Keras. The variables given to `register_local_var` keep their gradients
    (scaled by 1/workers if `scale_local_gradients`: PartialDistributedOptimizer). `device_*`, `sparse_as_dense` and
    `groups` are accepted for Horovod's signature: Keras hands the optimizer dense gradients, and a step's gradients
    always travel together.
    """
    if op not in ("average", "sum"):
        raise ValueError(f"DistributedOptimizer reduces gradients by 'average' or 'sum', not {op!r}")
    if gradient_predivide_factor != 1.0 and op != "average":
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step > 1:
        optimizer.gradient_accumulation_steps = backward_passes_per_step
    if isinstance(optimizer, _DistributedOptimizer):
        return optimizer
    _check_keras_3(optimizer)
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    wrapped = object.__new__(cls)
    object.__setattr__(wrapped, "__dict__", optimizer.__dict__)  # the same optimizer: its variables, its state
    members = getattr(process_set, "ranks", None)
    options = {
        "compression": compression,
        "average": op == "average",
        "members": None if members is None else list(members),
        "name": name or base.__name__,
        "local": set(),  # id() of the variables kept local
        "scale_local": scale_local_gradients,
        "workers": lambda: len(members) if members is not None else current_worker().size,
    }
    object.__setattr__(wrapped, "_gw", options)
    return wrapped


class _CallableList(list):
    """A list that answers a call with itself: Keras 2's `optimizer.variables()` on Keras 3's property."""

    def __call__(self) -> list:
        warnings.warn(
            "optimizer.variables() is Keras 2's; in Keras 3 `variables` is a property: use optimizer.variables",
            DeprecationWarning,
            stacklevel=2,
        )
        return list(self)


def _check_keras_3(optimizer: Any) -> None:
    """A Keras 2 optimizer (tf_keras's, `keras.optimizers.legacy`) never calls the `apply` this wrapper replaces: its
    gradients would not be averaged, silently. Refused, saying what to use."""
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers.*), not {type(optimizer).__module__}."
            f"{type(optimizer).__name__}: a Keras 2 optimizer (tf_keras, keras.optimizers.legacy) is replaced by the "
            "Keras 3 one of the same name (keras.optimizers.SGD(learning_rate=...), with learning_rate for lr)"
        )


def PartialDistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: str = "average",
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: Any = None,
    process_set: Any = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """`DistributedOptimizer` whose `local_layers` (a Keras layer or several) keep their trainable weights' gradients
    on each worker (a per-worker head, say), as Horovod's."""
    layers = local_layers_of(local_layers)
    wrapped = DistributedOptimizer(
        optimizer,
        name,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        gradient_predivide_factor,
        op,
        backward_passes_per_step,
        average_aggregated_gradients,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    for layer in layers:
        for var in layer.trainable_weights:
            wrapped.register_local_var(var)
    return wrapped


def local_layers_of(local_layers: Any) -> list[Any]:
    """`local_layers` as a list of Keras layers (one layer, several, or None); ValueError for anything else."""
    import keras

    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        return [local_layers]
    layers = list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in layers):
        raise ValueError("every local layer must be a keras.layers.Layer")
    return layers
