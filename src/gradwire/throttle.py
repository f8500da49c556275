"""A log throttle: a flood of bad connections must not become a flood of log lines."""

from __future__ import annotations

import threading


class Throttle:
    """Allows the first `first` events, then every `every`-th; counts them all. Thread-safe."""

    def __init__(self, first: int = 10, every: int = 1000) -> None:
        self.first, self.every = first, every
        self.count = 0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            self.count += 1
            return self.count <= self.first or self.count % self.every == 0
