"""The replier (`Replier`): what a server sends one worker, in order: its reply queue and the thread that sends what is
queued, on the server's end of the worker's connection (whose frames the link loop reads: reader.py). Small replies
over a socket (ACKs, small sums) go from the engine's thread itself where nothing is queued before them and the
socket takes them without waiting (`Replier.reply`): a wake-up of the replier less for most of them; everything else
goes through the queue, so a slow worker never holds an engine.

Batches: an engine holds the replies it makes while it handles one batch of its ring (`HeldReplies`) and sends each
worker's at the end in one go: one system call (or one wake-up of the replier) per worker and batch, and the batch's
acknowledgements in one ACKS frame. Replies to one worker stay in the order they were made, whoever sends them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import numpy as np

from gradwire.admin.metrics import Metrics
from gradwire.errors import GradwireError
from gradwire.protocol import frames
from gradwire.protocol.frames import FrameType
from gradwire.server.staging import Countdown
from gradwire.transport import shm, tcp

log = logging.getLogger("gradwire.server")
# replies up to this size over a socket may be sent by the engine's thread at once (Replier.reply): a copy of this
# many bytes into the socket costs about what a wake-up of the reply thread does; larger ones stay off the engine
DIRECT_REPLY_BYTES = 64 << 10
MAX_ACKS = 4096  # acknowledgements in one ACKS frame at most (far below the control frames' limit)


class ReplyItem:
    """What a worker's reply queue holds: one frame to send. Each kind makes its own frame (`parts`)."""

    __slots__ = ("key",)
    direct = False  # may go at once from the engine's thread (`Replier.reply`)

    def parts(self, link: Replier, header: memoryview, epoch: int, sender: int) -> tuple[list, int]:
        """The frame's parts, its header packed into `header`, and the bytes of a sum it carries (for metrics)."""
        raise NotImplementedError


class ResultReply(ReplyItem):
    """A round's result (or the worker's slice of it); `pull`: the worker's shared pull slot, or NO_SLOT; `sent`
    (or None): told once it is sent (the replier's, after the send that carried it: `Replier._send_queued`)."""

    __slots__ = ("dtype", "flags", "payload", "pull", "round", "sent")

    def __init__(
        self,
        key: int,
        rnd: int,
        dtype: int,
        payload: memoryview,
        pull: int,
        sent: Countdown | None = None,
        flags: int = 0,
    ) -> None:
        self.key, self.round, self.dtype, self.payload, self.pull, self.sent = key, rnd, dtype, payload, pull, sent
        self.flags = flags  # the frame's (frames.AVERAGED)

    @property
    def direct(self) -> bool:  # type: ignore[override]
        return len(self.payload) <= DIRECT_REPLY_BYTES and self.sent is None

    def parts(self, link: Replier, header: memoryview, epoch: int, sender: int) -> tuple[list, int]:
        payload, size = self.payload, len(self.payload)
        if self.pull != shm.NO_SLOT and link.arena is not None:
            # the worker offered a shared pull slot: one memcpy here, none through the kernel
            np.copyto(link.arena.pull_slot(self.pull, size), np.frombuffer(payload, np.uint8))
            shared = (frames.SHM_PAYLOAD | self.flags, self.pull)
            frames.pack_header_into(
                header, FrameType.RESULT, size, self.dtype, epoch, sender, self.key, self.round, *shared
            )
            return [header], size
        frames.pack_header_into(
            header, FrameType.RESULT, size, self.dtype, epoch, sender, self.key, self.round, self.flags
        )
        return [header, payload], size


class AckReply(ReplyItem):
    """A contribution is in (it frees a place in the worker's window). Consecutive ones travel in one ACKS frame
    (`frames_of`)."""

    __slots__ = ("round",)
    direct = True

    def __init__(self, key: int, rnd: int) -> None:
        self.key, self.round = key, rnd


class EveryoneReply(AckReply):
    """Every worker answered has this held round's sum (server/receipts.py): the worker's call may complete.
    Consecutive ones travel in one EVERYONE frame (`frames_of`)."""

    __slots__ = ()


_ENTRY_FRAMES = {AckReply: FrameType.ACKS, EveryoneReply: FrameType.EVERYONE}  # replies merged into one frame each


class ErrorReply(ReplyItem):
    """An ERROR for a key: queued like the rest, so it cannot overtake the key's ACK."""

    __slots__ = ("message",)

    def __init__(self, key: int, message: str) -> None:
        self.key, self.message = key, message

    def parts(self, link: Replier, header: memoryview, epoch: int, sender: int) -> tuple[list, int]:
        return [frames.encode_json(FrameType.ERROR, {"message": self.message}, key=self.key)], 0


class RestReply(ReplyItem):
    """The part of a send that a send without waiting left over: the replier sends it before anything else."""

    __slots__ = ("pulled", "views")

    def __init__(self, views: list[memoryview], pulled: int) -> None:
        self.key, self.views, self.pulled = -1, views, pulled  # pulled: the sums' bytes in it (0: ACKs only)

    def parts(self, link: Replier, header: memoryview, epoch: int, sender: int) -> tuple[list, int]:
        return self.views, self.pulled


