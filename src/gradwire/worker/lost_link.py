"""A link to a server that died before this worker connected: its keys were moved onto the others."""

from __future__ import annotations

from collections.abc import Callable

from gradwire.worker.work import Work


class LostLink:
    """Stands in for a server that died before this worker connected: its keys were moved onto the others."""

    transport = "lost"

    class _NoConnection:
        peer = "(lost)"

        def send(self, parts: object) -> None:
            pass

        def close(self) -> None:
            pass

    def __init__(self, server: int, redirect: Callable[[Work, int], None]) -> None:
        self.server = server
        self.conn = self._NoConnection()
        self._redirect = redirect

    def submit(self, work: Work, priority: int) -> None:
        self._redirect(work, priority)

    def submit_all(self, works: list[Work], priority: int) -> None:
        for work in works:
            self._redirect(work, priority)

    def outstanding(self) -> list[str]:
        return []

    def start(self) -> None:
        pass

    def close(self, reason: BaseException, farewell: bytes | None = None) -> None:
        pass

    def join(self, timeout: float) -> None:
        pass
