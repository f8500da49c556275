"""`DistributedDataParallel` as BytePS ships it: wrap the module, and backward averages the gradients.

    model = gradwire.torch.parallel.DistributedDataParallel(model, device_ids=[gw.local_rank()])
    loss = criterion(model(x), y); loss.backward()      # gradients are averaged over all workers here
    optimizer.step()                                     # a plain torch optimizer

Construction broadcasts rank 0's parameters and buffers. Each gradient is pushed the moment autograd has
accumulated it (gradients.py), and the hook of the last one waits for every sum, so when `backward()` returns the
gradients hold the average, as with torch's DDP. With `broadcast_buffers` (the default), every forward first copies
rank 0's buffers (BatchNorm's running statistics). `no_sync()` accumulates gradients locally; the first backward
after it pushes the accumulated sum.

A parameter that gets no gradient in a step (unused in that forward) is pushed as zeros when its sums are waited
for: at the next forward, or by `synchronize()`; until then the other gradients are already averaged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import gradwire
import torch

from ..broadcast import broadcast_parameters
from ..compression import Compressor, DefaultCompressor
from ..gradients import GradientSync


class DistributedDataParallel(torch.nn.Module):
    """BytePS's DDP: `module`'s gradients averaged over all workers in backward. `device_ids` may name one device
    (the module's); the summation servers take CPU and CUDA tensors alike."""

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: list[Any] | None = None,
        broadcast_buffers: bool = True,
        compression: type[Compressor] = DefaultCompressor,
    ) -> None:
        super().__init__()
        if device_ids is not None and len(device_ids) != 1:
            raise ValueError(f"DistributedDataParallel takes one device (one process per device), got {device_ids}")
        self.module = module
        self.device_ids = list(device_ids or [])
        self.broadcast_buffers = broadcast_buffers
        named = list(module.named_parameters())
        self._sync = GradientSync(
            [p for _, p in named],
            {id(p): n for n, p in named},
            compression,
            prefix="Gradient.",
            owner="DistributedDataParallel",
        )
        self._sync.on_all_pushed = self.synchronize
        if module.state_dict():
            broadcast_parameters(module.state_dict(), root_rank=0)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._sync.handles:  # a parameter unused in the last backward: complete that step first
            self.synchronize()
        if self.broadcast_buffers and self.training:
            buffers = list(self.module.named_buffers())
            if buffers:
                broadcast_parameters([(f"buffer.{n}", b) for n, b in buffers], root_rank=0)
        return self.module(*inputs, **kwargs)

    def synchronize(self) -> None:
        """Wait for every gradient's sum (pushing zeros for parameters that got no gradient). Blocks."""
        self._sync.synchronize()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally inside; the first backward after it pushes their sum."""
        previous, self._sync.enabled = self._sync.enabled, False
        try:
            yield
        finally:
            self._sync.enabled = previous

    @property
    def worker(self) -> gradwire.Worker:
        return self._sync.worker