def frames_of(link: Replier, items: list[ReplyItem], epoch: int, sender: int) -> tuple[list, int]:
    """The parts of one send carrying `items` in order (consecutive ACKs merged into ACKS frames, consecutive
    EVERYONEs into EVERYONE frames), and the bytes of sums among them. The headers are packed into one buffer made for
    the batch: nothing the send leaves over refers to memory that a later batch reuses."""
    size, ack = frames.HEADER_SIZE, frames.ACK_ENTRY
    entries = sum(1 for item in items if type(item) in _ENTRY_FRAMES)
    buffer = memoryview(bytearray(size * len(items) + ack.size * entries))
    parts: list = []
    pulled = at = i = 0
    while i < len(items):
        item = items[i]
        kind = type(item)
        if kind not in _ENTRY_FRAMES:
            more, sums = item.parts(link, buffer[at : at + size], epoch, sender)
            parts += more
            pulled += sums
            at += size
            i += 1
            continue
        start = at
        at += size
        count = 0
        while i < len(items) and type(items[i]) is kind and count < MAX_ACKS:
            ack.pack_into(buffer, at, items[i].key, items[i].round)  # type: ignore[attr-defined]
            at += ack.size
            count += 1
            i += 1
        body = count * ack.size
        frames.pack_header_into(buffer[start : start + size], _ENTRY_FRAMES[kind], body, 0, epoch, sender, 0, 0)
        parts.append(buffer[start:at])
    return parts, pulled


class HeldReplies:
    """The replies an engine's thread makes while it handles one batch of its ring, held per worker link and sent
    when the batch ends (module docstring). Replies made on any other thread (an answer once a replica has an update)
    go at once, behind what is held for that worker."""

    def __init__(self) -> None:
        self._local = threading.local()

    def begin(self) -> None:
        """The calling thread (an engine's) holds its replies from now on, until each `flush`."""
        self._local.links = set()

    def reply(self, link: Replier, item: ReplyItem) -> None:
        links = getattr(self._local, "links", None)
        if links is None:
            link.reply(item)
            return
        link.hold(item)
        links.add(link)

    def flush(self) -> None:
        """Send what this thread holds (the end of its batch)."""
        links = self._local.links
        for link in links:
            link.flush()
        links.clear()


class Replier:
    """The server's end of one worker's connection: the reply queue with its thread, and the worker's shared slots (the
    link loop reads the connection: reader.py)."""

    def __init__(self, conn: tcp.Connection, metrics: Metrics | None = None) -> None:
        self.conn = conn
        self.metrics = metrics or Metrics("server")
        self.replies: queue.SimpleQueue = queue.SimpleQueue()  # lists of replies, sent in order, each in one go
        self.arena: shm.Arena | None = None  # shared slots, when the worker is on this host
        self._users = 2  # the reader and the replier: the shared slots are unmapped when both are done
        self._users_lock = threading.Lock()
        # replies held (an engine's batch: HeldReplies), and sends queued or being sent by the replier: a send at once
        # must not overtake either (`reply`)
        self._held: list[ReplyItem] = []
        self._queued = 0
        self._order = threading.Lock()
        self._ids: tuple[int, int] | None = None  # (epoch, server rank) for headers, once the replier runs
        self.closer: Callable[[], None] | None = None  # closes it through the link loop (reader.py's Incoming)

    def close(self) -> None:
        """Stop serving this worker (from any thread): the link loop lets go of the connection and closes it."""
        if self.closer is not None:
            self.closer()
        else:
            self.conn.close()

    def reply(self, item: ReplyItem) -> None:
        """Send a reply to this worker (a sum, an ACK or an ERROR), in order with every other reply to it: behind
        those held (`hold`), which go with it."""
        with self._order:
            self._held.append(item)
            self._send_held()

    def hold(self, item: ReplyItem) -> None:
        """Keep a reply to send with the next `flush` (or `reply`), in order."""
        with self._order:
            self._held.append(item)

    def flush(self) -> None:
        """Send the replies held."""
        with self._order:
            if self._held:
                self._send_held()

    def _send_held(self) -> None:
        """(Holding `_order`.) The held replies: over a socket, with nothing queued before them, the leading ACKs and
        small sums at once from this thread, as far as the socket takes them without waiting; the rest, and
        everything else, through the queue to the replier, so a slow worker never holds an engine."""
        items, self._held = self._held, []
        if self._queued == 0 and self._ids is not None and self.arena is None:
            direct = 0
            while direct < len(items) and items[direct].direct:
                direct += 1
            if direct:
                rest = self._send_now(items[:direct])
                items = items[direct:] if rest is None else [rest, *items[direct:]]
        if items:
            self._queued += 1
            self.replies.put(items)

    def _send_now(self, items: list[ReplyItem]) -> RestReply | None:
        """Send replies without waiting; None if the socket took them whole, else what is left, for the replier."""
        assert self._ids is not None
        parts, pulled = frames_of(self, items, *self._ids)
        rest = self.conn.send_nowait(parts)
        if not rest:
            if pulled:
                self.metrics.pulled(pulled)
            return None
        return RestReply(rest, pulled)

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
        while (items := self.replies.get()) is not None:
            sent = self._send_queued(items, epoch, sender)
            with self._order:
                self._queued -= 1
            if not sent:
                return

    def _send_queued(self, items: list[ReplyItem], epoch: int, sender: int) -> bool:
        """Send queued replies in one go; False if the connection failed."""
        parts, pulled = frames_of(self, items, epoch, sender)
        try:
            self.conn.send(parts)
        except GradwireError as e:
            log.warning("cannot reply to worker %d: %s", self.conn.peer_rank, e)
            return False
        for item in items:  # handed to the kernel (or copied into the worker's pull slot): the buffer is free for them
            if type(item) is ResultReply and item.sent is not None:
                item.sent.one()
        if pulled:
            self.metrics.pulled(pulled)
        return True
