"""The readers: per worker connection a thread that checks each frame against its key's declaration, claims a slot in
the ring of the engine that owns the key, receives the payload straight into it (or into the key's landing buffer, or
finds it in the worker's shared push slot) and publishes it; and per server whose keys this one replicates, a thread
that does the same for the updates it forwards. Every slot a server fills is claimed by `claim`; a frame's is
published by `publish` (control.py publishes its join and departure events itself).
"""

from __future__ import annotations

import logging

from gradwire.errors import GradwireError, RemoteProtocolError
from gradwire.protocol import frames
from gradwire.protocol.frames import JOIN_EVENT, REPLAY, REPLICA, SEED, FrameType
from gradwire.ring import Ring, RingClosed, Slot
from gradwire.server.replier import WorkerLink
from gradwire.server.state import ServerState
from gradwire.transport import endpoints, shm, tcp

log = logging.getLogger("gradwire.server")


def claim(ring: Ring) -> tuple[int, Slot]:
    """The next slot of `ring` to fill, marked empty until it is (`publish` hands it to the engine either way)."""
    seq = ring.claim()
    slot = ring.slot(seq)
    slot.valid = slot.landed = False
    return seq, slot


def publish(ring: Ring, seq: int, slot: Slot, conn: object, header: frames.Header, sender: int) -> None:
    """Hand the slot to the engine with the frame's fields (also one whose payload did not arrive: `slot.valid` is
    then False, and the engine skips it; a slot never published would stall the ring)."""
    slot.conn, slot.key, slot.round, slot.dtype = conn, header.key, header.round, header.dtype
    slot.length, slot.sender, slot.flags = header.length, sender, header.flags
    ring.publish(seq)


class Reader:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self._scratch = bytearray(1 << 16)  # where refused payloads are read and dropped

    def read_loop(self, link: WorkerLink) -> None:
        """Read a worker's frames until its BYE (or an error, raised)."""
        conn, state, engines = link.conn, self.state, self.state.engines
        while True:
            header = conn.recv_header(idle_ok=True)
            if header.type == FrameType.BYE:
                return
            if header.type == FrameType.SHM_ATTACH:
                self.attach(link, frames.decode_json(conn.recv_body(header)))
                continue
            if header.type == FrameType.RECEIVED:  # sums of held keys are in its outputs (server/receipts.py)
                self._received(conn, header)
                continue
            if header.type != FrameType.PUSHPULL or header.flags & (REPLICA | JOIN_EVENT):
                raise RemoteProtocolError(f"unexpected {header.type.name} frame (flags {header.flags:#x})")
            if header.sender != conn.peer_rank or header.epoch != state.epoch:
                raise RemoteProtocolError(
                    f"frame claims sender {header.sender} epoch {header.epoch}; connection is worker "
                    f"{conn.peer_rank} in epoch {state.epoch}"
                )
            in_shm = header.flags & shm.SHM_PAYLOAD
            engine = engines[header.key % len(engines)]
            problem = engine.check(header.key, header.dtype, header.length)
            if problem is not None:  # the tensor's error, not the server's: refuse it, keep the stream in sync
                if not in_shm:
                    self._discard(conn, header.length)
                conn.send_json(FrameType.ERROR, {"message": problem}, key=header.key)
                continue
            if in_shm:
                push, pull = _check_slots(link, header)
            seq, slot = claim(engine.ring)
            try:
                if in_shm:  # the payload already lies in the worker's push slot: the engine sums from there
                    assert link.arena is not None
                    slot.data, slot.pull = link.arena.push_slot(push, header.length), pull
                else:
                    # a seed or a replay may be stale (dropped by the engine): never into a staging buffer in use
                    resent = header.flags & (SEED | REPLAY)
                    landing = None if resent else engine.landing(header.key, header.round, header.sender)
                    slot.landed = landing is not None
                    into = landing[: header.length] if landing is not None else slot.array[: header.length]
                    conn.recv_into(memoryview(into))
                    slot.data, slot.pull = into, shm.NO_SLOT
                slot.valid = True
                state.metrics.pushed(header.length)
            finally:
                publish(engine.ring, seq, slot, conn, header, header.sender)

    def _received(self, conn: tcp.Connection, header: frames.Header) -> None:
        body = conn.recv_body(header)
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

    def _discard(self, conn: tcp.Connection, length: int) -> None:
        scratch = memoryview(self._scratch)
        while length > 0:
            chunk = min(length, len(scratch))
            conn.recv_into(scratch[:chunk])
            length -= chunk

    def attach(self, link: WorkerLink, body: dict) -> None:
        """Map the worker's shared slots (transport/shm.py) and say whether it worked."""
        try:
            push, pull, slot_bytes = int(body["push"]), int(body["pull"]), int(body["slot_bytes"])
            path = str(body["path"])
            if link.arena is not None or not path.startswith(shm.SHM_DIR + "/gradwire-") or "/" in path[9:]:
                raise RemoteProtocolError(f"refusing shared memory at {path!r}")
            if slot_bytes > self.state.config.max_frame_bytes or push + pull > 1024:
                raise RemoteProtocolError(f"shared memory of {push}+{pull} slots of {slot_bytes} bytes is too large")
            link.arena = shm.Arena(path, push, pull, slot_bytes, create=False)
            link.conn.send_json(FrameType.SHM_ATTACH, {"ok": True})
        except (KeyError, ValueError, OSError, RemoteProtocolError) as e:
            log.info("worker %d: shared memory not used: %s", link.conn.peer_rank, e)
            link.conn.send_json(FrameType.SHM_ATTACH, {"ok": False, "error": str(e)})


def _check_slots(link: WorkerLink, header: frames.Header) -> tuple[int, int]:
    arena = link.arena
    push, pull = header.status & 0xFFFF, header.status >> 16
    if arena is None or push >= arena.push or header.length > arena.slot_bytes:
        raise RemoteProtocolError(f"bad shared push slot {push} for {header.length} bytes")
    if pull != shm.NO_SLOT and pull >= arena.pull:
        raise RemoteProtocolError(f"bad shared pull slot {pull}")
    return push, pull
