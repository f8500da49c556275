"""A worker's requests to the scheduler (declarations, barriers, joins, rejoins): each waits for the REPLY with its
id, or is cancelled by an abort or a membership change. Thread-safe: replies come on the worker's control thread."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Request:
    """One request in flight. `reply` is the scheduler's answer once `done` is set, or None if it was cancelled;
    `callback(reply)` (or `callback(None)`) runs on the thread that answers or cancels it."""

    __slots__ = ("callback", "done", "reply")

    def __init__(self, callback: Callable[[dict | None], None] | None = None) -> None:
        self.done = threading.Event()
        self.reply: dict | None = None
        self.callback = callback

    def answer(self, body: dict) -> None:
        self.reply = body
        self.done.set()
        if self.callback is not None:
            self.callback(body)

    def cancel(self) -> None:
        """No reply will come: blocked callers wake to find none, asynchronous ones are told None."""
        self.done.set()
        if self.callback is not None:
            self.callback(None)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until answered or cancelled (at most `timeout` seconds); False if neither came in time."""
        return self.done.wait(timeout)
