"""The engine's pool of buffers: staging buffers and lent round buffers.

Staging: a contribution waits in a staging buffer for its turn in rank order (deterministic sums, server/engine.py)
only until the engine adds it to its round, which is mostly at once: over a socket every rank's contribution but the
first rank's is received into one, in order or not. Round buffers: a key's round needs its accumulator from its first
contribution until every worker has its result, which is known when the key's next round completes (KeyState.lend).
So both are lent from one pool per engine rather than owned per key: a server holds one buffer per key (its last
round's result) and about as many more as there are contributions and rounds in flight, not (workers - 1) x 2
staging buffers and two round buffers per key; and a round is written into pages the pool has touched before rather
than fresh ones (on the 1.2 GB tensor of docs/benchmarks.md, a server held 5-6 copies of its share and the second
call paid for fresh pages again). The pool only grows, to the most buffers ever in use at once. Keys under
LEND_BYTES (server/rounds.py) keep buffers of their own: the pool's bookkeeping per round is not worth their memory.
"""

from __future__ import annotations

import threading

import numpy as np


class BufferPool:
    """Buffers by element type and count, lent and given back. Thread-safe: readers take them (`Engine.landing`),
    the engine gives them back once what they hold is no longer needed."""

    def __init__(self) -> None:
        self._free: dict[tuple[np.dtype, int], list[np.ndarray]] = {}
        self.lock = threading.Lock()
        self.allocated = 0  # bytes of every buffer ever made (the pool's size)

    def take(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A buffer of `count` elements of `dtype`, a free one if there is one."""
        with self.lock:
            return self.take_locked(dtype, count)

    def take_locked(self, dtype: np.dtype, count: int) -> np.ndarray:
        """`take`, with `lock` held."""
        free = self._free.get((np.dtype(dtype), count))
        if free:
            return free.pop()
        self.allocated += count * np.dtype(dtype).itemsize
        return np.empty(count, dtype)

    def give(self, buffer: np.ndarray) -> None:
        """`buffer` (from `take`) is free again."""
        with self.lock:
            self._free.setdefault((buffer.dtype, len(buffer)), []).append(buffer)
