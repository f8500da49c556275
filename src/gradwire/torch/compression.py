"""Gradient compression on the wire, in Horovod's shape: `Compression.none`, `.fp16`, `.bf16`, and the compressors the
servers run (docs/compression.md): `Compression.onebit(...)`, `.topk(0.01)`, `.randomk(...)`, `.dithering(...)`.

Horovod's kind turns a tensor into what travels (`compress` returns the wire tensor and a context) and back
(`decompress`). Servers sum float16 and bfloat16 in float32, so compression costs precision once per
push and once per pull, never per addition. The servers' kind (gradwire.compression) leaves the tensor as it is: its
partitions are encoded on their way to the servers, which decode, sum and encode the sum once.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from gradwire import compression as _servers

from .powersgd import PowerSGD


class Compressor:
    """The identity: the tensor travels as it is."""

    wire_dtype: torch.dtype | None = None

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        if cls.wire_dtype is None or not tensor.is_floating_point() or tensor.dtype == cls.wire_dtype:
            return tensor, tensor.dtype
        return tensor.to(cls.wire_dtype), tensor.dtype

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


class NoneCompressor(Compressor):
    """No compression."""


class FP16Compressor(Compressor):
    """Float tensors travel as float16 (half the bytes; range up to 65504)."""

    wire_dtype = torch.float16


class BF16Compressor(Compressor):
    """Float tensors travel as bfloat16 (half the bytes, float32's range, 8 bits of mantissa)."""

    wire_dtype = torch.bfloat16


class DefaultCompressor(NoneCompressor):
    """What DistributedOptimizer and the DDP wrappers get where the code names no compressor: GRADWIRE_COMPRESSOR's
    (BytePS's BYTEPS_COMPRESSOR), once the worker's settings are known (`configured`), else none."""


def configured(compression: object, config: Any) -> object:
    """`compression`, or for the default the compressor GRADWIRE_COMPRESSOR and GRADWIRE_COMPRESSOR_K name."""
    if compression is not DefaultCompressor:
        return compression
    return _named(config.compressor, config.compressor_k)


@functools.lru_cache(maxsize=16)
def _named(name: str, k: float) -> object:
    """One compressor per setting (PowerSGD keeps its tensors' state in it, by worker and tensor)."""
    if name in ("", "none"):
        return NoneCompressor
    if name == "powersgd":
        return PowerSGD(rank=int(k) if k >= 1 else 2)
    if name in ("topk", "randomk"):
        return getattr(_servers, name)(int(k) if k >= 1 else k)
    if name == "dithering":
        return _servers.dithering(s=int(k) if k >= 1 else 7)
    return _servers.onebit()


class Compression:
    """The available compressors, as Horovod names them."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    onebit = staticmethod(_servers.onebit)
    topk = staticmethod(_servers.topk)
    randomk = staticmethod(_servers.randomk)
    dithering = staticmethod(_servers.dithering)
    powersgd = PowerSGD
