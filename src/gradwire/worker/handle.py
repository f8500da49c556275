"""The handle of one asynchronous push_pull: completes when every partition's sum is back."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from gradwire.errors import GradwireError, GradwireTimeout


class Handle:
    """Returned by `push_pull_async`. Thread-safe. `wait` blocks; `done` never does."""

    def __init__(self, name: str, output: np.ndarray, parts: int, on_done: Callable[[Handle], None]) -> None:
        self.name = name
        self.waits_on: str | None = None  # the tensor whose declaration it needs first, if not `name` (collectives.py)
        self.output = output
        self.error: BaseException | None = None
        self._remaining = parts
        self._completed = False  # decided, under the lock, by whichever of part_done/fail completes it
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._on_done = on_done
        self._callbacks: list[Callable[[Handle], None]] = []
        if parts == 0:
            self._completed = True
            self._finish()

    def __repr__(self) -> str:
        state = "failed" if self.error else "done" if self.done() else f"{self._remaining} partitions out"
        return f"<Handle {self.name!r} {state}>"

    def done(self) -> bool:
        """True once the result (or an error) is in; never blocks."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None, describe: Callable[[], str] | None = None) -> np.ndarray:
        """Block until complete; return the output array or raise the error."""
        if not self._event.wait(timeout):
            detail = describe() if describe else ""
            raise GradwireTimeout(
                f"push_pull of {self.name!r} did not complete in {timeout}s{detail}", tensor=self.name
            )
        if self.error is not None:
            raise self.error
        return self.output

    def add_parts(self, parts: int) -> None:
        """Expect `parts` more partitions (known once the tensor's declaration completes)."""
        with self._lock:
            self._remaining += parts

    def part_done(self) -> None:
        """One partition's sum has arrived (called on the link loop)."""
        with self._lock:
            self._remaining -= 1
            last = self._remaining == 0 and not self._completed
            self._completed |= last
        if last:
            self._finish()

    def fail(self, error: GradwireError) -> None:
        """Complete with an error (the first error wins)."""
        with self._lock:
            if self._completed:
                return
            self._completed = True
            self.error = error
        self._finish()

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call fn(handle) once complete (at once if it is); runs on the completing thread, so keep it short."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self) -> None:
        # the owner's bookkeeping first: a waiter that wakes may push the same tensor again at once, and must not
        # find this push_pull still in flight
        self._on_done(self)
        with self._lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
