"""The engine's pool of buffers: staging buffers and lent round buffers.

Staging: a contribution waits in a staging buffer for its turn in rank order (deterministic sums, server/engine.py)
only until the engine adds it to its round, which is mostly at once: over a socket every rank's contribution but the
first rank's is received into one, in order or not. Round buffers: a round needs its accumulator from its first
contribution until every reply of its result has been sent (the repliers say so: `Countdown`), or at the latest until
the key's next round completes, whose contributions every worker pushed after it had this round's result
(KeyState.lend). So both are lent from one pool per engine rather than owned per key: a server holds buffers for the
rounds and contributions in flight, not two round buffers and (workers - 1) x 2 staging buffers per key; and a round
is written into pages the pool has written before rather than fresh ones (on the 1.2 GB tensor of
docs/benchmarks.md a server held 5-6 copies of its share, and each of the first two calls paid for fresh pages). The
pool only grows, to the most buffers ever in use at once. Keys under LEND_BYTES (server/rounds.py) keep buffers of
their own: the pool's bookkeeping per round is not worth their memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

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
            self.give_locked(buffer)

    def give_locked(self, buffer: np.ndarray) -> None:
        """`give`, with `lock` held."""
        self._free.setdefault((buffer.dtype, len(buffer)), []).append(buffer)


class Countdown:
    """Calls `then` once `count` calls of `one` have come, from any threads (the replies of one round: SendResult's
    `sent`)."""

    __slots__ = ("_left", "_lock", "_then")

    def __init__(self, count: int, then: Callable[[], None]) -> None:
        self._left, self._then, self._lock = count, then, threading.Lock()

    def one(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._then()
