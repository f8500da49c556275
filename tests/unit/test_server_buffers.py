"""A server's large buffers are mapped with their pages populated (server/buffers.py); small ones are numpy's."""

import mmap

import numpy as np
import pytest

from gradwire.server import buffers


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint16, np.int8])
def test_a_large_buffer_is_a_writable_mapping_of_its_size(dtype):
    n = buffers.LARGE // np.dtype(dtype).itemsize + 3
    a = buffers.empty(n, dtype)
    assert a.shape == (n,) and a.dtype == dtype and a.flags.writeable and a.flags.c_contiguous
    if buffers._POPULATE:
        assert isinstance(a.base, memoryview) and isinstance(a.base.obj, mmap.mmap)  # mapped, populated (Linux)
    a[:] = 7
    assert int(a[0]) == int(a[-1]) == 7


def test_a_small_buffer_is_plain_numpy():
    a = buffers.empty(100, np.float32)
    assert a.shape == (100,) and a.base is None
