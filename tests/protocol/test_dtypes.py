import numpy as np
import pytest

from gradwire.errors import TensorError
from gradwire.protocol import dtypes


def test_bfloat16_round_trips_and_rounds_to_nearest_even():
    values = np.array([1.0, -2.5, 3.140625, 1e-3, 65504.0], np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # truncation: exact for these values
    acc = np.empty(len(values), np.float32)
    dtypes.widen(dtypes.BFLOAT16, bits, acc)
    out = np.empty_like(bits)
    dtypes.narrow(dtypes.BFLOAT16, acc, out)
    assert np.array_equal(out, bits)
    # 1 + 2^-8 lies halfway between two bfloat16 values: ties go to the even mantissa (1.0)
    acc = np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)
    dtypes.narrow(dtypes.BFLOAT16, acc, out[:2])
    assert list(out[:2]) == [0x3F80, 0x3F82]


def test_unsupported_dtype_lists_the_supported_ones():
    with pytest.raises(TensorError, match="float32"):
        dtypes.from_numpy(np.complex64)
