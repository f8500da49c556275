"""Compression on the wire in Horovod's TensorFlow shape: `Compression.none`, `.fp16`, `.bf16`.

A compressor turns a tensor into what travels (`compress` returns the wire tensor and a context) and back
(`decompress`). The servers sum float16 and bfloat16 in float32, so compression costs precision once per push and
once per pull, never per addition. The servers' own compressors (onebit, top-k, ...) are the torch adapter's for now.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class Compressor:
    """The identity: the tensor travels as it is."""

    wire_dtype: tf.DType | None = None

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        if cls.wire_dtype is None or not tensor.dtype.is_floating or tensor.dtype == cls.wire_dtype:
            return tensor, tensor.dtype
        return tf.cast(tensor, cls.wire_dtype), tensor.dtype

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None or tensor.dtype == ctx else tf.cast(tensor, ctx)


class NoneCompressor(Compressor):
    """No compression (the default)."""


class FP16Compressor(Compressor):
    """Float tensors travel as float16 (half the bytes; range up to 65504)."""

    wire_dtype = tf.float16


class BF16Compressor(Compressor):
    """Float tensors travel as bfloat16 (half the bytes, float32's range, 8 bits of mantissa)."""

    wire_dtype = tf.bfloat16


class Compression:
    """Horovod's names for the compressors."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
