"""The summation server: receives partitions, sums them in engines, returns the sum to every worker.

Threads: one acceptor; per worker connection a reader (claims a ring slot, `recv_into` it, publishes)
and a replier (sends finished sums from a queue, so an engine never blocks on a slow socket); one thread
per engine; one on the scheduler connection (shutdown, abort). Small replies over a socket (ACKs, small sums) go
from the engine's thread itself where nothing is queued before them and the socket takes them without waiting
(`WorkerLink.reply`): a wake-up of the replier less for most of them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import numpy as np

from gradwire.admin.metrics import Metrics
from gradwire.admin.node import NodeAdmin
from gradwire.config import Config
from gradwire.errors import GradwireError, RemoteProtocolError, TensorError
from gradwire.protocol import dtypes, frames, messages
from gradwire.protocol.frames import DEPARTED_EVENT, JOIN_EVENT, REPLAY, REPLICA, SEED, FrameType
from gradwire.ring import Ring, RingClosed, Slot
from gradwire.scheduler.client import join
from gradwire.server import ops, optim
from gradwire.server.engine import Engine
from gradwire.server.replica import Replicas
from gradwire.throttle import HandshakeGate
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


class ReplicaPeer:
    """A connection from another server, which forwards the updates of keys this server replicates."""

    def __init__(self, conn: tcp.Connection) -> None:
        self.conn = conn


class Server:
    """One summation server. `start()` registers with the scheduler and returns once serving."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.rank = -1
        self.standby = False
        self.epoch = 0
        self.num_workers = 0
        self._secret = config.secret_bytes()
        self._listener = tcp.listen(config.host, 0)
        self.port = self._listener.getsockname()[1]
        self._unix_listener, self.unix_name = tcp.listen_unix()
        self._links: dict[int, WorkerLink] = {}
        self._replicas: Replicas | None = None  # forwards to the servers replicating this one's keys
        self._scratch = bytearray(1 << 16)  # where refused payloads are read and dropped
        self._gate = HandshakeGate(config.max_pending_handshakes, log)
        self._links_lock = threading.Lock()
        self.metrics = Metrics("server")
        self.admin: NodeAdmin | None = None
        self.refusals = self._gate.refusals
        if not self._secret:
            log.warning(
                "no job secret (GRADWIRE_SECRET): any process that can reach this server can join the job and change "
                "its sums; `gradwire launch` makes one for you"
            )
        self._engines: list[Engine] = []
        self._done = threading.Event()
        self.error: str | None = None
        self._scheduler: tcp.Connection | None = None

    def start(self) -> Server:
        """Rendezvous with the scheduler, then serve in background threads."""
        self.admin = NodeAdmin(self.config, self.metrics, self.status)
        self._scheduler, book = join(
            self.config,
            "server",
            admin=self.admin.port,
            admin_host=self.admin.advertised_host,
            port=self.port,
            slot_bytes=self.config.partition_bytes,
            unix=self.unix_name,
            host_id=tcp.host_identity(),
            standby=self.config.standby,
            colocated=self.config.colocated,
            link_rate=self.config.link_rate_bytes(),
        )
        self.rank, self.epoch, self.num_workers = book["rank"], book["epoch"], book["num_workers"]
        self.standby = bool(book.get("standby"))
        self._replicas = Replicas(self.rank, self._secret, self.config.partition_bytes, self.config.timeout)
        for i in range(self.config.engines):
            ring = Ring(self.config.ring_slots, self.config.partition_bytes)
            self._engines.append(
                Engine(
                    i,
                    ring,
                    self.num_workers,
                    self._queue_reply,
                    self._fail,
                    self._queue_ack,
                    fail_rank=self._fail_rank,
                    deterministic=self.config.deterministic,
                    forward=self._replicas.forward,
                )
            )
        self._everyone = (1 << self.num_workers) - 1
        for engine in self._engines:
            engine.start()
        for listener in (self._listener, self._unix_listener):
            threading.Thread(target=self._accept_loop, args=(listener,), name="gw-server-accept", daemon=True).start()
        threading.Thread(target=self._control_loop, name="gw-server-control", daemon=True).start()
        self.admin.start_heartbeat(self._scheduler)
        if self.config.stall_seconds > 0:
            threading.Thread(target=self._watch_stalls, name="gw-server-stalls", daemon=True).start()
        self.metrics.gauge(
            "gradwire_ring_occupancy",
            "Ring slots claimed and not yet released",
            lambda: sum(e.ring.occupancy for e in self._engines),
        )
        self.metrics.gauge("gradwire_keys", "Keys this server sums", lambda: sum(len(e.keys) for e in self._engines))
        self.metrics.gauge("gradwire_workers_connected", "Workers connected to this server", lambda: len(self._links))
        self.metrics.gauge(
            "gradwire_server_optimizer_bytes",
            "Parameters and optimizer state this server holds (parameter-server mode)",
            lambda: optim.stats(self._key_states())["bytes"],
        )
        self.metrics.gauge(
            "gradwire_server_optimizer_updates",
            "Optimizer updates applied to this server's partitions (parameter-server mode)",
            lambda: optim.stats(self._key_states())["updates"],
        )
        self.metrics.collector(self._staleness_families)
        log.info("server %d%s serving on %s:%d", self.rank, " (standby)" * self.standby, self.config.host, self.port)
        return self

    def wait(self, timeout: float | None = None) -> str | None:
        """Block until told to shut down; returns None, or the reason the job ended badly."""
        self._done.wait(timeout)
        return self.error

    def status(self) -> dict:
        """This server's view, for its /status."""
        workers = {
            rank: {"peer": link.conn.peer, "shared_memory": link.arena is not None}
            for rank, link in list(self._links.items())
        }
        return {
            "role": "server",
            "rank": self.rank,
            "epoch": self.epoch,
            "standby": self.standby,
            "workers": workers,
            "keys": sum(len(e.keys) for e in self._engines),
            "rounds_completed": self.rounds_completed,
            "ring_occupancy": sum(e.ring.occupancy for e in self._engines),
            "optimizer": optim.stats(self._key_states()),
            "error": self.error,
            "refused_connections": self.refusals.count,
            **self.metrics.snapshot(),
        }

    def stop(self) -> None:
        """Stop serving and close every connection."""
        self._done.set()
        if self.admin is not None:
            self.admin.stop()
        tcp.close_listener(self._listener)  # shutdown() first: a bare close() left each acceptor blocked, and the port
        tcp.close_listener(self._unix_listener)  # listening, for the life of the process
        for engine in self._engines:
            engine.ring.close()
        if self._replicas is not None:
            self._replicas.close()
        for link in list(self._links.values()):
            link.replies.put(None)
            link.conn.close()
        if self._scheduler is not None:
            self._scheduler.close()

    def _key_states(self) -> list:
        return [state for engine in self._engines for state in list(engine.keys.values())]

    def _staleness_families(self) -> list:
        """Per tensor, the staleness of the asynchronous pushes applied here (parameter-server mode)."""
        from prometheus_client.core import GaugeMetricFamily

        worst = GaugeMetricFamily(
            "gradwire_server_staleness_max",
            "Largest staleness of an applied asynchronous push (updates between the pusher's pull and its push)",
            labels=["tensor"],
        )
        mean = GaugeMetricFamily(
            "gradwire_server_staleness_mean", "Mean staleness of the applied asynchronous pushes", labels=["tensor"]
        )
        for name, (top, avg) in sorted(optim.staleness_by_tensor(self._key_states()).items()):
            worst.add_metric([name], top)
            mean.add_metric([name], avg)
        return [worst, mean]

    @property
    def seeded_answers(self) -> int:
        """Workers answered with a sum another worker seeded after a failover (docs/faults.md)."""
        return sum(e.seeded_answers for e in self._engines)

    @property
    def rounds_completed(self) -> int:
        return self.metrics.rounds  # counted once, where each finished round is handed to the repliers

    # -- connections -----------------------------------------------------------------------------

    def _accept_loop(self, listener) -> None:
        while not self._done.is_set():
            try:
                sock, addr = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, addr), name="gw-server-conn", daemon=True).start()

    def _serve(self, sock, addr) -> None:
        tcp.configure(sock, self.config.socket_buffer_bytes)
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "unix"
        conn = tcp.Connection(sock, self.config.partition_bytes, peer=peer)
        link = self._authenticate(conn)
        if link is None:
            return
        if isinstance(link, ReplicaPeer):  # a server whose keys this one replicates
            self._serve_replica(link.conn)
            return
        # from here a frame, once begun, must arrive whole within the frame timeout; idle between frames is fine
        tcp.set_frame_timeout(sock, self.config.frame_timeout)
        threading.Thread(
            target=link.reply_loop, args=(self.epoch, self.rank), name="gw-server-reply", daemon=True
        ).start()
        try:
            self._read_loop(link)
        except (GradwireError, RingClosed) as e:
            if not self._done.is_set():  # a worker that went away is routine (it is named elsewhere); a bad frame not
                routine = isinstance(e, tcp.ConnectionClosed)
                (log.info if routine else log.warning)(
                    "closing connection to worker %d (%s): %s", conn.peer_rank, conn.peer, e
                )
        finally:
            link.replies.put(None)
            conn.close()
            link.release()
            if self._links.get(conn.peer_rank) is link:
                del self._links[conn.peer_rank]

    def _serve_replica(self, conn: tcp.Connection) -> None:
        """Read the updates a primary server forwards (its keys' replicas are here) into the rings, as worker pushes
        are; the engines apply them and acknowledge (server/replica.py)."""
        tcp.set_frame_timeout(conn.sock, self.config.frame_timeout)
        try:
            while True:
                header = conn.recv_header(idle_ok=True)
                if header.type == FrameType.BYE:
                    return
                if header.type != FrameType.PUSHPULL or not header.flags & REPLICA or header.flags & JOIN_EVENT:
                    raise RemoteProtocolError(f"unexpected {header.type.name} frame from server {conn.peer_rank}")
                engine = self._engines[header.key % len(self._engines)]
                problem = engine.check(header.key, header.dtype, header.length)
                if problem is not None:
                    raise RemoteProtocolError(f"replicated update: {problem}")
                ring = engine.ring
                seq = ring.claim()
                slot = ring.slot(seq)
                slot.valid = slot.landed = False
                try:
                    into = slot.array[: header.length]
                    conn.recv_into(memoryview(into))
                    slot.data, slot.valid = into, True
                finally:
                    slot.conn, slot.key, slot.round, slot.dtype = conn, header.key, header.round, header.dtype
                    slot.length, slot.sender, slot.flags = header.length, 0, header.flags
                    slot.pull = header.status  # the update's number, which the acknowledgement echoes
                    ring.publish(seq)
        except (GradwireError, RingClosed) as e:
            if not self._done.is_set():
                log.warning("closing the replica connection from server %d: %s", conn.peer_rank, e)
        finally:
            conn.close()

    def _authenticate(self, conn: tcp.Connection) -> WorkerLink | ReplicaPeer | None:
        """The handshake, within the handshake timeout and the cap on pending handshakes; None if refused."""
        if not self._gate.enter(conn):
            return None
        try:
            conn.sock.settimeout(self.config.handshake_timeout)
            conn.handshake(self._secret, "server", self.rank, initiator=False)
            if self.standby:
                raise RemoteProtocolError("a standby server takes connections once it replaces a dead server")
            if conn.peer_role == "server":
                return ReplicaPeer(conn)
            if conn.peer_role != "worker" or not 0 <= conn.peer_rank < self.num_workers:
                raise RemoteProtocolError(f"only workers 0..{self.num_workers - 1} may connect")
            with self._links_lock:
                if conn.peer_rank in self._links:
                    raise RemoteProtocolError(f"worker {conn.peer_rank} is connected already")
                link = self._links[conn.peer_rank] = WorkerLink(conn, self.metrics)
            return link
        except Exception as e:  # noqa: BLE001 - whatever the peer did, it is refused and the server goes on
            self._gate.refuse(conn, e)
            conn.close()
            return None
        finally:
            self._gate.leave()

    def _read_loop(self, link: WorkerLink) -> None:
        conn, engines = link.conn, self._engines
        while True:
            header = conn.recv_header(idle_ok=True)
            if header.type == FrameType.BYE:
                return
            if header.type == FrameType.SHM_ATTACH:
                self._attach(link, frames.decode_json(conn.recv_body(header)))
                continue
            if header.type != FrameType.PUSHPULL or header.flags & (REPLICA | JOIN_EVENT):
                raise RemoteProtocolError(f"unexpected {header.type.name} frame (flags {header.flags:#x})")
            if header.sender != conn.peer_rank or header.epoch != self.epoch:
                raise RemoteProtocolError(
                    f"frame claims sender {header.sender} epoch {header.epoch}; connection is worker "
                    f"{conn.peer_rank} in epoch {self.epoch}"
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
                push, pull = self._check_slots(link, header)
            ring = engine.ring
            seq = ring.claim()
            slot = ring.slot(seq)
            slot.valid = slot.landed = False
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
                self.metrics.pushed(header.length)
            finally:  # published even if the read failed (else the ring stalls); invalid slots are skipped
                slot.conn, slot.key, slot.round, slot.dtype = conn, header.key, header.round, header.dtype
                slot.length, slot.sender, slot.flags = header.length, header.sender, header.flags
                ring.publish(seq)

    def _discard(self, conn: tcp.Connection, length: int) -> None:
        scratch = memoryview(self._scratch)
        while length > 0:
            chunk = min(length, len(scratch))
            conn.recv_into(scratch[:chunk])
            length -= chunk

    def _attach(self, link: WorkerLink, body: dict) -> None:
        """Map the worker's shared slots (transport/shm.py) and say whether it worked."""
        try:
            push, pull, slot_bytes = int(body["push"]), int(body["pull"]), int(body["slot_bytes"])
            path = str(body["path"])
            if link.arena is not None or not path.startswith(shm.SHM_DIR + "/gradwire-") or "/" in path[9:]:
                raise RemoteProtocolError(f"refusing shared memory at {path!r}")
            if slot_bytes > self.config.max_frame_bytes or push + pull > 1024:
                raise RemoteProtocolError(f"shared memory of {push}+{pull} slots of {slot_bytes} bytes is too large")
            link.arena = shm.Arena(path, push, pull, slot_bytes, create=False)
            link.conn.send_json(FrameType.SHM_ATTACH, {"ok": True})
        except (KeyError, ValueError, OSError, RemoteProtocolError) as e:
            log.info("worker %d: shared memory not used: %s", link.conn.peer_rank, e)
            link.conn.send_json(FrameType.SHM_ATTACH, {"ok": False, "error": str(e)})

    @staticmethod
    def _check_slots(link: WorkerLink, header: frames.Header) -> tuple[int, int]:
        arena = link.arena
        push, pull = header.status & 0xFFFF, header.status >> 16
        if arena is None or push >= arena.push or header.length > arena.slot_bytes:
            raise RemoteProtocolError(f"bad shared push slot {push} for {header.length} bytes")
        if pull != shm.NO_SLOT and pull >= arena.pull:
            raise RemoteProtocolError(f"bad shared pull slot {pull}")
        return push, pull

    def _queue_reply(
        self, key: int, rnd: int, dtype: int, payload: memoryview | list[memoryview], pulls: list[int], ranks: int
    ) -> None:
        if ranks == self._everyone:
            self.metrics.round_done()
        sliced = isinstance(payload, list)
        for rank in range(self.num_workers):
            link = self._links.get(rank)
            if link is not None and ranks >> rank & 1:
                link.reply((key, rnd, dtype, payload[rank] if sliced else payload, pulls[rank]))

    def _queue_ack(self, rank: int, key: int, rnd: int) -> None:
        link = self._links.get(rank)
        if link is not None:
            link.reply((key, rnd, 0, None, shm.NO_SLOT))

    def _fail(self, slot: Slot, message: str) -> None:
        conn = slot.conn
        if isinstance(conn, tcp.Connection):
            try:
                conn.send_json(FrameType.ERROR, {"message": message}, key=slot.key)
            except GradwireError:
                pass

    def _fail_rank(self, rank: int, key: int, message: str) -> None:
        """An ERROR for `key` to worker `rank` (a round that can never complete: engine.set_departed), behind the
        replies already queued for it (its ACK for that key among them)."""
        link = self._links.get(rank)
        if link is not None:
            link.reply((key, 0, 0, message, shm.NO_SLOT))

    def _declare_keys(self, body: dict) -> None:
        """Allocate the accumulators of keys this server owns, then tell the scheduler they are ready."""
        name = str(body.get("name", "?"))
        try:
            op = ops.build(str(body.get("key_op", "sum")), body.get("op_args"))
        except TensorError as e:
            raise RemoteProtocolError(str(e)) from None
        slices = body.get("slices") or {}
        replicas = body.get("replicas") or {}
        members = body.get("members")
        if members is not None:
            members = sorted({int(r) for r in members})
            if not members or members[0] < 0 or members[-1] >= self.num_workers:
                raise RemoteProtocolError(f"scheduler declared {name!r} for ranks {members} of {self.num_workers}")
        for key, code, length in body["keys"]:
            dtype = dtypes.BY_CODE[int(code)]
            if not 0 <= int(length) + op.trailer <= self.config.partition_bytes or int(length) % dtype.itemsize:
                raise RemoteProtocolError(f"scheduler declared key {int(key):016x} with {length} bytes")
            cut = slices.get(str(key))
            if cut is not None:
                cut = [(int(a), int(b)) for a, b in cut]
                bad = len(cut) != self.num_workers
                if bad or any(a < 0 or b < 0 or a + b > int(length) or (a | b) % dtype.itemsize for a, b in cut):
                    raise RemoteProtocolError(f"scheduler declared key {int(key):016x} with slices {cut}")
            engine = self._engines[int(key) % len(self._engines)]
            engine.declare(int(key), dtype, int(length), name, op, cut, members)
            target = replicas.get(str(key))
            if target is not None and self._replicas is not None:  # its updates are replicated there
                address = body["addresses"][str(target)]
                if self._replicas.ensure(int(target), address):
                    engine.keys[int(key)].held.replica = int(target)
        assert self._scheduler is not None
        self._scheduler.send_json(FrameType.CONTROL, {"op": messages.REPLY, "id": body["id"]})

    def _set_joined(self, ranks: list[int], flags: int = 0) -> None:
        """The workers that have joined (hvd.join) changed, or (`flags` DEPARTED_EVENT) those that have left: each
        engine learns it through its ring, in order with the pushes it has already taken (so a round begun before
        goes on with zeros in their place, or fails at once)."""
        mask = 0
        for rank in ranks:
            if not 0 <= rank < self.num_workers:
                raise RemoteProtocolError(f"scheduler says worker {rank} joined or left, of {self.num_workers}")
            mask |= 1 << rank
        for engine in self._engines:
            ring = engine.ring
            seq = ring.claim()
            slot = ring.slot(seq)
            slot.valid, slot.landed, slot.flags, slot.key, slot.length, slot.conn = (
                True,
                False,
                JOIN_EVENT | flags,
                mask,
                0,
                None,
            )
            ring.publish(seq)

    def _reset(self, body: dict) -> None:
        """Elastic: the workers changed. Drop every worker connection, let the engines drain, and start every key
        afresh for the new number of workers in the new epoch; then tell the scheduler. With `forget` (a new
        generation of workers after shutdown() and init()), every key is dropped: they declare theirs anew."""
        epoch, num_workers = int(body["epoch"]), int(body["num_workers"])
        forget = bool(body.get("forget", False))
        deadline = time.monotonic() + self.config.timeout
        with self._links_lock:
            self.epoch = epoch  # frames of the old epoch are refused from now on
            links = list(self._links.values())
        for link in links:
            link.conn.close()
        while (self._links or any(e.ring.occupancy for e in self._engines)) and time.monotonic() < deadline:
            time.sleep(0.001)
        for engine in self._engines:
            engine.reset(num_workers, forget=forget)
        self.num_workers, self._everyone = num_workers, (1 << num_workers) - 1
        log.info(
            "epoch %d: starting afresh with %d workers%s", epoch, num_workers, " (a new generation)" if forget else ""
        )
        assert self._scheduler is not None
        self._scheduler.send_json(FrameType.CONTROL, {"op": messages.REPLY, "id": body["id"]})

    def stall_report(self, now: float | None = None) -> list[str]:
        """One line per round waiting longer than GRADWIRE_STALL_SECONDS: which ranks have not pushed what."""
        now = time.monotonic() if now is None else now
        lines = []
        for engine in self._engines:
            for name, key, rnd, waited, missing in engine.stalled(now, self.config.stall_seconds):
                pushed = [r for r in range(self.num_workers) if r not in missing]
                lines.append(
                    f"server {self.rank}: tensor {name!r} (key {key:016x}) round {rnd} has waited {waited:.1f}s for "
                    f"worker(s) {missing}; pushed by {pushed}"
                )
        return lines

    def _watch_stalls(self) -> None:
        # repeats every half stall period while a stall lasts, so a stuck job keeps saying why
        while not self._done.wait(self.config.stall_seconds / 2):
            for line in self.stall_report():
                log.warning("stall: %s", line)

    def _tell_workers(self, abort: dict) -> None:
        """Pass an abort on before closing, so workers report the cause (and a lost rank), not a closed socket."""
        body = {k: abort[k] for k in ("message", "lost_role", "lost_rank") if k in abort} | {"abort": True}
        for link in list(self._links.values()):
            try:
                link.conn.send_json(FrameType.ERROR, body)
            except GradwireError:
                pass

    def _control_loop(self) -> None:
        assert self._scheduler is not None
        try:
            while True:
                _, body = self._scheduler.recv_json(FrameType.CONTROL)
                op = messages.check(body)
                if op == messages.SHUTDOWN:
                    break
                if op == messages.ABORT:
                    self.error = body["message"]
                    self._tell_workers(body)
                    break
                if op == messages.KEYS:
                    self._declare_keys(body)
                elif op == messages.RESET:
                    self._reset(body)
                elif op == messages.JOINED:
                    self._set_joined([int(r) for r in body["ranks"]])
                    self._scheduler.send_json(FrameType.CONTROL, {"op": messages.REPLY, "id": body["id"]})
                elif op == messages.DEPARTED:
                    self._set_joined([int(r) for r in body["ranks"]], DEPARTED_EVENT)
                elif op == messages.PROMOTE:  # a standby takes a dead server's place
                    self.rank, self.epoch, self.standby = int(body["rank"]), int(body["epoch"]), False
                    if self._replicas is not None:
                        self._replicas.rank = self.rank
                    if "id" in body:
                        self._scheduler.send_json(FrameType.CONTROL, {"op": messages.REPLY, "id": body["id"]})
                    log.warning("standby promoted: now server %d (epoch %d)", self.rank, self.epoch)
        except GradwireError as e:
            if not self._done.is_set():
                self.error = f"lost the scheduler: {e}"
        self.stop()
