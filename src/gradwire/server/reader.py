"""The readers: what a server does with the frames its workers send. The server's link loop (transport/loop.py) reads
every worker connection without waiting (`Incoming`, one per connection): each frame is checked against its key's
declaration, a slot is claimed in the ring of the engine that owns the key, the payload is received straight into it
(or into the key's landing buffer, or found in the worker's shared push slot) as it arrives, and the slot is
published. Per server whose keys this one replicates, a thread does the same for the updates it forwards
(`serve_replica`). Every slot a server fills is claimed by `claim` or `Ring.try_claim`; a frame's is published by
`publish` (control.py publishes its join and departure events itself).

On the loop nothing waits: each connection's frames are decoded by a `FrameDecoder` (protocol/decoder.py) whose sink
is the connection; a payload cut off by the socket is resumed where it stopped; a frame whose engine's ring is full
keeps its header in the decoder and waits until the engine frees a slot (`Ring.on_space` wakes the loop); a frame begun
and not continued within GRADWIRE_FRAME_TIMEOUT fails its connection, as a blocking receive's timeout did (its slot is
published empty, so the engine never waits on it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from gradwire.errors import GradwireError, GradwireTimeout, RemoteProtocolError
from gradwire.protocol import frames
from gradwire.protocol.decoder import EMPTY, FrameDecoder
from gradwire.protocol.frames import REPLAY, REPLICA, SEED, SHM_PAYLOAD, FrameType
from gradwire.ring import Ring, RingClosed
from gradwire.server.engine import Engine
from gradwire.server.replier import ErrorReply, Replier
from gradwire.server.slot import JOIN_EVENT, Slot
from gradwire.server.state import ServerState
from gradwire.transport import endpoints, shm, tcp

log = logging.getLogger("gradwire.server")


def claim(ring: Ring[Slot]) -> tuple[int, Slot]:
    """The next slot of `ring` to fill, marked empty until it is (`publish` hands it to the engine either way)."""
    seq = ring.claim()
    slot = ring.slot(seq)
    slot.valid = slot.landed = False
    return seq, slot


def publish(ring: Ring[Slot], seq: int, slot: Slot, conn: object, header: frames.Header, sender: int) -> None:
    """Hand the slot to the engine with the frame's fields (also one whose payload did not arrive: `slot.valid` is
    then False, and the engine skips it; a slot never published would stall the ring)."""
    slot.conn, slot.key, slot.round, slot.dtype = conn, header.key, header.round, header.dtype
    slot.length, slot.sender, slot.flags = header.length, sender, header.flags
    ring.publish(seq)


class Incoming:
    """One worker connection on the server's link loop (transport/loop.py's `LoopLink`), and the sink of its frame
    decoder: where each frame's payload goes, and what follows once it is in. Its frames are the `Reader`'s to apply;
    it has nothing to push (replies go from the engines and the repliers: replier.py)."""

    dirty = False

    def __init__(self, link: Replier, reader: Reader, on_closed: Callable[[Incoming], None]) -> None:
        self.link, self.conn = link, link.conn
        self._reader = reader
        self._on_closed = on_closed
        self.decoder = FrameDecoder(link.conn.max_payload)
        self.decoder.feed(link.conn.take_read_ahead())
        self.then: Callable[[memoryview], None] | None = None  # what follows the payload being received
        self.push_in = lambda _: reader.pushed(self)  # what follows a push's payload
        self.claimed: tuple[Ring, int, Slot, frames.Header] | None = None  # the ring slot a push is received for
        self.waiting = False  # a push's engine's ring was full: the decoder holds its header until it has room
        self.deadline: float | None = None  # a frame begun must go on arriving by then (GRADWIRE_FRAME_TIMEOUT)
        self.ended = False
        self.fresh = True  # the handshake may have read its first frames ahead: read them on the first pass
        link.closer = lambda: reader.end(self)

    def __repr__(self) -> str:
        return f"<Incoming from worker {self.conn.peer_rank} at {self.conn.peer}>"

    def fileno(self) -> int:
        return self.conn.sock.fileno()

    def on_readable(self) -> None:
        self._reader.on_readable(self)

    @property
    def expecting(self) -> bool:
        """Whether to go on reading (the decoder's sink)."""
        return not self.ended

    def destination(self, header: frames.Header) -> memoryview | np.ndarray | None:
        return self._reader.destination(self, header)

    def arrived(self, header: frames.Header, data: memoryview) -> None:
        then, self.then = self.then, None
        assert then is not None
        then(data)

    def pump(self, now: float) -> bool:
        self._reader.on_time(self, now)
        return False

    def needs_pump(self, now: float) -> bool:
        return self.fresh or self.waiting or (self.deadline is not None and now >= self.deadline)

    def wake_at(self) -> float | None:
        return self.deadline

    def on_removed(self) -> None:
        self.ended = True
        self._reader.unclaim(self)
        self._on_closed(self)

    def on_error(self, error: Exception) -> None:
        """A bug escaped the reader (the loop logged it and removes this connection: `on_removed` cleans up)."""


class Reader:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self._scratch = np.empty(1 << 16, np.uint8)  # where refused payloads are read and dropped

    # -- a worker connection's frames, on the link loop ------------------------------------------------------------

    def on_readable(self, incoming: Incoming) -> None:
        """Read and apply every frame the connection holds now (module docstring)."""
        try:
            self._read_frames(incoming)
        except (GradwireError, RingClosed) as e:
            self.end(incoming, e)

    def on_time(self, incoming: Incoming, now: float) -> None:
        """A frame begun and cut off past its deadline fails the connection; a push that waited for a ring slot tries
        again; a connection just added reads what its handshake read ahead."""
        if incoming.fresh:
            incoming.fresh = False
            self.on_readable(incoming)
        elif incoming.deadline is not None and now >= incoming.deadline:
            timeout = self.state.config.frame_timeout
            self.end(incoming, GradwireTimeout(f"a frame begun has not gone on arriving for {timeout:g}s"))
        elif incoming.waiting:
            self.on_readable(incoming)

    def end(self, incoming: Incoming, error: BaseException | None = None) -> None:
        """Stop reading the connection (a BYE, an error, or the server closing it: `Replier.close`, from any
        thread): it leaves the loop, which then closes it (`Incoming.on_removed`)."""
        if error is not None and not incoming.ended and not self.state.done.is_set():
            # a worker that went away is routine (it is named elsewhere); a bad frame is not
            routine = isinstance(error, tcp.ConnectionClosed)
            conn = incoming.conn
            (log.info if routine else log.warning)(
                "closing connection to worker %d (%s): %s", conn.peer_rank, conn.peer, error
            )
        incoming.ended = True
        self.state.loop.remove(incoming)

    def unclaim(self, incoming: Incoming) -> None:
        """A push cut off for good: its slot goes to the engine empty (a slot never published would stall the ring)."""
        if incoming.claimed is not None:
            ring, seq, slot, header = incoming.claimed
            incoming.claimed = None
            slot.valid = False
            publish(ring, seq, slot, incoming.conn, header, header.sender)

    def _read_frames(self, incoming: Incoming) -> None:
        incoming.waiting = False
        incoming.decoder.receive(incoming.conn.recv_nowait, incoming)
        begun = incoming.decoder.mid_frame and not incoming.waiting
        incoming.deadline = time.monotonic() + self.state.config.frame_timeout if begun else None

    def destination(self, incoming: Incoming, header: frames.Header) -> memoryview | np.ndarray | None:
        """Where one frame's payload goes, the frame checked (its `then` set); None if it must wait for a ring slot
        (asked again later)."""
        link, state = incoming.link, self.state
        kind = header.type
        if kind == FrameType.PUSHPULL and not header.flags & (REPLICA | JOIN_EVENT):
            if header.sender != link.conn.peer_rank or header.epoch != state.epoch:
                raise RemoteProtocolError(
                    f"frame claims sender {header.sender} epoch {header.epoch}; connection is worker "
                    f"{link.conn.peer_rank} in epoch {state.epoch}"
                )
            into = self._on_push(incoming, header)
            incoming.waiting = into is None
            return into
        if kind == FrameType.BYE:
            incoming.then = lambda _: self.end(incoming)
        elif kind == FrameType.SHM_ATTACH:
            incoming.then = lambda body: self.attach(link, frames.decode_json(body.tobytes()))
        elif kind == FrameType.RECEIVED:  # sums of held keys are in its outputs (server/receipts.py)
            incoming.then = lambda body: self.received(link.conn, header, body)
        else:
            raise RemoteProtocolError(f"unexpected {kind.name} frame (flags {header.flags:#x})")
        return np.empty(header.length, np.uint8)  # a control frame's body (its length was checked with its header)

    def _on_push(self, incoming: Incoming, header: frames.Header) -> memoryview | np.ndarray | None:
        link = incoming.link
        in_shm = header.flags & SHM_PAYLOAD
        engine = self.state.engine_of(header.key)
        problem = engine.check(header.key, header.dtype, header.length)
        if problem is not None:  # the tensor's error, not the server's: refuse it, keep the stream in sync
            incoming.then = lambda _: link.reply(ErrorReply(header.key, problem))
            return EMPTY if in_shm else self._scratch_of(header.length)
        if in_shm:
            push, pull = check_slots(link, header)
        seq = engine.ring.try_claim()
        if seq is None and engine.inline:  # the engine runs on this thread: let it free what it can now
            engine.handle_published()
            seq = engine.ring.try_claim()
        if seq is None:
            return None
        slot = engine.ring.slot(seq)
        slot.valid = slot.landed = False
        incoming.claimed = (engine.ring, seq, slot, header)
        if in_shm:  # the payload already lies in the worker's push slot: the engine sums from there
            assert link.arena is not None
            slot.data, slot.pull = link.arena.push_slot(push, header.length), pull
            incoming.then = incoming.push_in
            return EMPTY
        incoming.then = incoming.push_in
        return landing_of(engine, slot, header)

    def pushed(self, incoming: Incoming) -> None:
        """A push's payload is in whole: its slot goes to the engine."""
        assert incoming.claimed is not None
        ring, seq, slot, header = incoming.claimed
        incoming.claimed = None
        slot.valid = True
        self.state.metrics.pushed(header.length)
        publish(ring, seq, slot, incoming.conn, header, header.sender)

    def _scratch_of(self, length: int) -> np.ndarray:
        """Where a refused payload is read and dropped (one buffer, grown to the largest)."""
        if len(self._scratch) < length:
            self._scratch = np.empty(length, np.uint8)
        return self._scratch[:length]

    def received(self, conn: tcp.Connection, header: frames.Header, body: memoryview) -> None:
        """A RECEIVED frame: the worker has these held rounds' sums (server/receipts.py)."""
        if header.sender != conn.peer_rank or header.epoch != self.state.epoch or self.state.receipts is None:
            raise RemoteProtocolError(
                f"RECEIVED claims sender {header.sender} epoch {header.epoch}; connection is worker {conn.peer_rank} "
                f"in epoch {self.state.epoch}"
            )
        self.state.receipts.received(conn.peer_rank, list(frames.ACK_ENTRY.iter_unpack(body)))

    def serve_replica(self, conn: tcp.Connection) -> None:
        """Read the updates a primary server forwards (its keys' replicas are here) into the rings, as worker pushes
        are; the engines apply them and acknowledge (server/replica.py)."""
        state = self.state
        endpoints.set_frame_timeout(conn.sock, state.config.frame_timeout)
        try:
            while True:
                header = conn.recv_header(idle_ok=True)
                if header.type == FrameType.BYE:
                    return
                if header.type != FrameType.PUSHPULL or not header.flags & REPLICA or header.flags & JOIN_EVENT:
                    raise RemoteProtocolError(f"unexpected {header.type.name} frame from server {conn.peer_rank}")
                engine = state.engine_of(header.key)
                problem = engine.check(header.key, header.dtype, header.length)
                if problem is not None:
                    raise RemoteProtocolError(f"replicated update: {problem}")
                seq, slot = claim(engine.ring)
                try:
                    landing = engine.replica_landing(header.key, header.round, header.length)
                    slot.landed = landing is not None
                    into = landing if landing is not None else slot.array[: header.length]
                    conn.recv_into(memoryview(into))
                    slot.data, slot.valid = into, True
                finally:
                    slot.pull = header.status  # the update's number, which the acknowledgement echoes
                    publish(engine.ring, seq, slot, conn, header, 0)
        except (GradwireError, RingClosed) as e:
            if not state.done.is_set():
                log.warning("closing the replica connection from server %d: %s", conn.peer_rank, e)
        finally:
            conn.close()

    def attach(self, link: Replier, body: dict, mapped: Callable[[shm.Arena], None] | None = None) -> None:
        """Map the worker's shared slots (transport/shm.py), hand them to `mapped` (the native loop, which must have
        them before the worker hears it may use them), and say whether it worked."""
        try:
            arena = self.map_arena(link, body)
            if mapped is not None:
                mapped(arena)
            link.conn.send_json(FrameType.SHM_ATTACH, {"ok": True})
        except (KeyError, ValueError, OSError, RemoteProtocolError) as e:
            log.info("worker %d: shared memory not used: %s", link.conn.peer_rank, e)
            link.conn.send_json(FrameType.SHM_ATTACH, {"ok": False, "error": str(e)})

    def map_arena(self, link: Replier, body: dict) -> shm.Arena:
        """The worker's shared slots that a SHM_ATTACH frame names, checked and mapped (the link's from now on)."""
        push, pull, slot_bytes = int(body["push"]), int(body["pull"]), int(body["slot_bytes"])
        path = str(body["path"])
        if link.arena is not None or not path.startswith(shm.SHM_DIR + "/gradwire-") or "/" in path[9:]:
            raise RemoteProtocolError(f"refusing shared memory at {path!r}")
        if slot_bytes > self.state.config.max_frame_bytes or push + pull > 1024:
            raise RemoteProtocolError(f"shared memory of {push}+{pull} slots of {slot_bytes} bytes is too large")
        link.arena = shm.Arena(path, push, pull, slot_bytes, create=False)
        return link.arena


def landing_of(engine: Engine, slot: Slot, header: frames.Header) -> np.ndarray:
    """Where a push's payload is received from the socket, noted in its ring slot: the key's landing buffer, where the
    engine sums it without a copy (deterministic sums: server/staging.py), or else the slot's own memory. A seed or a
    replay may be stale (dropped by the engine): never into a landing buffer in use."""
    resent = header.flags & (SEED | REPLAY)
    landing = None if resent else engine.landing(header.key, header.round, header.sender)
    slot.landed = landing is not None
    into = landing[: header.length] if landing is not None else slot.array[: header.length]
    slot.data, slot.pull = into, shm.NO_SLOT
    return into


def check_slots(link: Replier, header: frames.Header) -> tuple[int, int]:
    """The worker's shared push and pull slots a push names, checked against its arena."""
    arena = link.arena
    push, pull = header.status & 0xFFFF, header.status >> 16
    if arena is None or push >= arena.push or header.length > arena.slot_bytes:
        raise RemoteProtocolError(f"bad shared push slot {push} for {header.length} bytes")
    if pull != shm.NO_SLOT and pull >= arena.pull:
        raise RemoteProtocolError(f"bad shared pull slot {pull}")
    return push, pull
