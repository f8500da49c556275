"""A server's data path in native code: gradwire-native's `ServerLoop` (native/cpp/server.hpp) owns every worker link
once Python has accepted it and run the handshake, and sums the rounds of the plain keys (an elementwise sum over every
worker or a process set, no slices, no replica) by the engine's rule (server/engine.py): rank order, staging, the first
rank received into the accumulator, seeds, replays, held rounds, joined and departed workers. No Python runs per
partition of those keys.

What stays Python's comes back through one queue, read by one thread here (`_serve_events`): the pushes of the keys the
engines keep (other operations, sliced keys, compressed keys, a server-side optimizer's, a replica's: each published
into its engine's ring as the readers do, server/reader.py), control frames (SHM_ATTACH, RECEIVED), a link's end, and
each held round answered (for the receipts, server/receipts.py). Python's replies go back through the loop
(`NativeConn`), in order with its own on each link.

Where it applies (`why_not`): gradwire-native loads under GRADWIRE_DATAPATH, sums are deterministic (the default), and
no key has a replica server (GRADWIRE_FAILOVER_HOLD, on by default). Anywhere else the Python path serves, as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import ModuleType

import numpy as np

from gradwire import native
from gradwire.config import Config
from gradwire.errors import GradwireError
from gradwire.protocol import dtypes, frames
from gradwire.protocol.frames import SHM_PAYLOAD, FrameType
from gradwire.ring import RingClosed
from gradwire.server import ops
from gradwire.server.reader import Reader, check_slots, claim, publish
from gradwire.server.replier import ErrorReply, Replier
from gradwire.server.rounds import KeyOp
from gradwire.server.state import ServerState
from gradwire.transport import shm, tcp

log = logging.getLogger("gradwire.server")

FRAME, CLOSED, HELD = 0, 1, 2  # the loop's event kinds (server.hpp's Event::Kind)


def why_not(config: Config) -> str:
    """Why the native path does not serve (`""` where it does)."""
    if native.for_datapath(config.datapath) is None:
        return f"GRADWIRE_DATAPATH={config.datapath}" if config.datapath == "python" else "no native build"
    if not config.deterministic:
        return "GRADWIRE_DETERMINISTIC is off (the native rounds add in rank order only)"
    if not config.failover_hold:
        return "GRADWIRE_FAILOVER_HOLD is off (keys with a replica server are the Python path's)"
    return ""


def summed_natively(op: KeyOp, slices: object, kept: bool, replica: object) -> bool:
    """Whether a key's rounds are the native loop's: a plain sum, whole results, kept by no other server."""
    return op is ops.OPS["sum"] and slices is None and not kept and replica is None


class NativeConn:
    """A worker connection as the Python parts see it once the native loop owns its socket: what they send goes
    through the loop, in order with the loop's own replies (Replier, server/outgoing.py, server/control.py)."""

    def __init__(self, conn: tcp.Connection, path: NativeServer) -> None:
        self.conn, self._path = conn, path
        self.peer, self.peer_rank, self.peer_role = conn.peer, conn.peer_rank, conn.peer_role
        self.max_payload = conn.max_payload
        self.sock = conn.sock

    def __repr__(self) -> str:
        return f"<NativeConn worker {self.peer_rank} at {self.peer}>"

    def send(self, parts: list) -> None:
        self._path.send(self.peer_rank, parts)

    def send_nowait(self, parts: list) -> list:
        self._path.send(self.peer_rank, parts)
        return []  # the loop took it all

    def send_json(self, ftype: int, body: dict, **fields: int) -> None:
        self.send([frames.encode_json(ftype, body, **fields)])

    def close(self) -> None:
        """Let the loop go of the link; its socket is closed once it has (`NativeServer._closed`)."""
        self._path.close(self)


