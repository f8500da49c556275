"""push_pull on torch tensors.

CPU tensors travel without copies: the worker sends from the tensor's own memory and receives the sum into it
(through `tensor.numpy()`, which shares it). bfloat16 has no numpy dtype, so its bits travel as uint16 under the
bfloat16 wire dtype. CUDA tensors are staged through pinned host memory (one copy each way, asynchronous to the
device), since the servers are CPU processes.
"""

from __future__ import annotations

import numpy as np

import gradwire
import torch
from gradwire.worker import Handle, Worker

from .compression import Compression, Compressor

_SUPPORTED = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64}


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

    def done(self) -> bool:
        return self.handle.done()

    def result(self, worker: Worker) -> torch.Tensor:
        """Wait, then write the result into `output` (for compressed or staged tensors) and return it."""
        worker.synchronize(self.handle)
        wire = self.wire
        if self.staged is not None:
            wire = self.staged.to(self.output.device, non_blocking=False)
        result = self.compression.decompress(wire, self.ctx)
        if self.divide_by > 1:  # bfloat16 travels as uint16 bits: average after decompressing
            result = result / self.divide_by
        if result.data_ptr() != self.output.data_ptr():
            self.output.copy_(result.view_as(self.output))
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
) -> TorchHandle:
    """Start summing `tensor` across workers, in place. Returns a handle for `synchronize`."""
    worker = worker or gradwire.current_worker()
    if name is None:
        raise gradwire.TensorError("push_pull needs a name that is the same on every worker (name='layer1.weight')")
    wire, ctx = compression.compress(tensor.detach())
    if wire.dtype not in _SUPPORTED:
        raise gradwire.TensorError(f"push_pull of {name!r}: dtype {wire.dtype} is not supported", tensor=name)
    staged = None
    if wire.device.type != "cpu":
        staged = torch.empty(wire.shape, dtype=wire.dtype, pin_memory=torch.cuda.is_available())
        staged.copy_(wire)
        wire = staged
    elif not wire.is_contiguous():
        wire = wire.contiguous()
    if average and not wire.is_floating_point():
        raise gradwire.TensorError(f"average of integer tensor {name!r} is not defined; use average=False")
    array, dtype = as_numpy(wire)
    worker_average = average and dtype != "bfloat16"
    handle = worker.push_pull_async(array, name, worker_average, priority, out=array, dtype=dtype)
    divide_by = worker.size if average and not worker_average else 1
    return TorchHandle(handle, tensor, wire, ctx, compression, staged, divide_by)
