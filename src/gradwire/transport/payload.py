"""A frame's payload that a link loop (transport/loop.py) receives as it arrives: a socket read without waiting may
hold only part of it, so where it goes, how much of it is in and what follows once it is whole are kept between
passes. One per link: a worker's answers (worker/answers.py) and a server's incoming pushes (server/reader.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gradwire.transport.tcp import Connection


class Payload:
    """The payload being received on one connection, if any."""

    __slots__ = ("_got", "_into", "_then")

    def __init__(self) -> None:
        self._into: memoryview | None = None  # where it goes
        self._got = 0  # its bytes in so far
        self._then: Callable[[], None] | None = None  # what to do once it is all in

    @property
    def pending(self) -> bool:
        """Whether a payload is being received."""
        return self._into is not None

    def expect(self, into: np.ndarray, then: Callable[[], None]) -> None:
        """The frame's payload goes into `into` as it arrives, then `then()` (at once for an empty one)."""
        if not len(into):
            then()
            return
        self._into, self._got, self._then = memoryview(into).cast("B"), 0, then

    def resume(self, conn: Connection) -> bool:
        """Receive what `conn` holds now of the pending payload; True once it is whole (`then` has run: it may have
        begun another), False while the socket holds no more of it. Raises what the connection raises."""
        into = self._into
        assert into is not None and self._then is not None
        self._got = conn.recv_into_nowait(into, self._got)
        if self._got < len(into):
            return False
        then, self._into, self._then = self._then, None, None
        then()
        return True
