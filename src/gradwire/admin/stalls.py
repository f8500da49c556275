"""The stall watcher that the scheduler and every server run: what waits too long, said in the log."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


def watch_stalls(done: threading.Event, seconds: float, report: Callable[[], list[str]], log: logging.Logger) -> None:
    """Log `report()`'s lines every half of `seconds` until `done` is set: repeated while a stall lasts, so a stuck
    job keeps saying why (GRADWIRE_STALL_SECONDS)."""
    while not done.wait(seconds / 2):
        for line in report():
            log.warning("stall: %s", line)
