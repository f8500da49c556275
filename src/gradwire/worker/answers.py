"""The receiving half of a worker's link to a server (`ServerLink`, worker/link.py, inherits it), run by the link loop
(transport/loop.py) whenever the socket has bytes: `on_readable` decodes every frame that has arrived, without waiting
(protocol/decoder.py's `FrameDecoder`, whose sink the link is), and applies it. ACKS (a batch of the server engine's
acknowledgements: window places and credit freed, for the loop's next pass to fill), RESULT (a partition's sum, read
straight into its key's seed copy or its output, then delivered and recorded; a held key's is held there:
worker/holding.py), EVERYONE (every worker has these held sums: their partitions are done), ERROR (a tensor refused:
its handle fails; or the job's abort). A frame whose payload has not all arrived is resumed on the next call where it
stopped."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from gradwire.errors import GradwireError, LocalProtocolError, RemoteProtocolError, TensorError, abort_error
from gradwire.protocol import frames
from gradwire.protocol.decoder import EMPTY, FrameDecoder
from gradwire.protocol.frames import SHM_PAYLOAD, FrameType
from gradwire.transport import shm
from gradwire.worker.holding import release
from gradwire.worker.link_state import LinkState
from gradwire.worker.work import Seed, Work

log = logging.getLogger("gradwire.worker")


class Answers(LinkState):
    """What the link loop does with what a link receives; the state is the link's (worker/link_state.py)."""

    def _init_answers(self) -> None:
        self._decoder = FrameDecoder(self.conn.max_payload)
        self._decoder.feed(self.conn.take_read_ahead())
        self._then: Callable[[memoryview], None] | None = None  # what follows the payload being received

    @property
    def expecting(self) -> bool:
        """Whether to go on reading: the link is open (the decoder's sink)."""
        return self._closed is None and self.lost is None

    def on_readable(self) -> None:
        """Read and apply every frame the socket holds now (module docstring)."""
        try:
            self._read_frames()
        except GradwireError as e:
            self._broken(e)
        except Exception as e:  # as in Pushes.pump
            log.exception("worker %d: the receiver from server %d failed", self.rank, self.server)
            self.close(LocalProtocolError(f"worker {self.rank}: the receiver from server {self.server} failed: {e!r}"))

    def _read_frames(self) -> None:
        self._decoder.receive(self.conn.recv_nowait, self)

    def destination(self, header: frames.Header) -> memoryview | np.ndarray:
        """Where the frame's payload goes, checked, with what follows it once in (`arrived`)."""
        if header.type == FrameType.RESULT:
            return self._on_result(header)
        if header.type == FrameType.ACKS:
            self._then = self._on_acks
        elif header.type == FrameType.EVERYONE:
            self._then = self._on_everyone
        elif header.type == FrameType.ERROR:
            self._then = lambda body: self._on_error(header, frames.decode_json(body.tobytes()))
        else:
            raise RemoteProtocolError(f"server {self.server} sent an unexpected {header.type.name}")
        return np.empty(header.length, np.uint8)  # a control frame's body (its length was checked with its header)

    def arrived(self, header: frames.Header, data: memoryview) -> None:
        then, self._then = self._then, None
        assert then is not None
        then(data)

    def _take(self, key: int, answered_at: float | None = None) -> Work:
        """`key`'s contribution is acknowledged, or (`answered_at`: when its sum began to arrive) answered."""
        with self._lock:
            taken = self.flow.on_ack(key) if answered_at is None else self.flow.on_answer(key, answered_at)
            if taken is None:
                raise RemoteProtocolError(f"server {self.server} answered key {key:016x}, which is not in flight")
            work, newly_acked = taken
            self.dirty = True  # a window place or an unanswered place is free
            if newly_acked:
                if work.push_slot != shm.NO_SLOT:  # the server has summed it: the slot may take the next push
                    self._free_push.append(work.push_slot)
                    work.push_slot = shm.NO_SLOT
        if newly_acked:
            self.credit.release(work.push_bytes, self.network)
        return work

    def _on_acks(self, body: memoryview) -> None:
        """The server has these contributions (an ACKS frame: one batch of its engine's): their window places and
        credit are free."""
        freed: list[int] = []
        with self._lock:
            for key, rnd in frames.ACK_ENTRY.iter_unpack(body):
                taken = self.flow.on_ack(key)
                if taken is None:
                    raise RemoteProtocolError(f"server {self.server} acknowledged key {key:016x}, not in flight")
                work, newly_acked = taken
                if rnd != work.round:
                    raise RemoteProtocolError(
                        f"server {self.server} acknowledged round {rnd} of {work.tensor!r}, expected {work.round}"
                    )
                if newly_acked:
                    if work.push_slot != shm.NO_SLOT:  # the server has summed it: the slot may take the next push
                        self._free_push.append(work.push_slot)
                        work.push_slot = shm.NO_SLOT
                    freed.append(work.push_bytes)
            self.dirty = True
        if freed:
            self.credit.release_all(freed, self.network)

    def _on_result(self, header: frames.Header) -> memoryview | np.ndarray:
        """Where a sum goes: its key's seed copy or its output (or nowhere: it lies in a shared pull slot)."""
        with self._lock:  # answered (Flow.on_answer) only once the sum is in whole: cut off, it is pushed again
            work = self.flow.pending.get(header.key)
        if work is None:
            raise RemoteProtocolError(f"server {self.server} answered key {header.key:016x}, which is not in flight")
        work.t_result = time.monotonic()
        if not work.t_pushed:  # the answer came before the socket took the whole push (a loaded machine)
            work.t_pushed = work.t_result
        if header.round != work.round or header.length != work.nbytes:
            raise RemoteProtocolError(
                f"server {self.server} answered {work.tensor!r} round {header.round} with {header.length} bytes; "
                f"expected round {work.round} with {work.nbytes}"
            )
        if work.held and self.seeds is not None:
            return self._on_held_result(work, header)
        if header.flags & frames.AVERAGED:  # only a held key's seed is sent averaged
            raise RemoteProtocolError(f"server {self.server} answered {work.tensor!r}, not held, with an averaged sum")
        seed = Seed.of(self.seeds, work) if self.seeds is not None else None
        into = seed.data if seed is not None else work.out.reshape(-1).view(np.uint8)
        if header.flags & SHM_PAYLOAD:
            np.copyto(into, self._pulled(work, header))
            into = EMPTY
        self._then = lambda _: self._result_in(work, seed)
        return into

    def _result_in(self, work: Work, seed: Seed | None) -> None:
        """`work`'s sum is in whole: answered, delivered, recorded."""
        self._take(work.key, answered_at=work.t_result)
        self._free_pull_slot(work)
        work.deliver(seed)
        self._record(work, time.monotonic())
        assert work.handle is not None
        work.handle.part_done()

    def _on_held_result(self, work: Work, header: frames.Header) -> memoryview | np.ndarray:
        """A held key's sum: from the shared slot, or over the socket into the output (in place, into a buffer of one
        partition: a sum cut off mid-frame must not overwrite the contribution pushed again), averaged into the
        output in the same pass; it stays there until every worker has it (`_on_everyone`)."""
        averaged = bool(header.flags & frames.AVERAGED)
        shared = header.flags & SHM_PAYLOAD
        received = self._pulled(work, header) if shared else self.holds.into(work)
        self._then = lambda _: self._held_in(work, received, averaged)
        return EMPTY if shared else received

    def _held_in(self, work: Work, received: np.ndarray, averaged: bool) -> None:
        assert self.seeds is not None
        self._take(work.key, answered_at=work.t_result)
        self.holds.hold(work, received, self.seeds, averaged)
        self.dirty = True  # a receipt to send
        self._free_pull_slot(work)  # its bytes are in the output now

    def _pulled(self, work: Work, header: frames.Header) -> np.ndarray:
        """The answer in `work`'s shared pull slot (the server copied it there: SHM_PAYLOAD)."""
        if self.arena is None or header.status != work.pull_slot:
            raise RemoteProtocolError(f"server {self.server} answered in pull slot {header.status}, not ours")
        return self.arena.pull_slot(work.pull_slot, work.nbytes)

    def _free_pull_slot(self, work: Work) -> None:
        """`work`'s answer is out of its pull slot: the slot may take the next pull."""
        if work.pull_slot != shm.NO_SLOT:
            self._free_pull.append(work.pull_slot)
            work.pull_slot = shm.NO_SLOT

    def _on_everyone(self, body: memoryview) -> None:
        """Every worker has these held sums (an EVERYONE frame): their partitions are done."""
        assert self.seeds is not None
        for work in release(self.holds.everyone(list(frames.ACK_ENTRY.iter_unpack(body))), self.seeds):
            self.finish_held(work)

    def finish_held(self, work: Work) -> None:
        """A held partition's sum is needed for no failover any more: done."""
        self._record(work, time.monotonic())
        assert work.handle is not None
        work.handle.part_done()

    def _record(self, work: Work, done: float) -> None:
        """The partition's bytes pulled and its four stages, into the metrics and the timeline."""
        stages = work.stages(done)
        self.metrics.partition(work.nbytes, *(end - start for _, start, end in stages))
        if self.timeline:
            self.timeline.partition(
                work.tensor, work.key, work.round, work.nbytes, stages, self.server, done, self.credit.used
            )

    def _on_error(self, header: frames.Header, body: dict) -> None:
        if body.get("abort"):
            raise abort_error(body, server=self.server, rank=self.rank)
        work = self._take(header.key, answered_at=time.monotonic())
        work.handle.fail(
            TensorError(
                f"server {self.server} refused {work.tensor!r} (key {header.key:016x}): {body.get('message')}",
                tensor=work.tensor,
                server=self.server,
                rank=self.rank,
            )
        )
