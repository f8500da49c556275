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


class ReplyItem:
    """What a worker's reply queue holds: one frame to send. Each kind makes its own frame (`parts`)."""

    __slots__ = ("key",)
    direct = False  # may go at once from the engine's thread (`WorkerLink.reply`)

    def parts(self, link: WorkerLink, header: bytearray, epoch: int, sender: int) -> tuple[list, int]:
        """The frame's parts, its header packed into `header`, and the bytes of a sum it carries (for metrics)."""
        raise NotImplementedError


class ResultReply(ReplyItem):
    """A round's result (or the worker's slice of it); `pull`: the worker's shared pull slot, or NO_SLOT."""

    __slots__ = ("dtype", "payload", "pull", "round")

    def __init__(self, key: int, rnd: int, dtype: int, payload: memoryview, pull: int) -> None:
        self.key, self.round, self.dtype, self.payload, self.pull = key, rnd, dtype, payload, pull

    @property
    def direct(self) -> bool:  # type: ignore[override]
        return len(self.payload) <= DIRECT_REPLY_BYTES

    def parts(self, link: WorkerLink, header: bytearray, epoch: int, sender: int) -> tuple[list, int]:
        payload, size = self.payload, len(self.payload)
        if self.pull != shm.NO_SLOT and link.arena is not None:
            # the worker offered a shared pull slot: one memcpy here, none through the kernel
            np.copyto(link.arena.pull_slot(self.pull, size), np.frombuffer(payload, np.uint8))
            shared = (shm.SHM_PAYLOAD, self.pull)
            frames.pack_header_into(
                header, FrameType.RESULT, size, self.dtype, epoch, sender, self.key, self.round, *shared
            )
            return [header], size
        frames.pack_header_into(header, FrameType.RESULT, size, self.dtype, epoch, sender, self.key, self.round)
        return [header, payload], size


class AckReply(ReplyItem):
    """A contribution is in (it frees a place in the worker's window)."""

    __slots__ = ("round",)
    direct = True

    def __init__(self, key: int, rnd: int) -> None:
        self.key, self.round = key, rnd

    def parts(self, link: WorkerLink, header: bytearray, epoch: int, sender: int) -> tuple[list, int]:
        frames.pack_header_into(header, FrameType.ACK, 0, 0, epoch, sender, self.key, self.round)
        return [header], 0


class ErrorReply(ReplyItem):
    """An ERROR for a key: queued like the rest, so it cannot overtake the key's ACK."""

    __slots__ = ("message",)

    def __init__(self, key: int, message: str) -> None:
        self.key, self.message = key, message

    def parts(self, link: WorkerLink, header: bytearray, epoch: int, sender: int) -> tuple[list, int]:
        return [frames.encode_json(FrameType.ERROR, {"message": self.message}, key=self.key)], 0


class RestReply(ReplyItem):
    """The part of a frame that a send without waiting left over: the replier sends it before anything else."""

    __slots__ = ("pulled", "views")

    def __init__(self, key: int, views: list[memoryview], pulled: int) -> None:
        self.key, self.views, self.pulled = key, views, pulled  # pulled: the sum's bytes (0: an ACK), once sent

    def parts(self, link: WorkerLink, header: bytearray, epoch: int, sender: int) -> tuple[list, int]:
        return self.views, self.pulled


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

    def reply(self, item: ReplyItem) -> None:
        """Queue a reply to this worker (a sum, an ACK or an ERROR), in order with every other reply to it.

        An ACK or a small sum over a socket goes at once from the calling thread (an engine's) when nothing is queued
        or being sent before it and the socket takes it without waiting; what the socket does not take, and
        everything else, goes through the queue to the replier, so a slow worker never holds an engine."""
        with self._order:
            if self._queued == 0 and self._ids is not None and self.arena is None and item.direct:
                rest = self._send_now(item)
                if rest is None:
                    return
                item = rest
            self._queued += 1
            self.replies.put(item)

    def _send_now(self, item: ReplyItem) -> RestReply | None:
        """Send a reply without waiting; None if the socket took it whole, else what is left, for the replier."""
        assert self._ids is not None
        parts, pulled = item.parts(self, self._direct_header, *self._ids)
        rest = self.conn.send_nowait(parts)
        if not rest:
            if pulled:
                self.metrics.pulled(pulled)
            return None
        return RestReply(item.key, rest, pulled)

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

    def _send_queued(self, item: ReplyItem, epoch: int, sender: int) -> bool:
        """Send one queued reply; False if the connection failed."""
        parts, pulled = item.parts(self, self._header, epoch, sender)
        try:
            self.conn.send(parts)
        except GradwireError as e:
            log.warning("cannot reply to worker %d: %s", self.conn.peer_rank, e)
            return False
        if pulled:
            self.metrics.pulled(pulled)
        return True
