"""The replier: a server's connection to one worker (`WorkerLink`), its reply queue and the thread that sends what
is queued. Small replies over a socket (ACKs, small sums) go from the engine's thread itself where nothing is queued
before them and the socket takes them without waiting (`WorkerLink.reply`): a wake-up of the replier less for most of
them; everything else goes through the queue, so a slow worker never holds an engine.
"""

from __future__ import annotations

import logging
import queue
import threading

import numpy as np

from gradwire.admin.metrics import Metrics
from gradwire.errors import GradwireError
from gradwire.protocol import frames
from gradwire.protocol.frames import FrameType
from gradwire.transport import shm, tcp

log = logging.getLogger("gradwire.server")
# replies up to this size over a socket may be sent by the engine's thread at once (WorkerLink.reply): a copy of this
# many bytes into the socket costs about what a wake-up of the reply thread does; larger ones stay off the engine
DIRECT_REPLY_BYTES = 64 << 10


class _Rest:
    """The part of a frame that a send without waiting left over: the reply thread sends it before anything else."""

    __slots__ = ("pulled", "views")

    def __init__(self, views: list[memoryview], pulled: int) -> None:
        self.views = views
        self.pulled = pulled  # the sum's bytes (0: an ACK), counted once sent


class WorkerLink:
    """A server's connection to one worker: the reader thread and the reply queue with its thread."""

    def __init__(self, conn: tcp.Connection, metrics: Metrics | None = None) -> None:
        self.conn = conn
        self.metrics = metrics or Metrics("server")
        self.replies: queue.SimpleQueue = queue.SimpleQueue()
        self.arena: shm.Arena | None = None  # shared slots, when the worker is on this host
        self._header = bytearray(frames.HEADER_SIZE)
        self._users = 2  # the reader and the replier: the shared slots are unmapped when both are done
        self._users_lock = threading.Lock()
        # replies queued or being sent by the replier: one sent at once must not overtake them (`reply`)
        self._queued = 0
        self._order = threading.Lock()
        self._direct_header = bytearray(frames.HEADER_SIZE)
        self._ids: tuple[int, int] | None = None  # (epoch, server rank) for headers, once the replier runs

    def reply(self, item: tuple) -> None:
        """Send a reply (key, round, dtype code, payload, pull slot): a sum (payload a view), an ACK (None) or an
        ERROR (a message). In order with every other reply to this worker.

        An ACK or a small sum over a socket goes at once from the calling thread (an engine's) when nothing is queued
        or being sent before it and the socket takes it without waiting; what the socket does not take, and
        everything else, goes through the queue to the replier, so a slow worker never holds an engine."""
        payload = item[3]
        direct = self._ids is not None and self.arena is None and not isinstance(payload, str)
        with self._order:
            if direct and self._queued == 0 and (payload is None or len(payload) <= DIRECT_REPLY_BYTES):
                rest = self._send_now(item)
                if rest is None:
                    return
                item = rest
            self._queued += 1
            self.replies.put(item)

    def _send_now(self, item: tuple) -> tuple | None:
        """Send a reply without waiting; None if the socket took it whole, else what is left, for the replier."""
        assert self._ids is not None
        key, rnd, dtype, payload, _ = item
        rest = self.conn.send_nowait(self._frame(self._direct_header, key, rnd, dtype, payload, *self._ids))
        pulled = 0 if payload is None else len(payload)
        if not rest:
            if pulled:
                self.metrics.pulled(pulled)
            return None
        return key, rnd, dtype, _Rest(rest, pulled), shm.NO_SLOT

    @staticmethod
    def _frame(
        header: bytearray, key: int, rnd: int, dtype: int, payload: memoryview | None, epoch: int, sender: int
    ) -> list:
        """The parts of an ACK (payload None) or of a RESULT over the socket, its header packed into `header`."""
        if payload is None:
            frames.pack_header_into(header, FrameType.ACK, 0, 0, epoch, sender, key, rnd)
            return [header]
        frames.pack_header_into(header, FrameType.RESULT, len(payload), dtype, epoch, sender, key, rnd)
        return [header, payload]

    def release(self) -> None:
        """The reader or the replier is done; the last one unmaps the shared slots (the other may still use them)."""
        with self._users_lock:
            self._users -= 1
            last = self._users == 0
        if last and self.arena is not None:
            self.arena.close()

    def reply_loop(self, epoch: int, sender: int) -> None:
        """Send queued sums (and ACKs, and ERRORs) until a None arrives or the connection breaks."""
        try:
            self._reply_loop(epoch, sender)
        finally:
            self.release()

    def _reply_loop(self, epoch: int, sender: int) -> None:
        self._ids = (epoch, sender)  # from now on `reply` may send small replies at once
        while (item := self.replies.get()) is not None:
            sent = self._send_queued(item, epoch, sender)
            with self._order:
                self._queued -= 1
            if not sent:
                return

    def _send_queued(self, item: tuple, epoch: int, sender: int) -> bool:
        """Send one queued reply; False if the connection failed."""
        header = self._header
        key, rnd, dtype, payload, pull = item
        pulled = 0
        if isinstance(payload, _Rest):  # what a send at once left over (`reply`)
            parts, pulled = payload.views, payload.pulled
        elif isinstance(payload, str):  # an ERROR for the key: queued, so it cannot overtake the key's ACK
            parts = [frames.encode_json(FrameType.ERROR, {"message": payload}, key=key)]
        elif payload is not None and pull != shm.NO_SLOT and self.arena is not None:
            # the worker offered a shared pull slot: one memcpy here, none through the kernel
            np.copyto(self.arena.pull_slot(pull, len(payload)), np.frombuffer(payload, np.uint8))
            frames.pack_header_into(
                header, FrameType.RESULT, len(payload), dtype, epoch, sender, key, rnd, shm.SHM_PAYLOAD, pull
            )
            parts, pulled = [header], len(payload)
        else:
            parts = self._frame(header, key, rnd, dtype, payload, epoch, sender)
            pulled = 0 if payload is None else len(payload)
        try:
            self.conn.send(parts)
        except GradwireError as e:
            log.warning("cannot reply to worker %d: %s", self.conn.peer_rank, e)
            return False
        if pulled:
            self.metrics.pulled(pulled)
        return True
