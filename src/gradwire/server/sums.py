"""How a server adds contributions into a round's accumulator: numpy (protocol/dtypes.py, the reference) or the native
kernels (gradwire-native's sums.cpp), which give the same bytes for every dtype (tests/native/test_sums.py).

The native kernels make one pass where numpy makes several for float16 and bfloat16 (a bfloat16 push is widened into
a scratch buffer through two temporary arrays before numpy adds it), and release the GIL while they add; for every
other dtype numpy's own loop is as fast or faster, and is kept (`NativeSums`).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from gradwire import native
from gradwire.protocol import dtypes


class Sums:
    """numpy's sums (protocol/dtypes.py). Stateless; every method is safe from any thread on disjoint buffers."""

    name = "python"

    def for_dtype(self, dtype: dtypes.DType) -> Sums:
        """The sums a key of `dtype` adds with (decided once, when the key is declared)."""
        return self

    def widen(self, dtype: dtypes.DType, wire: np.ndarray, acc: np.ndarray) -> None:
        """acc = wire, in the accumulator's type (a round's first contribution)."""
        dtypes.widen(dtype, wire, acc)

    def add_into(self, dtype: dtypes.DType, acc: np.ndarray, wire: np.ndarray, scratch: np.ndarray) -> None:
        """acc += wire, in the accumulator's precision (`scratch`: an accumulator-sized buffer numpy may use)."""
        dtypes.add_into(dtype, acc, wire, scratch)

    def narrow(self, dtype: dtypes.DType, acc: np.ndarray, out: np.ndarray) -> None:
        """out = acc, in the wire's type."""
        dtypes.narrow(dtype, acc, out)


class NativeSums(Sums):
    """The native kernels, for the keys where they beat numpy's: float16 and bfloat16 (one pass each way; 3-11x numpy's
    speed on keys of 32 KiB to 4 MiB, docs/native.md). Every other dtype is numpy's single vectorised pass, which numpy
    dispatches to the CPU's widest vectors and which the native float32 add (its NaN-order blend) trails by up to a
    fifth on keys that fit in L2: `for_dtype` gives those keys numpy's sums. The same bytes either way."""

    name = "native"

    def __init__(self, module: ModuleType) -> None:
        self._widen, self._add_into, self._narrow = module.widen, module.add_into, module.narrow

    def for_dtype(self, dtype: dtypes.DType) -> Sums:
        return self if dtype.code in HALVES else NUMPY

    def widen(self, dtype: dtypes.DType, wire: np.ndarray, acc: np.ndarray) -> None:
        self._widen(dtype.code, wire, acc)

    def add_into(self, dtype: dtypes.DType, acc: np.ndarray, wire: np.ndarray, scratch: np.ndarray) -> None:
        self._add_into(dtype.code, acc, wire)

    def narrow(self, dtype: dtypes.DType, acc: np.ndarray, out: np.ndarray) -> None:
        self._narrow(dtype.code, acc, out)


HALVES = frozenset({dtypes.FLOAT16.code, dtypes.BFLOAT16.code})  # summed in float32: where the native kernels win
NUMPY = Sums()


def for_datapath(datapath: str) -> Sums:
    """The sums of GRADWIRE_DATAPATH=`datapath` (gradwire/native.py decides, and says why where it falls back)."""
    module = native.for_datapath(datapath)
    return NUMPY if module is None else NativeSums(module)
