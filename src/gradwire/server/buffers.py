"""A server's large buffers (round accumulators and results, staging), their pages mapped when they are made.

A fresh buffer's pages are faulted in one by one as it is first written: measured on this machine's virtual machine,
writing 600 MB into fresh memory took 1.6-1.8 s, into the same memory mapped up front (MAP_POPULATE) 0.31 s to map
and 0.05 s to write, and a server holds one such buffer per round and per staged rank for every key. So the first
rounds of a large tensor paid seconds of page faults each (issue 33: a 1.2 GB push_pull's first two calls 6-7 s
against 1.2 s steady). Buffers from `LARGE` bytes up are mapped populated; smaller ones come from numpy as before
(a mapping of their own would cost a system call and a page each).
"""

from __future__ import annotations

import mmap

import numpy as np

LARGE = 1 << 20  # bytes: a buffer this large is mapped populated
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere the pages are faulted in as written


def empty(n: int, dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised array of n elements (its pages mapped already where it is large)."""
    dtype = np.dtype(dtype)
    nbytes = n * dtype.itemsize
    if nbytes < LARGE or not _POPULATE:
        return np.empty(n, dtype)
    mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    return np.frombuffer(mapped, dtype, n)  # keeps the mapping alive; unmapped when the array is collected
