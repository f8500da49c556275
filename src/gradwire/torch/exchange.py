"""Horovod's allgather and broadcast (and their grouped, async and in-place forms; alltoall and reducescatter:
torch/scatter.py) on torch tensors, with Horovod's names, signatures, defaults, errors and gradients. The servers
carry them (see gradwire/collectives.py for what each costs on the wire).

Tensors of any dtype gradwire carries travel from their own memory when they are contiguous CPU tensors; others
(CUDA, non-contiguous) are copied to a contiguous CPU tensor first and the result is moved back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import gradwire
import torch
from gradwire import collectives
from gradwire.session import current_worker
from gradwire.worker import Handle, Worker

from .collectives import Average, Sum, _members, _name, allreduce
from .ops import GroupHandle, as_numpy


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with `tensor`'s values (the tensor itself when it is one)."""
    return tensor.detach().to("cpu").contiguous()


def _torch(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """The numpy result as a tensor of `like`'s dtype and device (no copy on the CPU)."""
    if like.dtype == torch.bfloat16:
        out = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(array)
    return out.to(like.device) if like.device.type != "cpu" else out


def _wire(tensor: torch.Tensor) -> dict:
    """The numpy view of a contiguous CPU tensor and its wire dtype, as keyword arguments."""
    array, dtype = as_numpy(tensor)
    return {"array": array, "dtype": dtype}


def _array(tensor: torch.Tensor) -> np.ndarray:
    return as_numpy(tensor)[0]


class ExchangeHandle:
    """The handle of an allgather, broadcast, alltoall or reducescatter: `result` is the output tensor (for alltoall,
    the output and the received splits), on the input's device; `done` never blocks."""

    def __init__(self, handle: Handle, like: torch.Tensor, finish: Any = None, keep: Any = None) -> None:
        self.handle, self.like, self.finish, self.keep = handle, like, finish, keep
        self._result: Any = None

    def done(self) -> bool:
        return self.handle.done()

    def result(self, worker: Worker) -> Any:
        if self._result is None:
            array = worker.synchronize(self.handle)
            out = _torch(array, self.like)
            self._result = self.finish(out) if self.finish else out
        return self._result


# -- allgather ---------------------------------------------------------------------------------------------------


def allgather_async(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> ExchangeHandle:
    """Start concatenating `tensor` from every rank along the first dimension (which may differ by rank); the input
    is not modified. `synchronize` returns the result.

    Horovod's `allgather_async(tensor, name=None, process_set=global_process_set)` and BytePS's
    `allgather_async(tensor, shape_list=None, name=None, version=0, priority=0)` both: BytePS's `shape_list` (every
    rank's first dimension) is what gradwire finds out itself, and is checked against it where given."""
    call = _GatherCall.of("allgather_async", args, kwargs, shape_list=True)
    rows = tensor.shape[0] if tensor.dim() else 1
    if call.shape_list and call.shape_list[current_worker().rank] != rows:
        said = call.shape_list[current_worker().rank]
        raise ValueError(
            f"allgather_async: shape_list says {said} rows for rank {current_worker().rank}, the tensor {rows}"
        )
    return _allgather_async(tensor, call.name, call.process_set)


def _allgather_async(tensor: torch.Tensor, name: str | None, process_set: Any) -> ExchangeHandle:
    worker = current_worker()
    members = _members(process_set)
    name = _name(worker, name, "allgather")
    source = _cpu(tensor)
    handle = collectives.allgather_async(worker, name=name, members=members, **_wire(source))
    return ExchangeHandle(handle, tensor, keep=source)


class _GatherCall:
    """An allgather's arguments, spelt as Horovod or as BytePS: after the tensor, Horovod passes (name,
    process_set); BytePS (same_shape, name, version, priority) to `allgather`, (shape_list, name, version, priority)
    to `allgather_async`, and some of its tests an output tensor first. Told apart by the type of the first."""

    BYTEPS = ("same_shape", "name", "version", "priority")
    HOROVOD = ("name", "process_set")

    def __init__(self, **given: Any) -> None:
        self.name: str | None = given.get("name")
        self.process_set = given.get("process_set")
        self.output: torch.Tensor | None = given.get("output")
        self.shape_list: list[int] | None = given.get("shape_list") or None
        # same_shape (a hint: gradwire gathers first dimensions that differ anyway), version (BytePS's staleness
        # counter) and priority: accepted, without effect on the result

    @classmethod
    def of(cls, what: str, args: tuple, kwargs: dict, shape_list: bool = False) -> _GatherCall:
        names: tuple[str, ...] = cls.HOROVOD
        if args and isinstance(args[0], torch.Tensor):
            names = ("output", *cls.BYTEPS)
        elif args and shape_list and isinstance(args[0], list | tuple):
            names = ("shape_list", *cls.BYTEPS[1:])
        elif args and not shape_list and isinstance(args[0], bool):
            names = cls.BYTEPS
        if len(args) > len(names):
            raise TypeError(f"{what}() takes at most {len(names) + 1} positional arguments ({len(args) + 1} given)")
        given = dict(zip(names, args, strict=False))
        known = {"name", "process_set", "output", "same_shape", "version", "priority", "shape_list"}
        for key, value in kwargs.items():
            if key not in known or key in given:
                raise TypeError(f"{what}() got an unexpected or repeated keyword argument {key!r}")
            given[key] = value
        return cls(**given)


class _AllGather(torch.autograd.Function):
    """The gradient of an allgather is this rank's rows of the average of the gradients (Horovod's and BytePS's)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: Any) -> Any:
        ctx.rows, ctx.process_set = (tensor.shape[0] if tensor.dim() else 1), process_set
        return gradwire.torch.synchronize(_allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad, average=True, process_set=ctx.process_set)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64), process_set=ctx.process_set)
        members = _members(ctx.process_set) or list(range(current_worker().size))
        offset = int(rows[: members.index(current_worker().rank)].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Concatenate `tensor` from every rank along the first dimension. Blocks. Differentiable.

    Horovod's `allgather(tensor, name=None, process_set=global_process_set)` and BytePS's
    `allgather(tensor, same_shape=True, name=None, version=0, priority=0)` both (`same_shape` is a hint gradwire does
    not need); with an `output` tensor (BytePS's tests pass one after the input) the result is written into it and
    returned."""
    call = _GatherCall.of("allgather", args, kwargs)
    if tensor.requires_grad and torch.is_grad_enabled() and call.output is None:
        return _AllGather.apply(tensor, call.name, call.process_set)
    result = gradwire.torch.synchronize(_allgather_async(tensor, call.name, call.process_set))
    if call.output is None:
        return result
    if call.output.shape != result.shape:
        shapes = f"{tuple(call.output.shape)}, the result {tuple(result.shape)}"
        raise ValueError(f"allgather: the output has shape {shapes}")
    return call.output.copy_(result)


def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None, process_set: Any = None) -> Any:
    """Start an allgather of each tensor of the list; `synchronize` returns the list of results."""
    worker = current_worker()
    name = _name(worker, name, "grouped_allgather")
    return GroupHandle([allgather_async(t, f"{name}.{i}", process_set) for i, t in enumerate(tensors)])


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None, process_set: Any = None) -> list:
    """Allgather each tensor of the list. Blocks. Differentiable."""
    worker = current_worker()
    name = _name(worker, name, "grouped_allgather")
    return [allgather(t, f"{name}.{i}", process_set) for i, t in enumerate(tensors)]


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: str = Average, process_set: Any = None) -> Any:
    """Start summing (op=Sum) or averaging a sparse tensor over the ranks, as Horovod does it: an allgather of its
    indices and one of its values (the servers concatenate; duplicates add up when the result is used). Returns a
    function that waits and returns the sparse result."""
    if op not in (Average, Sum):
        raise ValueError(f"sparse allreduce supports op=Average or Sum, got {op!r}")
    sparse = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # allgather concatenates along the first dimension: the indices travel transposed (one row per element)
    indices = _allgather_async(sparse.indices().transpose(0, 1).contiguous(), f"{name}.indices", process_set)
    values = _allgather_async(sparse.values(), f"{name}.values", process_set)
    divide = len(_members(process_set) or range(current_worker().size)) if op == Average else 1

    def handle() -> torch.Tensor:
        worker = current_worker()
        gathered = values.result(worker)
        where = indices.result(worker)
        if divide > 1:
            gathered = gathered / divide
        return torch.sparse_coo_tensor(where.transpose(0, 1), gathered, sparse.size(), check_invariants=True)

    return handle