class NativeServer:
    """One server's native loop and the thread that hands Python what the loop does not keep (module docstring)."""

    def __init__(self, state: ServerState, module: ModuleType, reader: Reader, on_closed: Callable[[Replier], None]):
        self.state, self._reader, self._on_closed = state, reader, on_closed
        config = state.config
        self.loop = module.ServerLoop(
            max(state.rank, 0), state.epoch, state.num_workers, config.partition_bytes, config.frame_timeout
        )  # (a standby's rank is -1 until its promotion says which it is: `identify`)
        self.names: dict[int, str] = {}  # the keys summed here, and their tensors' names (stall reports)
        self.seeded_answers = 0
        self.stopped = False
        self._lock = threading.Lock()  # `counted`'s
        self._thread = threading.Thread(target=self._serve_events, name="gw-server-native", daemon=True)
        state.metrics.before_read = self.counted

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether it serves: its events thread runs and it was not stopped."""
        return self._thread.is_alive() and not self.stopped

    def stop(self) -> None:
        """Every link leaves the loop and is closed; the events thread ends once it has told Python."""
        self.stopped = True
        self.loop.stop()
        self._thread.join(timeout=10)

    # -- what the server's parts call ------------------------------------------------------------------------------

    def add(self, link: Replier) -> None:
        """A worker connection after its handshake: the loop owns it from here on."""
        conn = link.conn
        assert isinstance(conn, tcp.Connection)
        ahead = conn.take_read_ahead()
        link.conn = NativeConn(conn, self)
        link.closer = None  # Replier.close closes the NativeConn: the loop lets go of the link
        self.loop.add(conn.peer_rank, conn.sock.fileno(), ahead)

    def send(self, worker: int, parts: list) -> None:
        self.loop.send(worker, b"".join(parts))

    def close(self, conn: NativeConn) -> None:
        if self.stopped:
            conn.conn.close()
        else:
            self.loop.close(conn.peer_rank)

    def identify(self) -> None:
        """The server's rank and epoch changed (a standby's promotion, an elastic reset): the loop's headers and checks
        follow."""
        self.loop.set_identity(max(self.state.rank, 0), self.state.epoch)

    def declare(self, key: int, dtype: dtypes.DType, length: int, name: str, members: list[int] | None, mine: bool):
        """`key` is summed here (`mine`), or its pushes go to Python's engines."""
        self.loop.declare(key, dtype.code, length, name, members or [], mine)
        if mine:
            self.names[key] = name

    def counted(self) -> None:
        """The loop's counters into the server's metrics (before they are read)."""
        with self._lock:
            pushed, pulled, rounds, seeded = self.loop.take_counts()
            self.seeded_answers += seeded
        metrics = self.state.metrics
        metrics.pushed(pushed)
        metrics.pulled(pulled)
        metrics.round_done(rounds)

    def stalled(self, now: float, threshold: float) -> list[tuple[str, int, int, float, list[int]]]:
        """Rounds begun more than `threshold` seconds before `now` (time.monotonic's clock, the loop's too) and still
        missing workers, as Engine.stalled gives them."""
        return [
            (self.names.get(key, "?"), key, rnd, waited, list(missing))
            for key, rnd, waited, missing in self.loop.stalled(now, threshold)
        ]

    # -- the events thread ------------------------------------------------------------------------------------------

    def _serve_events(self) -> None:
        while True:
            events = self.loop.events(1.0)
            for kind, worker, header, body, why, routine, ranks in events:
                try:
                    if kind == FRAME:
                        self._frame(worker, frames.Header(FrameType(header[0]), *header[1:]), body)
                    elif kind == CLOSED:
                        self._closed(worker, why, routine)
                    elif kind == HELD and self.state.receipts is not None:
                        self.state.receipts.expect(header[5], header[6], ranks)
                except (GradwireError, RingClosed, ValueError) as e:
                    self._refuse(worker, e)
                except Exception:  # a bug: logged, the thread goes on (nothing here may stop the server's links)
                    log.exception("server %d: handling an event of worker %d", self.state.rank, worker)
            if not events and self.stopped:
                return

    def _frame(self, worker: int, header: frames.Header, body: np.ndarray | None) -> None:
        link = self.state.links.get(worker)
        if link is None:
            return
        if header.type == FrameType.PUSHPULL:
            self._push(link, header, body)
        elif header.type == FrameType.SHM_ATTACH:
            assert body is not None
            self._reader.attach(link, frames.decode_json(body.tobytes()), lambda arena: self._lend(worker, arena))
        elif header.type == FrameType.RECEIVED:
            assert body is not None
            self._reader.received(link.conn, header, memoryview(body))

    def _push(self, link: Replier, header: frames.Header, body: np.ndarray | None) -> None:
        """A push of a key Python's engines keep: into its engine's ring, as a reader publishes one."""
        engine = self.state.engine_of(header.key)
        problem = engine.check(header.key, header.dtype, header.length)
        if problem is not None:
            link.reply(ErrorReply(header.key, problem))
            return
        pull = shm.NO_SLOT
        if header.flags & SHM_PAYLOAD:  # checked as the reader checks it
            push, pull = check_slots(link, header)
            assert link.arena is not None
            data = link.arena.push_slot(push, header.length)
        else:
            assert body is not None
            data = body
        seq, slot = claim(engine.ring)
        slot.data, slot.pull, slot.valid = data, pull, True
        self.state.metrics.pushed(header.length)
        publish(engine.ring, seq, slot, link.conn, header, header.sender)

    def _lend(self, worker: int, arena: shm.Arena) -> None:
        """The worker's shared slots, mapped by Python, to the loop."""
        self.loop.attach(worker, (arena.memory, arena.push, arena.pull, arena.slot_bytes))

    def _refuse(self, worker: int, error: Exception) -> None:
        """A worker broke the protocol in a frame Python handles: its connection is closed."""
        if not self.state.done.is_set():
            log.warning("closing connection to worker %d: %s", worker, error)
        link = self.state.links.get(worker)
        if link is not None:
            link.close()

    def _closed(self, worker: int, why: str, routine: bool) -> None:
        """A link left the loop: its socket is closed and the worker is gone from the server's links."""
        link = self.state.links.get(worker)
        if why and not self.state.done.is_set():
            (log.info if routine else log.warning)("closing connection to worker %d: %s", worker, why)
        if link is not None and isinstance(link.conn, NativeConn):
            link.conn.conn.close()
            self._on_closed(link)
