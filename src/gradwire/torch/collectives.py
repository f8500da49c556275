"""The collectives of Horovod (`allreduce` and friends) and BytePS (`push_pull` and friends) on torch tensors.

Both families are a push_pull on the summation servers; they differ only in where the result goes:
- out of place: `allreduce`, `allreduce_async`, BytePS's `push_pull`, `push_pull_async`: the input is not modified
  and the result is a new tensor. `allreduce` and `push_pull` are differentiable: the gradient of an average is the
  average of the gradients (the backward pass is the same collective on the incoming gradient).
- in place: `allreduce_`, `allreduce_async_`, `push_pull_inplace`, `push_pull_async_inplace`.
Async calls return a handle for `poll` (never blocks) and `synchronize` (blocks; returns the result).

Names: BytePS needs one (`name=`); Horovod makes one when it is None (`allreduce.noname.<n>`, numbered in call
order, so workers running the same program agree). A name may be used again with another shape: it is then a new
tensor on the servers (gradwire.Worker.declare).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import gradwire
import torch
from gradwire.collectives import KEY_OPS, Average, Sum, horovod_op
from gradwire.session import current_worker
from gradwire.worker import Worker

from .compression import Compression, Compressor
from .ops import GroupHandle, TorchHandle
from .ops import push_pull_async as _push_pull_async

_auto_names: weakref.WeakKeyDictionary[Worker, itertools.count] = weakref.WeakKeyDictionary()


def _name(worker: Worker, name: str | None, kind: str) -> str:
    if name is not None:
        return name
    counter = _auto_names.setdefault(worker, itertools.count())
    return f"{kind}.noname.{next(counter)}"


def _reduction(worker: Worker, average: bool | None, op: str | None, name: str | None) -> tuple[str, bool]:
    """Horovod's rules (gradwire.collectives.horovod_op): the servers' operation and whether to divide by the number
    of workers."""
    op = horovod_op(average, op, worker.rank, name)
    return KEY_OPS[op], op == Average


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """`tensor * factor` in `tensor`'s dtype (integers: computed in float64, truncated, as Horovod scales them)."""
    if tensor.is_floating_point():
        return tensor * factor
    return (tensor.to(torch.float64) * factor).to(tensor.dtype)


def _members(process_set: Any) -> list[int] | None:
    """The ranks of a Horovod process set (None: the global set, every worker)."""
    if process_set is None:
        return None
    ranks = getattr(process_set, "ranks", None)
    if ranks is None:
        return None
    if not process_set.included():
        raise ValueError(
            f"worker {current_worker().rank} called a collective of {process_set!r}, which it is not part of"
        )
    return list(ranks)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
    *,
    compression: type[Compressor] = Compression.none,
    priority: int = 0,
    inplace: bool = False,
) -> TorchHandle:
    """Start averaging (or summing) `tensor` over all workers; `synchronize(handle)` returns the result. The input
    is not modified (`allreduce_async_` writes the result into it)."""
    worker = current_worker()
    members = _members(process_set)
    key_op, average = _reduction(worker, average, op, name)
    name = _name(worker, name, "allreduce")
    source, push_inplace = tensor, inplace
    if prescale_factor != 1.0:
        with torch.no_grad():
            scaled = _scaled(tensor.detach(), prescale_factor)
            if inplace:
                tensor.copy_(scaled)
            else:  # a scaled copy: the sum lands in it
                source, push_inplace = scaled, True
    handle = _push_pull_async(source, average, name, priority, compression, worker, push_inplace, key_op, members)
    handle.scale = postscale_factor
    return handle


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
    *,
    compression: type[Compressor] = Compression.none,
    priority: int = 0,
) -> TorchHandle:
    """In place: start averaging (or summing) `tensor` over all workers into itself; returns a handle."""
    return allreduce_async(
        tensor,
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        compression=compression,
        priority=priority,
        inplace=True,
    )


class _AllReduce(torch.autograd.Function):
    """allreduce as an autograd op: the gradient of an average (sum) is the average (sum) of the gradients."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, op: str, name: str, compression: type, scales: tuple, process_set: Any
    ) -> Any:
        ctx.op, ctx.name, ctx.compression, ctx.scales, ctx.process_set = op, name, compression, scales, process_set
        handle = allreduce_async(
            tensor, None, name, op, scales[0], scales[1], process_set, compression=compression, inplace=False
        )
        return synchronize(handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # Horovod's: the gradient goes through the same reduction (for min, max and product too)
        out = allreduce(grad, None, f"{ctx.name}.grad", ctx.compression, ctx.op, *ctx.scales, ctx.process_set)
        return out, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """Average (or sum, op=Sum) `tensor` over all workers; returns a new tensor and leaves the input as it is.
    Blocks. Differentiable."""
    worker = current_worker()
    _members(process_set)
    key_op, mean = _reduction(worker, average, op, name)
    op = (Average if mean else Sum) if key_op == "sum" else op
    name = _name(worker, name, "allreduce")
    scales = (prescale_factor, postscale_factor)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllReduce.apply(tensor, op, name, compression, scales, process_set)
    handle = allreduce_async(tensor, None, name, op, *scales, process_set, compression=compression, inplace=False)
    return synchronize(handle)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """In place: average (or sum) `tensor` over all workers into itself; returns it. Blocks."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