# -- broadcast ---------------------------------------------------------------------------------------------------


def _broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None, inplace: bool, process_set: Any
) -> ExchangeHandle:
    worker = current_worker()
    members = _members(process_set)
    name = _name(worker, name, "broadcast")
    source = _cpu(tensor)
    into = source if inplace and source.data_ptr() == tensor.data_ptr() else torch.empty_like(source)
    out = _array(into)
    handle = collectives.broadcast_async(worker, root=root_rank, name=name, out=out, members=members, **_wire(source))
    if inplace:

        def finish(out: torch.Tensor) -> torch.Tensor:
            if out.data_ptr() != tensor.data_ptr():
                with torch.no_grad():
                    tensor.copy_(out.view_as(tensor))
            return tensor

        return ExchangeHandle(handle, tensor, finish, keep=source)
    return ExchangeHandle(handle, tensor, keep=source)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> Any:
    """Start sending the root's `tensor` to every rank; the input is not modified."""
    return _broadcast(tensor, root_rank, name, False, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> Any:
    """In place: start overwriting `tensor` with the root's."""
    return _broadcast(tensor, root_rank, name, True, process_set)


class _Broadcast(torch.autograd.Function):
    """The gradient of a broadcast: the average of the gradients on the root, zero elsewhere (Horovod's)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: Any) -> Any:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return gradwire.torch.synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad, average=True, process_set=ctx.process_set)
        if current_worker().rank != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> Any:
    """The root's `tensor` on every rank, as a new tensor. Blocks. Differentiable."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return gradwire.torch.synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> Any:
    """In place: overwrite `tensor` with the root's; returns it. Blocks."""
    return gradwire.torch.synchronize(broadcast_async_(tensor, root_rank, name, process_set))
