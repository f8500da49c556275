"""The sending half of a worker's link to a server (`ServerLink`, worker/link.py, inherits it), run by the link loop
(transport/loop.py) after every pass: `pump` pushes what flow control lets go (worker/flow.py) and credit allows
(worker/credit.py), several small partitions to one send, and says whether the socket left bytes to send later.

A batch is the partitions flow control lets go together, within SEND_BATCH_BYTES and SEND_BATCH_FRAMES: small
partitions then cost one system call for several, and a large one still goes alone. A partition flow control let go
but whose credit (or pacing turn) is not there yet waits at the head of the next batch, so nothing overtakes it;
pacing never holds it past PACE_GIVE_UP_SECONDS. Receipts of held sums (RECEIVED) go ahead of the pushes.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from gradwire.errors import GradwireError, LocalProtocolError
from gradwire.protocol import frames
from gradwire.protocol.frames import HELD, FrameType
from gradwire.transport import shm
from gradwire.worker import credit as credits
from gradwire.worker.flow import LIVENESS_SECONDS
from gradwire.worker.link_state import LinkState
from gradwire.worker.work import Work

log = logging.getLogger("gradwire.worker")
SEND_BATCH_BYTES = 256 << 10
SEND_BATCH_FRAMES = 64


class Pushes(LinkState):
    """What the link loop does to send a link's frames; the state is the link's (worker/link_state.py)."""

    def _init_pushes(self) -> None:
        self._headers = memoryview(bytearray(frames.HEADER_SIZE * SEND_BATCH_FRAMES))
        self._unsent: list[memoryview] = []  # what the socket did not take yet of the last frames
        self._unsent_pushes: list[Work] = []  # the pushes among them
        self._waiting: list[Work] = []  # let go by flow control, waiting for credit or their pacing turn
        self._turn_since: float | None = None  # since when the head of `_waiting` has waited

    def pump(self, now: float) -> bool:
        """Send what may go now (module docstring); whether bytes are left for the socket to take later."""
        try:
            return self._pump(now)
        except GradwireError as e:
            self._broken(e)
        except Exception as e:  # a bug here must fail this link's calls with its cause, not leave them waiting
            log.exception("worker %d: the sender to server %d failed", self.rank, self.server)
            self.close(LocalProtocolError(f"worker {self.rank}: the sender to server {self.server} failed: {e!r}"))
        return False

    def needs_pump(self, now: float) -> bool:
        """Whether `pump` may have something to do: the link is `dirty` (a submit, an acknowledgement or answer, a
        receipt, new limits, a writable socket), a push waits for credit (any link's acknowledgement may give it
        back), or the time `wake_at` asked for has come. The loop asks before each pump (most passes are for one
        link)."""
        if self.dirty or self._waiting:
            return True
        at = self.wake_at()
        return at is not None and at <= now

    def _pump(self, now: float) -> bool:
        self.dirty = False  # before the state is read: a change after it sets it again
        while self._closed is None and self.lost is None:
            if not self._unsent:
                self._unsent, self._unsent_pushes = self._next_frames(now)
                if not self._unsent:
                    return False
            self.conn.send_some(self._unsent)
            if self._unsent:
                return True
            pushes, self._unsent_pushes = self._unsent_pushes, []
            self._pushed(pushes)
        return False

    def wake_at(self) -> float | None:
        """When to pump again with no other event: with partitions waiting, the end of their wait for a pacing turn
        (None if they wait for credit: an acknowledgement gives it back); else the liveness rule's time
        (worker/flow.py), which cannot let a partition go before the waiting ones."""
        if self._waiting:
            return None if self._turn_since is None else self._turn_since + credits.PACE_GIVE_UP_SECONDS
        return self.flow.wake_at()

    def _next_frames(self, now: float) -> tuple[list[memoryview], list[Work]]:
        """The frames to send next and the pushes among them: receipts, then a batch."""
        with self._lock:
            receipts = self.holds.take_receipts()
            batch, self._waiting = (self._waiting, []) if self._waiting else (self._batch(now), [])
        parts: list[memoryview] = []
        if receipts:
            received = frames.encode_entries(FrameType.RECEIVED, receipts, epoch=self.epoch, sender=self.rank)
            parts.append(memoryview(received))
        pushes: list[Work] = []
        for i, work in enumerate(batch):
            header = self._headers[i * frames.HEADER_SIZE : (i + 1) * frames.HEADER_SIZE]
            if work.seed:  # a sum (SEED) or a contribution (REPLAY) for the key's new server: no credit, never shared
                self._pack_push(header, work, work.seed)
                parts += (header, work.send)
                continue
            if not self._credit_for(work, now):
                self._waiting = batch[i:]
                break
            pushes.append(work)
            parts += self._push_frame(header, work)
        return parts, pushes  # memoryviews of bytes each (Work.send and .extra are)

    def _credit_for(self, work: Work, now: float) -> bool:
        """Take `work`'s credit if it is there and its pacing turn has come, or it has waited for that turn long
        enough; else note since when it waits for its turn (not while it is short of credit: no timer needed)."""
        waited = self._turn_since is not None and now - self._turn_since >= credits.PACE_GIVE_UP_SECONDS
        if not self.credit.take(work.push_bytes, self.server, self.network, paced=not waited):
            if waited or self.credit.may_send(self.server):
                self._turn_since = None  # short of credit, not of a turn
            elif self._turn_since is None:
                self._turn_since = now
            return False
        if waited:
            log.debug("pacing: the link to server %d waited %.1f s; it goes", self.server, now - self._turn_since)
        self._turn_since = None
        work.credited = True
        work.t_sent = now
        if self.timeline:
            self.timeline.counter("bytes in flight", now, self.credit.used)
        return True

    def _push_frame(self, header: memoryview, work: Work) -> tuple:
        """The buffers of `work`'s PUSHPULL frame: its header and payload, or (shared memory) its header alone."""
        if self.arena is not None:
            work.push_slot = self._free_push.pop()
            work.pull_slot = self._free_pull.pop() if self._free_pull else shm.NO_SLOT
            return (self._push_shared(header, work),)
        self._pack_push(header, work)
        return (header, work.send) if work.extra is None else (header, work.send, work.extra)

    def _pushed(self, pushes: list[Work]) -> None:
        """The socket has taken these pushes whole: stamped and counted."""
        if pushes:
            now = time.monotonic()
            for work in pushes:
                work.t_pushed = now
            self.metrics.pushed(sum(work.push_bytes for work in pushes))

    def _pack_push(self, header: memoryview, work: Work, flags: int = 0, status: int = 0) -> None:
        """The PUSHPULL header of `work` into `header`."""
        if work.held:
            flags |= HELD
        frames.pack_header_into(
            header,
            FrameType.PUSHPULL,
            work.push_bytes,
            work.dtype,
            self.epoch,
            self.rank,
            work.key,
            work.round,
            flags,
            status,
        )

    def _batch(self, now: float) -> list[Work]:
        """(Holding the lock.) The next partitions flow control lets go, taken off the queue: the first, and with it
        those that follow at once up to SEND_BATCH_BYTES and SEND_BATCH_FRAMES."""
        work = self._next(now)
        if work is None:
            return []
        batch, size, queued = [work], work.push_bytes, self.flow.queued
        while len(batch) < SEND_BATCH_FRAMES and queued and size + queued[0][2].push_bytes <= SEND_BATCH_BYTES:
            more = self._next(now)
            if more is None:
                break
            batch.append(more)
            size += more.push_bytes
        return batch

    def _next(self, now: float) -> Work | None:
        """`Flow.next`, with a warning where the liveness rule let a partition go."""
        escapes = self.flow.cap_escapes
        work = self.flow.next(now)
        if self.flow.cap_escapes != escapes:
            log.warning(
                "worker %d: the cap on unanswered partitions to server %d held every queued partition for %.1f s with "
                "no answer; sending one anyway (workers pushing keys in different orders and waiting in between)",
                self.rank,
                self.server,
                LIVENESS_SECONDS,
            )
        return work

    def _push_shared(self, header: memoryview, work: Work) -> memoryview:
        """Copy the partition into its push slot; returns its header, the frame to send (transport/shm.py)."""
        assert self.arena is not None
        slot = self.arena.push_slot(work.push_slot, work.push_bytes)
        np.copyto(slot[: len(work.send)], np.frombuffer(work.send, np.uint8))
        if work.extra is not None:
            np.copyto(slot[len(work.send) :], np.frombuffer(work.extra, np.uint8))
        self._pack_push(header, work, frames.SHM_PAYLOAD, work.push_slot | (work.pull_slot << 16))
        return header