# -- grouped: one call for a list of tensors ---------------------------------------------------------------------


def grouped_allreduce_async(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
    *,
    compression: type[Compressor] = Compression.none,
    inplace: bool = False,
) -> Any:
    """Start an allreduce of each tensor of the list (each its own tensor on the servers, `name.i`); `synchronize`
    returns the list of results. The inputs are not modified."""
    worker = current_worker()
    _reduction(worker, average, op, name)  # the arguments' errors once, before anything is pushed
    name = _name(worker, name, "grouped_allreduce")
    return GroupHandle(
        [
            allreduce_async(
                t,
                average,
                f"{name}.{i}",
                op,
                prescale_factor,
                postscale_factor,
                process_set,
                compression=compression,
                inplace=inplace,
            )
            for i, t in enumerate(tensors)
        ]
    )


def grouped_allreduce_async_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Any:
    """In place: start an allreduce of each tensor of the list into itself."""
    return grouped_allreduce_async(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set, inplace=True
    )


def grouped_allreduce(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list[torch.Tensor]:
    """Allreduce each tensor of the list; returns new tensors. Blocks. Differentiable (each as `allreduce`)."""
    worker = current_worker()
    _reduction(worker, average, op, name)
    name = _name(worker, name, "grouped_allreduce")
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return [
            allreduce(t, average, f"{name}.{i}", compression, op, prescale_factor, postscale_factor, process_set)
            for i, t in enumerate(tensors)
        ]
    handle = grouped_allreduce_async(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set, compression=compression
    )
    return synchronize(handle)


def grouped_allreduce_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list[torch.Tensor]:
    """In place: allreduce each tensor of the list into itself; returns them. Blocks."""
    handle = grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    return synchronize(handle)


# -- BytePS's names ------------------------------------------------------------------------------------------


def push_pull_async(
    tensor: torch.Tensor, average: bool = True, name: str | None = None, version: int = 0, priority: int = 0
) -> TorchHandle:
    """BytePS: start averaging (or summing) `tensor`; the input is not modified. `synchronize` returns the result.
    `version` is accepted for BytePS's signature; gradwire numbers rounds itself."""
    return _byteps(tensor, average, name, priority, inplace=False)


def push_pull_async_inplace(
    tensor: torch.Tensor, average: bool = True, name: str | None = None, version: int = 0, priority: int = 0
) -> TorchHandle:
    """BytePS: start averaging (or summing) `tensor` into itself; returns a handle."""
    return _byteps(tensor, average, name, priority, inplace=True)


def push_pull_inplace(
    tensor: torch.Tensor, average: bool = True, name: str | None = None, version: int = 0, priority: int = 0
) -> torch.Tensor:
    """BytePS: average (or sum) `tensor` into itself (blocking); returns it."""
    return synchronize(push_pull_async_inplace(tensor, average, name, version, priority))


def push_pull(
    tensor: torch.Tensor,
    average: bool = True,
    name: str | None = None,
    version: int = 0,
    priority: int = 0,
    compression: type[Compressor] = Compression.none,
) -> torch.Tensor:
    """BytePS: average (or sum) `tensor` over all workers (blocking); returns a new tensor, the input unchanged.
    Differentiable."""
    worker = current_worker()
    if name is None:
        raise gradwire.TensorError(
            f"worker {worker.rank}: push_pull needs a name that is the same on every worker (name='loss'), "
            "as in BytePS",
            rank=worker.rank,
        )
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllReduce.apply(tensor, Average if average else Sum, name, compression, (1.0, 1.0), None)
    handle = _push_pull_async(tensor, bool(average), name, priority, compression, worker, inplace=False)
    return synchronize(handle)


def _byteps(tensor: torch.Tensor, average: bool, name: str | None, priority: int, inplace: bool) -> TorchHandle:
    worker = current_worker()
    name = _name(worker, name, "push_pull")
    return _push_pull_async(tensor, bool(average), name, priority, Compression.none, worker, inplace=inplace)


def poll(handle: Any) -> bool:
    """True once the handle's result is ready (never blocks)."""
    return handle.done()


def synchronize(handle: Any) -> Any:
    """Wait for a handle (up to GRADWIRE_TIMEOUT); returns its result: a tensor, a list of them (grouped), or an
    alltoall's (output, received splits)."""
    return handle.result(current_worker())


def declare(name: str) -> int:
    """BytePS's pre-declaration of a name. gradwire declares a tensor on its first use (with its shape, which a
    name alone does not give), so there is nothing to do ahead; kept so BytePS scripts run unchanged."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"declare needs a tensor name, got {name!r}")
    return 0
