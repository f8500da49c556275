"""push_pull on torch tensors.

CPU tensors travel without copies: the worker sends from the tensor's own memory and receives the sum into it
(through `tensor.numpy()`, which shares it). bfloat16 has no numpy dtype, so its bits travel as uint16 under the
bfloat16 wire dtype. CUDA tensors are staged through pinned host memory (one copy each way, asynchronous to the
device), since the servers are CPU processes; compressed by a compressor the servers run, only their blocks cross
(device_coding.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import gradwire
import torch
from gradwire import compression as _servers
from gradwire.session import current_worker
from gradwire.worker import Handle, Worker
from gradwire.worker.work import divisor

from . import device_coding
from .compression import Compression, Compressor
from .delay_compensation import dc_adam_, delay_compensation_  # noqa: F401 - BytePS: `from byteps.torch.ops import ...`
from .powersgd import PowerSGD

_SUPPORTED = {
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.bool,
}


class GroupHandle:
    """The handle of a grouped collective: `result` is the list of its tensors' results."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def result(self, worker: Worker) -> list[torch.Tensor]:
        return [h.result(worker) for h in self.handles]


class TorchHandle:
    """The handle of a torch push_pull: completes into `output`, decompressed and back on its device."""

    def __init__(
        self,
        handle: Handle,
        output: torch.Tensor,
        wire: torch.Tensor,
        ctx: torch.dtype,
        compression: type[Compressor],
        staged: torch.Tensor | None,
        divide_by: int,
    ) -> None:
        self.handle, self.output, self.wire, self.ctx = handle, output, wire, ctx
        self.compression, self.staged, self.divide_by = compression, staged, divide_by
        self.scale = 1.0  # applied to the result once (Horovod's postscale_factor)
        self._finished = False

    def done(self) -> bool:
        return self.handle.done()

    def result(self, worker: Worker) -> torch.Tensor:
        """Wait, then write the result into `output` (for compressed or staged tensors) and return it.

        Blocks up to GRADWIRE_TIMEOUT; raises the error that failed the push_pull. Calling it again returns the
        same tensor."""
        if self._finished:
            return self.output
        worker.synchronize(self.handle)
        wire = self.wire
        if self.staged is not None:
            wire = self.staged.to(self.output.device, non_blocking=False)
        result = self.compression.decompress(wire, self.ctx)
        if self.divide_by > 1:  # bfloat16 travels as uint16 bits: average after decompressing
            result = result / self.divide_by
        with torch.no_grad():
            if result.data_ptr() != self.output.data_ptr():
                self.output.copy_(result.view_as(self.output))
            if self.scale != 1.0:  # integers: in float64, truncated (as Horovod's postscale_factor)
                if self.output.is_floating_point():
                    self.output.mul_(self.scale)
                else:
                    self.output.copy_(self.output.to(torch.float64) * self.scale)
        self._finished = True
        return self.output


def as_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """A numpy view of a contiguous CPU tensor's memory, and the wire dtype name."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16), "bfloat16"
    array = tensor.numpy()
    return array, array.dtype.name


def push_pull_async(
    tensor: torch.Tensor,
    average: bool = True,
    name: str | None = None,
    priority: int = 0,
    compression: type[Compressor] = Compression.none,
    worker: Worker | None = None,
    inplace: bool = True,
    op: str = "sum",
    members: list[int] | None = None,
) -> TorchHandle:
    """Start summing `tensor` across workers. Returns a handle whose `result` is the sum (or average).

    In place (the default here) the result is written into `tensor`; otherwise `tensor` is left as it is and the
    result is a new tensor of its shape, dtype and device (BytePS's `push_pull` and Horovod's `allreduce`).
    `op` is the servers' reduction: "sum" (averaged when `average`), "min", "max" or "product"; `members` the
    ranks that take part (a process set; None: every worker).
    """
    worker = worker or current_worker()
    source = tensor.detach()
    if isinstance(compression, PowerSGD):
        call = compression.push_pull_async(tensor, average, name, priority, worker, inplace, op, members)
        if call is not None:
            return call  # type: ignore[return-value]
        compression = Compression.none  # vectors, small matrices, and the first steps: a plain sum
    compression, servers = _sorted_out(compression)
    wire, ctx = compression.compress(source) if servers is None else (source, source.dtype)
    _check_push_pull(worker, name, wire, average)
    if servers is not None and device_coding.applies(worker, source, op, members):
        assert name is not None
        coded, output, landing = device_coding.push_pull_async(
            worker, tensor, source, average, name, priority, inplace, members, servers
        )
        return TorchHandle(coded, output, landing, tensor.dtype, Compression.none, None, 1)
    wire, staged, output = _wire_and_output(tensor, source, wire, inplace)
    array, dtype = as_numpy(wire)
    worker_average = average and dtype != "bfloat16"
    handle = worker.push_pull_async(
        array, name, worker_average, priority, out=array, dtype=dtype, op=op, members=members, compression=servers
    )
    divide_by = divisor(worker.size, average and not worker_average, members)
    unwrap = compression if servers is None else Compression.none
    return TorchHandle(handle, output, wire, ctx, unwrap, staged, divide_by)


def _wire_and_output(
    tensor: torch.Tensor, source: torch.Tensor, wire: torch.Tensor, inplace: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The CPU tensor the sum is pushed from and lands in (a device tensor's staged copy, or a contiguous one), the
    staging copy if any, and the tensor the result is (`tensor` in place; else the wire where it is a fresh copy of
    the input's kind, or a new one)."""
    staged = None
    if wire.device.type != "cpu":
        staged = torch.empty(wire.shape, dtype=wire.dtype, pin_memory=torch.cuda.is_available())
        staged.copy_(wire)
        wire = staged
    elif not wire.is_contiguous() or (not inplace and wire.data_ptr() == source.data_ptr()):
        wire = wire.contiguous() if inplace else wire.clone(memory_format=torch.contiguous_format)
    if inplace:
        output = tensor
    elif staged is None and wire.dtype == tensor.dtype and wire.data_ptr() != source.data_ptr():
        output = wire  # a fresh copy already: the sum lands in it, and it is the result
    else:  # compressed or staged: the result is decompressed (or copied back) into a tensor of the input's kind
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return wire, staged, output


def _sorted_out(compression: Any) -> tuple[Any, dict | None]:
    """Horovod's kind of compressor and None, or the arguments of one the servers run (the worker encodes each
    partition; the tensor travels as it is); BytePS's spelling naming no compressor is none."""
    servers = _servers.args_of(compression)
    if servers is None and isinstance(compression, dict):
        return Compression.none, None
    return compression, servers


def _check_push_pull(worker: Worker, name: str | None, wire: torch.Tensor, average: bool) -> None:
    """What a push_pull refuses before anything moves: no name, a dtype the wire does not carry, a bool average."""
    if name is None:
        raise gradwire.TensorError(
            f"worker {worker.rank}: push_pull needs a name that is the same on every worker (name='layer1.weight')",
            rank=worker.rank,
        )
    if wire.dtype not in _SUPPORTED:
        raise gradwire.TensorError(
            f"worker {worker.rank}: push_pull of {name!r}: dtype {wire.dtype} is not supported (supported: "
            f"{', '.join(sorted(str(d) for d in _SUPPORTED))}); cast it first",
            tensor=name,
            rank=worker.rank,
        )
    if average and wire.dtype == torch.bool:
        raise gradwire.TensorError(
            f"worker {worker.rank}: the average of bool tensor {name!r} is not defined; use op=Sum (a logical or)",
            tensor=name,
            rank=worker.rank,
        )
