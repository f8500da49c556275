"""A log throttle: a flood of bad connections must not become a flood of log lines."""

from __future__ import annotations

import logging
import threading

from gradwire.transport import tcp


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


class HandshakeGate:
    """The cap on connections being authenticated at once, and throttled logging of every refusal."""

    def __init__(self, limit: int, log: logging.Logger) -> None:
        self.limit, self.log = limit, log
        self.refusals = Throttle()
        self._slots = threading.BoundedSemaphore(limit)

    def enter(self, conn: tcp.Connection) -> bool:
        """Take a handshake slot; when none is free the connection is refused and closed (False)."""
        if self._slots.acquire(blocking=False):
            return True
        self.refuse(conn, f"{self.limit} handshakes pending")
        conn.close()
        return False

    def leave(self) -> None:
        self._slots.release()

    def refuse(self, conn: tcp.Connection, reason: object) -> None:
        """Log a refusal: the first ten, then every thousandth, with the running count."""
        if self.refusals.allow():
            self.log.warning(
                "refused connection from %s: %s (%d refused so far)", conn.peer, reason, self.refusals.count
            )
