"""A server's control connection to the scheduler: the keys it is to sum (KEYS), the workers that joined or left
(JOINED, DEPARTED), an elastic reset or a new generation (RESET), a standby's promotion (PROMOTE), and the job's end
(SHUTDOWN, ABORT).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from gradwire.errors import GradwireError, RemoteProtocolError, TensorError
from gradwire.protocol import dtypes, messages
from gradwire.protocol.frames import FrameType
from gradwire.scheduler import client
from gradwire.server import ops
from gradwire.server.held import Held
from gradwire.server.native_path import summed_natively
from gradwire.server.reader import claim
from gradwire.server.slot import DEPARTED_EVENT, JOIN_EVENT
from gradwire.server.state import ServerState

log = logging.getLogger("gradwire.server")


class ServerControl:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self._handlers: dict[type, Callable[[Any], None]] = {
            messages.Keys: self._declare_keys,
            messages.Reset: self._reset,
            messages.Joined: self._joined,
            messages.Departed: lambda m: self._set_joined([int(r) for r in m.ranks], DEPARTED_EVENT),
            messages.Promote: self._promote,
        }
        self.promise = client.Promise(state.config)  # to the scheduler in charge (scheduler/lease.py)
        self.at = 0  # which of GRADWIRE_SCHEDULER's and the standbys' addresses it is at

    def loop(self) -> None:
        """Serve the scheduler's messages until SHUTDOWN or ABORT; a lost connection ends the job for this server
        unless a scheduler resumes the job within GRADWIRE_SCHEDULER_TIMEOUT (the workers' links go on meanwhile)."""
        state = self.state
        self.promise.renew()
        while True:
            try:
                self._serve()
                return
            except GradwireError as e:
                self.promise.lost(state.scheduler, e)
                if state.done.is_set() or not self._resume(e):
                    return

    def _serve(self) -> None:
        state = self.state
        assert state.scheduler is not None
        self.promise.watch(state.scheduler)
        while True:
            _, body = state.scheduler.recv_json(FrameType.CONTROL)
            message = messages.parse(body)
            if isinstance(message, messages.Beat):
                self.promise.answer(state.scheduler, message)
            elif isinstance(message, messages.Shutdown):
                return
            if isinstance(message, messages.Abort):
                state.error = message.message
                self._tell_workers(message)
                return
            handler = self._handlers.get(type(message))
            if handler is not None:
                handler(message)

    def _resume(self, error: GradwireError) -> bool:
        """Wait for a scheduler to resume the job (scheduler/client.py `resume`); False: the job ends here."""
        state = self.state
        if state.config.scheduler_timeout <= 0:
            state.error = f"lost the scheduler: {error}"
            return False
        log.warning(
            "server %d lost the scheduler (%s); summing goes on, waiting up to %gs for a scheduler to resume the job",
            *(state.rank, error, state.config.scheduler_timeout),
        )
        if state.scheduler is not None:
            state.scheduler.close()
        try:
            state.scheduler, resumed, self.at = client.resume(
                state.config, self._report, state.term, state.done.is_set, self.at
            )
        except GradwireError as e:
            state.error = f"lost the scheduler ({error}), and {e}"
            return False
        state.term = resumed.term
        self.promise.renew()
        log.warning("server %d: the job resumed with the scheduler of term %d", state.rank, resumed.term)
        return True

    def _report(self) -> messages.Resume:
        """What this server tells a scheduler that resumes the job: who it is, and the keys it keeps for another
        server (a replica's: scheduler/recovery.py)."""
        state = self.state
        kept = [k for engine in state.engines for k, key in list(engine.keys.items()) if key.kept]
        registration = state.registration | {"standby": state.standby}
        where = ("server", state.rank, state.config.host)
        report = {"kept": kept, "scheduler": self.promise.report()}
        return messages.Resume.of(*where, (state.term, state.epoch), registration, report)

    def _reply(self, request_id: int) -> None:
        assert self.state.scheduler is not None
        self.state.scheduler.send_message(messages.Reply(request_id))

    def _declare_keys(self, body: messages.Keys) -> None:
        """Allocate the accumulators of keys this server owns, then tell the scheduler they are ready."""
        state = self.state
        name = body.name
        try:
            op = ops.build(body.key_op, body.op_args)
        except TensorError as e:
            raise RemoteProtocolError(str(e)) from None
        slices = body.slices or {}
        replicas = body.replicas or {}
        members = body.members
        if members is not None:
            members = sorted({int(r) for r in members})
            if not members or members[0] < 0 or members[-1] >= state.num_workers:
                raise RemoteProtocolError(f"scheduler declared {name!r} for ranks {members} of {state.num_workers}")
        for key, code, length in body.keys:
            key, length = int(key), int(length)
            dtype = dtypes.BY_CODE[int(code)]
            if not 0 <= length + op.trailer <= state.config.partition_bytes or length % dtype.itemsize:
                raise RemoteProtocolError(f"scheduler declared key {key:016x} with {length} bytes")
            cut = _slices(slices.get(str(key)), key, length, dtype.itemsize, state.num_workers)
            engine = state.engine_of(key)
            target = replicas.get(str(key))
            path = state.native
            if path is not None:  # summed by the native loop, or its pushes handed to the engines
                mine = key in path.names or key not in engine.keys and summed_natively(op, cut, body.kept, target)
                path.declare(key, dtype, length, name, members, mine)
                if mine:
                    continue
            engine.declare(key, dtype, length, name, op, cut, members)
            engine.keys[key].keep(body.kept)  # an owner's registration (a promotion) ends a replica's
            if target is not None and state.replicas is not None:  # its updates are replicated there
                address = (body.addresses or {})[str(target)]
                if state.replicas.ensure(int(target), address):
                    engine.keys[key].replica = int(target)
                    held = engine.keys[key].held
                    # a server-side optimizer's state (server/optimizer_op.py), not a residual
                    if isinstance(held, Held):
                        held.replica = int(target)
        self._reply(body.id)

    def _joined(self, body: messages.Joined) -> None:
        self._set_joined([int(r) for r in body.ranks])
        self._reply(body.id)

    def _set_joined(self, ranks: list[int], flags: int = 0) -> None:
        """The workers that have joined (hvd.join) changed, or (`flags` DEPARTED_EVENT) those that have left: each
        engine learns it through its ring, in order with the pushes it has already taken (so a round begun before
        goes on with zeros in their place, or fails at once)."""
        mask = 0
        for rank in ranks:
            if not 0 <= rank < self.state.num_workers:
                raise RemoteProtocolError(f"scheduler says worker {rank} joined or left, of {self.state.num_workers}")
            mask |= 1 << rank
        path = self.state.native
        if path is not None:  # its keys' rounds, in order with the pushes it has taken
            (path.loop.set_departed if flags & DEPARTED_EVENT else path.loop.set_joined)(mask)
        for engine in self.state.engines:
            seq, slot = claim(engine.ring)
            slot.valid, slot.flags, slot.key, slot.length, slot.conn = True, JOIN_EVENT | flags, mask, 0, None
            engine.ring.publish(seq)

    def _reset(self, body: messages.Reset) -> None:
        """Elastic: the workers changed. Drop every worker connection, let the engines drain, and start every key
        afresh for the new number of workers in the new epoch; then tell the scheduler. With `forget` (a new
        generation of workers after shutdown() and init()), every key is dropped: they declare theirs anew."""
        state = self.state
        epoch, num_workers, forget = body.epoch, body.num_workers, body.forget
        deadline = time.monotonic() + state.config.timeout
        with state.links_lock:
            state.epoch = epoch  # frames of the old epoch are refused from now on
            if state.native is not None:
                state.native.identify()
            links = list(state.links.values())
        for link in links:
            link.close()
        while (state.links or any(e.ring.occupancy for e in state.engines)) and time.monotonic() < deadline:
            time.sleep(0.001)
        for engine in state.engines:
            engine.reset(num_workers, forget=forget)
        if state.native is not None:
            state.native.loop.reset(num_workers, forget)
            if forget:
                state.native.names.clear()
        if state.receipts is not None:
            state.receipts.reset()
        state.set_workers(num_workers)
        generation = " (a new generation)" if forget else ""
        log.info("epoch %d: starting afresh with %d workers%s", epoch, num_workers, generation)
        self._reply(body.id)

    def _promote(self, body: messages.Promote) -> None:
        """A standby takes a dead server's place."""
        state = self.state
        state.rank, state.epoch, state.standby = body.rank, body.epoch, False
        if state.native is not None:
            state.native.identify()
        if state.replicas is not None:
            state.replicas.rank = state.rank
        self._reply(body.id)
        log.warning("standby promoted: now server %d (epoch %d)", state.rank, state.epoch)

    def _tell_workers(self, abort: messages.Abort) -> None:
        """Pass an abort on before closing, so workers report the cause (and a lost rank), not a closed socket."""
        body = abort.fields() | {"abort": True}
        for link in list(self.state.links.values()):
            try:
                link.conn.send_json(FrameType.ERROR, body)
            except GradwireError:
                pass


def _slices(cut: list | None, key: int, length: int, itemsize: int, num_workers: int) -> list[tuple[int, int]] | None:
    """A key's per-rank result slices as the scheduler declared them, checked."""
    if cut is None:
        return None
    cut = [(int(a), int(b)) for a, b in cut]
    bad = len(cut) != num_workers
    if bad or any(a < 0 or b < 0 or a + b > length or (a | b) % itemsize for a, b in cut):
        raise RemoteProtocolError(f"scheduler declared key {key:016x} with slices {cut}")
    return cut
