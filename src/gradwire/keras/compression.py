"""Compression on the wire for Keras values, in Horovod's shape: `Compression.none`, `.fp16`, `.bf16`."""

from __future__ import annotations

from typing import Any

import keras


class Compressor:
    """The identity: the value travels as it is."""

    wire_dtype: str | None = None

    @classmethod
    def compress(cls, value: Any) -> tuple[Any, Any]:
        dtype = keras.backend.standardize_dtype(value.dtype)
        if cls.wire_dtype is None or not dtype.startswith(("float", "bfloat")) or dtype == cls.wire_dtype:
            return value, dtype
        return keras.ops.cast(value, cls.wire_dtype), dtype

    @classmethod
    def decompress(cls, value: Any, ctx: Any) -> Any:
        return value if keras.backend.standardize_dtype(value.dtype) == ctx else keras.ops.cast(value, ctx)


class NoneCompressor(Compressor):
    """No compression (the default)."""


class FP16Compressor(Compressor):
    """Float values travel as float16."""

    wire_dtype = "float16"


class BF16Compressor(Compressor):
    """Float values travel as bfloat16."""

    wire_dtype = "bfloat16"


class Compression:
    """Horovod's names for the compressors."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
