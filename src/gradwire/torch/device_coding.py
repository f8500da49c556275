"""A compressed push_pull of a tensor on an accelerator, encoded and decoded where it lives (docs/compression.md, "On
a GPU"): each partition, with this worker's error feedback and momentum kept beside it on the device, becomes its
block there (torch/device_codecs.py), and only the block crosses to the host, 1/32 of the gradient with onebit; each
answered block crosses back and is decoded into the output there. Staging the whole gradient through host memory
and encoding it on the CPU (what a CPU tensor gets) would move 32 times the bytes over PCIe and spend the host's
cores on every element.

`ON_CPU_TOO` sends CPU tensors this way as well: how the tests run this path on a machine without a GPU.
"""

from __future__ import annotations

import numpy as np

import torch
from gradwire.protocol import compression
from gradwire.worker import Handle, Worker
from gradwire.worker.compressing import KeyCodec

from . import device_codecs

ON_CPU_TOO = False  # tests: CPU tensors take the device path too


def applies(worker: Worker, source: torch.Tensor, op: str, members: list[int] | None) -> bool:
    """The device path: a float32 sum on an accelerator (or anywhere, ON_CPU_TOO) that is compressed (its size past
    GRADWIRE_COMPRESSION_MIN_BYTES), where no host stage needs the gradient itself (local aggregation's shared
    memory)."""
    if (source.device.type == "cpu" and not ON_CPU_TOO) or source.dtype != torch.float32:
        return False
    shaped = np.broadcast_to(np.float32(0), source.shape)  # the tensor's shape, dtype and bytes, no memory
    calls = worker.calls  # the host path's own decisions, asked of the same tensor
    if not calls.compressing.applies(shaped, op, None):
        return False
    return calls.aggregation is None or not calls.aggregation.applies(shaped, op, members)


class DeviceCoder:
    """One push_pull's partitions, encoded from `source` and decoded into `output` (flat float32, on one device)."""

    def __init__(self, source: torch.Tensor, output: torch.Tensor, args: dict, rank: int) -> None:
        self.source, self.output, self.rank = source, output, rank
        self.feedback, self.momentum = bool(args["ef"]), float(args["momentum"])

    def encode(self, entry: KeyCodec, block: np.ndarray, start: int, count: int, key: int, rnd: int) -> None:
        """Partition [start, start + count) into `block` (host memory): momentum, error feedback, encoding on the
        device, then one copy of the block."""
        x = self.source[start : start + count]
        codec = entry.codec
        if self.momentum > 0:  # v = mu v + g; g + mu v is compressed (as the host's, worker/compressing.py)
            if entry.velocity is None:
                entry.velocity = torch.zeros_like(x)
            entry.velocity.mul_(self.momentum).add_(x)
            x = entry.velocity * self.momentum + x
        if self.feedback and codec is not compression.RAW:  # e' = (g + e) - C(g + e)
            if entry.residual is None:
                entry.residual = torch.zeros_like(x)
            total = entry.residual.add_(x)
            encoded = device_codecs.encode(codec, total, key, rnd, self.rank)
            total.sub_(device_codecs.decode(codec, encoded, count, key, rnd))
        else:
            encoded = device_codecs.encode(codec, x, key, rnd, self.rank)
        torch.from_numpy(block).copy_(encoded)

    def decode(
        self, entry: KeyCodec, block: np.ndarray, start: int, count: int, key: int, rnd: int, average: int
    ) -> None:
        """An answered block (host memory) into the output's partition, averaged."""
        values = device_codecs.decode(entry.codec, torch.from_numpy(block).to(self.output.device), count, key, rnd)
        if average > 1:
            values /= average
        self.output[start : start + count].copy_(values)


def push_pull_async(
    worker: Worker,
    tensor: torch.Tensor,
    source: torch.Tensor,
    average: bool,
    name: str,
    priority: int,
    inplace: bool,
    members: list[int] | None,
    args: dict,
) -> tuple[Handle, torch.Tensor, torch.Tensor]:
    """Start the sum; returns its handle, the output (`tensor` itself, `inplace`) and where the sum lands (the output,
    or a contiguous tensor to copy into it)."""
    flat = source.reshape(-1) if source.is_contiguous() else source.contiguous().view(-1)
    output = tensor if inplace else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    landing = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    coder = DeviceCoder(flat, landing.view(-1), args, worker.rank)
    handle = worker.calls.push_pull_coded_async(name, tuple(tensor.shape), coder, average, priority, members, args)
    return handle, output, landing
