"""Horovod's alltoall and reducescatter (and their grouped and async forms) on torch tensors, with Horovod's names,
signatures, defaults, errors and gradients: what each rank receives is its own part of the result (allgather and
broadcast, where every rank receives all of it: torch/exchange.py, whose handle and conversions these share)."""

from __future__ import annotations

from typing import Any

import gradwire
import torch
from gradwire import collectives
from gradwire.session import current_worker
from gradwire.worker.work import divisor

from .collectives import Average, Sum, _members, _name, _reduction, _scaled
from .exchange import ExchangeHandle, _cpu, _wire, allgather
from .ops import GroupHandle

# -- alltoall ----------------------------------------------------------------------------------------------------


def alltoall_async(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None
) -> ExchangeHandle:
    """Start sending `splits[j]` rows of `tensor` to rank j (equal splits when None); `synchronize` returns the
    received rows (in rank order) and the received splits."""
    worker = current_worker()
    members = _members(process_set)
    name = _name(worker, name, "alltoall")
    if splits is not None:
        if isinstance(splits, torch.Tensor):
            if splits.dtype not in (torch.int32, torch.int64) or splits.dim() > 1:
                raise gradwire.TensorError(
                    f"worker {worker.rank}: alltoall splits must be a 1-d tensor of int32 or int64, got "
                    f"{splits.dtype} of shape {list(splits.shape)}",
                    tensor=name,
                    rank=worker.rank,
                )
            splits = splits.tolist()
        splits = [int(s) for s in splits]
    source = _cpu(tensor)
    handle, received = collectives.alltoall_async(worker, splits=splits, name=name, members=members, **_wire(source))
    return ExchangeHandle(handle, tensor, lambda out: (out, torch.from_numpy(received)), keep=source)


class _AllToAll(torch.autograd.Function):
    """The gradient of an alltoall is the alltoall of the gradient, with the received splits sent back."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: Any) -> Any:
        output, received = gradwire.torch.synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> Any:
        back, _ = alltoall(grad, splits=ctx.received, process_set=ctx.process_set)
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None) -> Any:
    """Send `splits[j]` rows of `tensor` to rank j; returns the received rows and, when `splits` was given, the
    received splits. Blocks. Differentiable."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllToAll.apply(tensor, splits, name, process_set)
    output, received = gradwire.torch.synchronize(alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)


# -- reducescatter -----------------------------------------------------------------------------------------------


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: str = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> ExchangeHandle:
    """Start reducing `tensor` over all ranks; this rank receives its rows of the result (the first dimension split
    as evenly as it goes, the first ranks one row more). The input is not modified."""
    worker = current_worker()
    members = _members(process_set)
    key_op, average = _reduction(worker, None, op, name)
    name = _name(worker, name, "reducescatter")
    if tensor.dim() == 0:
        raise gradwire.TensorError(
            f"worker {worker.rank}: reducescatter of {name!r} needs at least one dimension", tensor=name
        )
    source = _cpu(tensor)
    if prescale_factor != 1.0:
        source = _scaled(source, prescale_factor)
    divide = average and source.dtype == torch.bfloat16  # bfloat16 travels as bits: divide after
    handle = collectives.reducescatter_async(
        worker, name=name, average=average and not divide, op=key_op, members=members, **_wire(source)
    )
    factor = postscale_factor / divisor(worker.size, divide, members)

    def finish(out: torch.Tensor) -> torch.Tensor:
        return _scaled(out, factor) if factor != 1.0 else out

    return ExchangeHandle(handle, tensor, finish, keep=source)


class _ReduceScatter(torch.autograd.Function):
    """The gradient of a reducescatter is the allgather of the gradients (scaled as the forward was)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: str, scales: tuple, process_set: Any) -> Any:
        ctx.op, ctx.scales, ctx.process_set = op, scales, process_set
        return gradwire.torch.synchronize(reducescatter_async(tensor, name, op, process_set, *scales))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        if ctx.op == Sum:
            grad = grad * len(_members(ctx.process_set) or range(current_worker().size))
        grad = grad * (ctx.scales[0] * ctx.scales[1])
        return allgather(grad, process_set=ctx.process_set), None, None, None, None


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = None,
    op: str = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce `tensor` over all ranks and return this rank's rows of the result. Blocks. Differentiable."""
    scales = (prescale_factor, postscale_factor)
    wire, ctx = compression.compress(tensor) if compression is not None else (tensor, None)
    if tensor.requires_grad and torch.is_grad_enabled():
        out = _ReduceScatter.apply(wire, name, op, scales, process_set)
    else:
        out = gradwire.torch.synchronize(reducescatter_async(wire, name, op, process_set, *scales))
    return compression.decompress(out, ctx) if compression is not None else out


def grouped_reducescatter_async(
    tensors: list[torch.Tensor],
    name: str | None = None,
    op: str = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> GroupHandle:
    """Start a reducescatter of each tensor of the list; `synchronize` returns the list of results."""
    worker = current_worker()
    name = _name(worker, name, "grouped_reducescatter")
    return GroupHandle(
        [
            reducescatter_async(t, f"{name}.{i}", op, process_set, prescale_factor, postscale_factor)
            for i, t in enumerate(tensors)
        ]
    )


def grouped_reducescatter(
    tensors: list[torch.Tensor],
    name: str | None = None,
    compression: Any = None,
    op: str = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Reducescatter each tensor of the list. Blocks. Differentiable."""
    worker = current_worker()
    name = _name(worker, name, "grouped_reducescatter")
    return [
        reducescatter(t, f"{name}.{i}", compression, op, process_set, prescale_factor, postscale_factor)
        for i, t in enumerate(tensors)
    ]
