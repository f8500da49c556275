"""Horovod's TensorFlow collectives on the summation servers: allreduce and its grouped form, allgather, broadcast,
alltoall, reducescatter, with Horovod's gradients, eagerly or inside `tf.function` (tensorflow/bridge.py).

A grouped call is one host call whose tensors are fused per dtype (gradwire/grouped.py): a step's gradients travel as
one buffer per dtype, cut into partitions over the servers, not as one message per tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from gradwire import collectives, grouped
from gradwire.collectives import KEY_OPS, Average, Sum, horovod_op
from gradwire.introspection import global_process_set
from gradwire.session import current_worker
from gradwire.worker.work import divisor

from .bridge import host_call, members_of, moved, name_of, scaled
from .compression import Compression


def _op(average: bool | None, op: str | None) -> str:
    """Horovod's rules for a reduction's arguments (gradwire.collectives.horovod_op)."""
    return horovod_op(average, op, current_worker().rank)


def _differentiable(
    forward: Callable[..., Any], gradient: Callable[..., Any], xs: list[tf.Tensor], when: bool = True
) -> Any:
    """`forward(*xs)`, whose gradient is `gradient(*dys)` where `when` and every input is a float (Horovod registers
    gradients for its ops; integer tensors have none)."""
    if not when or not all(x.dtype.is_floating for x in xs):
        return forward(*xs)

    @tf.custom_gradient
    def op(*xs: tf.Tensor) -> Any:
        return forward(*xs), gradient

    return op(*xs)


def reduce_group(
    tensors: list[tf.Tensor], op: str, prescale: float, postscale: float, name: str, members: list[int] | None
) -> list[tf.Tensor]:
    """The reduction of `tensors` in one host call (one fused buffer per dtype), differentiable: the gradient of a
    sum (average) is the sum (average) of the gradients, as Horovod registers it."""
    worker = current_worker()
    key_op, average = KEY_OPS[op], op == Average

    def host(*arrays: np.ndarray) -> list[np.ndarray]:
        return grouped.exchange(worker, list(arrays), name, average=average, op=key_op, members=members)

    def forward(*xs: tf.Tensor) -> list[tf.Tensor]:
        inputs = [scaled(x, prescale) for x in xs]
        outs = host_call(host, inputs, [x.dtype for x in inputs])
        results = []
        for x, out in zip(xs, outs, strict=True):
            out.set_shape(x.shape)
            results.append(scaled(out, postscale))
        return results

    def gradient(*dys: tf.Tensor) -> list[tf.Tensor]:
        return reduce_group(list(dys), op, prescale, postscale, f"{name}.grad", members)

    tensors = [tf.convert_to_tensor(t) for t in tensors]
    return list(_differentiable(forward, gradient, tensors, when=op in (Average, Sum)))


def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: Any = global_process_set,
    ignore_name_scope: bool = False,
) -> Any:
    """The average (default) or `op` of `tensor` over all workers: a tensor of its shape and dtype. A
    `tf.IndexedSlices` is allgathered (values and indices), as Horovod does. `device_*` are accepted for Horovod's
    signature (the servers are CPU processes)."""
    op = _op(average, op)
    members = members_of(process_set)
    worker = current_worker()
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse(tensor, op, prescale_factor, postscale_factor, name, process_set)
    tensor = tf.convert_to_tensor(tensor)
    name = name_of(worker, name, "allreduce", tensor)
    wire, ctx = compression.compress(tensor)
    (summed,) = reduce_group([wire], op, prescale_factor, postscale_factor, name, members)
    return compression.decompress(summed, ctx)


def _sparse(
    tensor: tf.IndexedSlices, op: str, prescale: float, postscale: float, name: str | None, process_set: Any
) -> tf.IndexedSlices:
    if op not in (Average, Sum):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    values = allgather(tensor.values, name=None if name is None else f"{name}.values", process_set=process_set)
    indices = allgather(tensor.indices, name=None if name is None else f"{name}.indices", process_set=process_set)
    if op == Average:
        n = current_worker().size if getattr(process_set, "ranks", None) is None else len(process_set.ranks)
        values = values / tf.cast(n, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)


def grouped_allreduce(
    tensors: list[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
    name: str | None = None,
) -> list[Any]:
    """`allreduce` of every tensor of `tensors`, in one host call: one fused buffer per dtype on the wire."""
    op = _op(average, op)
    if not tensors:
        return []
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return [
            allreduce(t, None, "", "", compression, op, prescale_factor, postscale_factor, None, process_set)
            for t in tensors
        ]
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    name = name_of(current_worker(), name, "grouped_allreduce", tensors[0])
    compressed = [compression.compress(t) for t in tensors]
    wire = [w for w, _ in compressed]
    summed = reduce_group(wire, op, prescale_factor, postscale_factor, name, members_of(process_set))
    return [compression.decompress(s, ctx) for s, (_, ctx) in zip(summed, compressed, strict=True)]


def allgather(
    tensor: Any, name: str | None = None, ignore_name_scope: bool = False, process_set: Any = global_process_set
) -> tf.Tensor:
    """Every worker's `tensor` concatenated along the first dimension (which may differ by worker). Its gradient is
    the average of the output's gradient over the workers, cut to this worker's rows (Horovod's)."""
    worker = current_worker()
    x = tf.convert_to_tensor(tensor)
    name = name_of(worker, name, "allgather", x)
    members = members_of(process_set)

    @moved
    def host(array: np.ndarray) -> list[np.ndarray]:
        return [worker.synchronize(collectives.allgather_async(worker, array, name, members=members))]

    def forward(x: tf.Tensor) -> tf.Tensor:
        (out,) = host_call(host, [x], [x.dtype])
        out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        return out

    def gradient(dy: tf.Tensor) -> tf.Tensor:
        (reduced,) = reduce_group([dy], Average, 1.0, 1.0, f"{name}.grad", members)
        rows = allgather(tf.shape(x)[:1], name=f"{name}.grad.rows", process_set=process_set)
        ranks = list(range(worker.size)) if members is None else sorted(members)
        return tf.split(reduced, rows, num=len(ranks), axis=0)[ranks.index(worker.rank)]

    return _differentiable(forward, gradient, [x])


def grouped_allgather(
    tensors: list[Any], name: str | None = None, ignore_name_scope: bool = False, process_set: Any = global_process_set
) -> list[tf.Tensor]:
    """`allgather` of each tensor of `tensors`."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    name = name_of(current_worker(), name, "grouped_allgather", tensors[0] if tensors else None)
    return [allgather(t, f"{name}.{i}", process_set=process_set) for i, t in enumerate(tensors)]


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = global_process_set,
) -> tf.Tensor:
    """Worker `root_rank`'s `tensor`, on every worker. Its gradient is the average of the gradients on the root and
    zero elsewhere (Horovod's)."""
    worker = current_worker()
    x = tf.convert_to_tensor(tensor)
    name = name_of(worker, name, "broadcast", x)
    members = members_of(process_set)

    @moved
    def host(array: np.ndarray) -> list[np.ndarray]:
        return grouped.exchange(worker, [array], name, root=root_rank, members=members)

    def forward(x: tf.Tensor) -> tf.Tensor:
        (out,) = host_call(host, [x], [x.dtype])
        out.set_shape(x.shape)
        return out

    def gradient(dy: tf.Tensor) -> tf.Tensor:
        (reduced,) = reduce_group([dy], Average, 1.0, 1.0, f"{name}.grad", members)
        return reduced if worker.rank == root_rank else reduced * 0

    return _differentiable(forward, gradient, [x])


def broadcast_variables(variables: list[Any], root_rank: int, process_set: Any = global_process_set) -> Any:
    """Assign worker `root_rank`'s values to `variables` on every worker, in one host call (fused per dtype).
    Eagerly it assigns at once and returns None; inside `tf.function` it returns the group of assignments."""
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    worker = current_worker()
    name = "tf.broadcast_variables." + _signature(variables)
    members = members_of(process_set)

    def host(*arrays: np.ndarray) -> list[np.ndarray]:
        return grouped.exchange(worker, list(arrays), name, root=root_rank, members=members)

    # tf.Variables and Keras 3's variables alike (a Keras model's `variables`, as Horovod's examples pass them)
    values = host_call(host, [tf.convert_to_tensor(v) for v in variables], [tf.as_dtype(v.dtype) for v in variables])
    assigns = [v.assign(tf.reshape(x, v.shape)) for v, x in zip(variables, values, strict=True)]
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_global_variables(root_rank: int) -> Any:
    """TensorFlow 1: assign worker `root_rank`'s values to every global variable of the default graph (the group of
    assignments, to run in the session). Eagerly there are no global variables: RuntimeError, as Horovod raises."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables() needs a TensorFlow 1 graph: eagerly, broadcast the model's and the "
            "optimizer's variables with broadcast_variables(variables, root_rank)"
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_(
    variables: list[Any], root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> list:
    """In place: `variables` take worker `root_rank`'s values; returns their values (read after the assignments)."""
    assigned = broadcast_variables(variables, root_rank, process_set)
    with tf.control_dependencies([] if assigned is None else [assigned]):
        return [v.read_value() for v in variables]


def _signature(tensors: list[Any]) -> str:
    """The group's name for its tensors' dtypes and shapes (gradwire/grouped.py)."""
    return grouped.signature([(tf.as_dtype(t.dtype).name, list(t.shape)) for t in tensors])


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = global_process_set,
) -> Any:
    """Send `splits[j]` rows of `tensor` to worker j (equal splits when None); returns the rows received in rank
    order, and with `splits` given also how many came from each worker (Horovod's pair)."""
    worker = current_worker()
    x = tf.convert_to_tensor(tensor)
    name = name_of(worker, name, "alltoall", x)
    members = members_of(process_set)
    given = splits is not None
    split_tensor = tf.cast(tf.convert_to_tensor(splits if given else []), tf.int32)

    @moved
    def host(array: np.ndarray, parts: np.ndarray) -> list[np.ndarray]:
        handle, received = collectives.alltoall_async(
            worker, array, [int(p) for p in parts] if given else None, name, members=members
        )
        return [worker.synchronize(handle), np.asarray(received, np.int32)]

    sent: dict[str, tf.Tensor] = {}  # the forward's received splits, where the gradient's rows go back

    def forward(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        out, received = host_call(host, [x, split_tensor], [x.dtype, tf.int32])
        out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        received.set_shape([None])
        sent["received"] = received
        return out, received

    def gradient(dy: tf.Tensor, *unused: Any) -> tf.Tensor:  # the rows go back where they came from
        return alltoall(dy, splits=sent["received"], name=f"{name}.grad", process_set=process_set)[0]

    out, received = _differentiable(forward, gradient, [x])
    return (out, received) if given else out


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Any = Compression.none,
    op: str = Average,
    name: str | None = None,
    process_set: Any = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduce `tensor` over all workers; returns this worker's rows of the result (d0 // n each, the first d0 % n
    workers one more, as Horovod splits them)."""
    op = _op(None, op)
    worker = current_worker()
    tensor = tf.convert_to_tensor(tensor)
    name = name_of(worker, name, "reducescatter", tensor)
    members = members_of(process_set)
    wire, ctx = compression.compress(tensor)
    wire = scaled(wire, prescale_factor)

    def host(array: np.ndarray) -> list[np.ndarray]:
        handle = collectives.reducescatter_async(
            worker, array, name, average=op == Average, op=KEY_OPS[op], members=members
        )
        return [worker.synchronize(handle)]

    def forward(x: tf.Tensor) -> tf.Tensor:
        (out,) = host_call(host, [x], [x.dtype])
        out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        return out

    def gradient(dy: tf.Tensor) -> tf.Tensor:  # Horovod's: every worker's rows, gathered (times n for a sum)
        n = divisor(worker.size, op == Sum, members)  # a sum's gradient is every worker's: times their number
        dy = scaled(dy, n * prescale_factor * postscale_factor)
        return allgather(dy, name=f"{name}.grad", process_set=process_set)

    out = _differentiable(forward, gradient, [wire], when=op in (Average, Sum))
    return compression.decompress(scaled(out, postscale_factor), ctx)


def grouped_reducescatter(
    tensors: list[Any],
    device_dense: str = "",
    compression: Any = Compression.none,
    op: str = Average,
    name: str | None = None,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[tf.Tensor]:
    """`reducescatter` of each tensor of `tensors`."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    name = name_of(current_worker(), name, "grouped_reducescatter", tensors[0] if tensors else None)
    return [
        reducescatter(t, "", compression, op, f"{name}.{i}", process_set, False, prescale_factor, postscale_factor)
        for i, t in enumerate(tensors)
    ]
