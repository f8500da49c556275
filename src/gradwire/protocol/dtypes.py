"""The element types gradwire moves, their wire codes, and how a server sums each.

float16 and bfloat16 are summed in float32 (accumulating many halves in half precision loses the
low bits of the gradient); every other type is summed in itself (integers wrap around, as in torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradwire.errors import TensorError


@dataclass(frozen=True)
class DType:
    """One wire dtype: its code on the wire, the numpy dtype of its bytes, and the accumulator's dtype."""

    code: int
    name: str
    wire: np.dtype
    accumulate: np.dtype

    @property
    def itemsize(self) -> int:
        return self.wire.itemsize


# bfloat16 has no numpy dtype: on the wire it is uint16 (the high half of a float32).
_TABLE = (
    DType(1, "float16", np.dtype(np.float16), np.dtype(np.float32)),
    DType(2, "float32", np.dtype(np.float32), np.dtype(np.float32)),
    DType(3, "float64", np.dtype(np.float64), np.dtype(np.float64)),
    DType(4, "int32", np.dtype(np.int32), np.dtype(np.int32)),
    DType(5, "int64", np.dtype(np.int64), np.dtype(np.int64)),
    DType(6, "bfloat16", np.dtype(np.uint16), np.dtype(np.float32)),
    DType(7, "uint8", np.dtype(np.uint8), np.dtype(np.uint8)),
    DType(8, "int8", np.dtype(np.int8), np.dtype(np.int8)),
    DType(9, "int16", np.dtype(np.int16), np.dtype(np.int16)),
    DType(10, "bool", np.dtype(np.bool_), np.dtype(np.bool_)),  # a sum is a logical or, a product an and
)
BY_CODE = {d.code: d for d in _TABLE}
BY_NAME = {d.name: d for d in _TABLE}
FLOAT16 = BY_NAME["float16"]
BFLOAT16 = BY_NAME["bfloat16"]


def from_numpy(dtype: object) -> DType:
    """The wire dtype of a numpy dtype (or its name); raises TensorError for anything unsupported."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name  # type: ignore[call-overload]
    try:
        return BY_NAME[name]
    except KeyError:
        supported = ", ".join(BY_NAME)
        raise TensorError(f"dtype {name} is not supported; use one of: {supported}") from None


def widen(dtype: DType, wire: np.ndarray, out: np.ndarray) -> None:
    """Write the wire-typed array `wire` into the accumulator-typed `out` (the first contribution)."""
    if dtype is BFLOAT16:
        out.view(np.uint32)[:] = wire.astype(np.uint32) << 16
    else:
        out[:] = wire


def add_into(dtype: DType, acc: np.ndarray, wire: np.ndarray, scratch: np.ndarray) -> None:
    """acc += wire, in the accumulator's precision. `scratch` is a preallocated accumulator-sized buffer."""
    if dtype is BFLOAT16:
        widen(dtype, wire, scratch)
        np.add(acc, scratch, out=acc)
    else:
        np.add(acc, wire, out=acc, casting="unsafe")


def narrow(dtype: DType, acc: np.ndarray, out: np.ndarray) -> None:
    """Write the accumulator back in wire precision (round to nearest even for bfloat16)."""
    if dtype is BFLOAT16:
        bits = acc.view(np.uint32)
        rounding = ((bits >> 16) & 1) + 0x7FFF
        out[:] = ((bits + rounding) >> 16).astype(np.uint16)
    else:
        out[:] = acc
