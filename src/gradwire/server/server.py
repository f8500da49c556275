"""The summation server: receives partitions, sums them in engines, returns the sum to every worker. A facade: it
keeps the life cycle and the connections and wires the parts (docs/architecture.md): the readers (reader.py), the
engines (engine.py), the repliers (replier.py) and the control connection (control.py), all sharing one
`ServerState` (state.py).

Threads: the link loop (transport/loop.py), which reads every worker connection (reader.py: claims a ring slot, receives
the payload into it as it arrives, publishes) and, after each pass, runs the engine on what was published (one engine,
the default: a partition is never handed between threads); with GRADWIRE_ENGINES > 1 a thread per engine instead; per
worker connection a replier (sends what the socket did not take at once from a queue, so an engine never blocks on a
slow socket); an acceptor per listener, each connection's handshake on a thread of its own; one on the scheduler
connection (shutdown, abort).
"""

from __future__ import annotations

import logging
import threading
import time

from gradwire import native
from gradwire.admin.node import NodeAdmin
from gradwire.admin.stalls import watch_stalls
from gradwire.config import Config
from gradwire.errors import GradwireError, RemoteProtocolError
from gradwire.protocol import messages
from gradwire.ring import Ring
from gradwire.scheduler.client import join
from gradwire.server import compressed, native_path, optimizer_op
from gradwire.server.control import ServerControl
from gradwire.server.engine import Engine
from gradwire.server.outgoing import Outgoing
from gradwire.server.reader import Incoming, Reader
from gradwire.server.receipts import Receipts
from gradwire.server.replica import Replicas
from gradwire.server.replier import Replier
from gradwire.server.slot import Slot
from gradwire.server.state import ServerState
from gradwire.server.sums import for_datapath
from gradwire.throttle import HandshakeGate
from gradwire.transport import endpoints, tcp

log = logging.getLogger("gradwire.server")


class ReplicaPeer:
    """A connection from another server, which forwards the updates of keys this server replicates."""

    def __init__(self, conn: tcp.Connection) -> None:
        self.conn = conn


class Server:
    """One summation server. `start()` registers with the scheduler and returns once serving."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.state = state = ServerState(config)
        self.reader = Reader(state)
        self.control = ServerControl(state)
        self.outgoing = Outgoing(state)  # what the engines send the workers
        self.sums = for_datapath(config.datapath)  # the engines' sums: numpy's or native (GRADWIRE_DATAPATH)
        state.receipts = Receipts(self.outgoing.everyone)
        self._listener = endpoints.listen(config.host, 0)
        self.port = self._listener.getsockname()[1]
        self._unix_listener, self.unix_name = endpoints.listen_unix()
        self._gate = HandshakeGate(config.max_pending_handshakes, log)
        self.admin: NodeAdmin | None = None
        self.refusals = self._gate.refusals
        self.metrics, self.links, self.engines = state.metrics, state.links, state.engines
        if not state.secret:
            log.warning(
                "no job secret (GRADWIRE_SECRET): any process that can reach this server can join the job and change "
                "its sums; `gradwire launch` makes one for you"
            )

    # what tests and tools read of this server
    rank = property(lambda self: self.state.rank)
    epoch = property(lambda self: self.state.epoch)
    num_workers = property(lambda self: self.state.num_workers)
    standby = property(lambda self: self.state.standby)
    error = property(lambda self: self.state.error)

    def start(self) -> Server:
        """Rendezvous with the scheduler, then serve in background threads."""
        state, config = self.state, self.config
        self.admin = NodeAdmin(config, state.metrics, self.status)
        state.registration = dict(
            admin=self.admin.port,
            admin_host=self.admin.advertised_host,
            port=self.port,
            slot_bytes=config.partition_bytes,
            unix=self.unix_name,
            host_id=endpoints.host_identity(self.config.host_id),
            standby=config.standby,
            colocated=config.colocated,
            link_rate=config.link_rate_bytes(),
        )
        state.scheduler, book = join(config, "server", **state.registration)
        state.rank, state.epoch, state.term = book.rank, book.epoch, book.term
        state.set_workers(book.num_workers)
        state.standby = book.standby
        state.replicas = Replicas(
            state.rank,
            state.secret,
            config.partition_bytes,
            config.timeout,
            endpoints.host_identity(config.host_id),
            config.socket_buffer_bytes,
            config.transport,
            deadline=config.heartbeat_timeout,
            on_lost=self._replica_lost,
        )
        why_not = native_path.why_not(config)
        if not why_not:
            module = native.load().module
            assert module is not None
            state.native = native_path.NativeServer(state, module, self.reader, self._closed_link)
            state.native.start()
            log.info("server %d: the native data path", state.rank)
        else:
            log.debug("server %d: the Python data path (%s)", state.rank, why_not)
        self._start_engines()
        state.loop.start()
        for listener in (self._listener, self._unix_listener):
            self._thread(endpoints.accept_forever, "accept", listener, self.state.done, self._serve, "gw-server-conn")
        self._thread(self._control_loop, "control")
        self.admin.start_heartbeat(lambda: state.scheduler)
        if config.stall_seconds > 0:
            self._thread(watch_stalls, "stalls", self.state.done, self.config.stall_seconds, self.stall_report, log)
        self._gauges()
        log.info("server %d%s serving on %s:%d", state.rank, " (standby)" * state.standby, config.host, self.port)
        return self

    def _start_engines(self) -> None:
        """One engine (the default) runs on the link loop, after each of its passes: a partition is never handed
        between threads. More engines (GRADWIRE_ENGINES) run on threads of their own."""
        state = self.state
        state.engines.extend(self._engine(i) for i in range(self.config.engines))
        for engine in state.engines:
            engine.ring.on_space = state.loop.wake  # a push that found the ring full is taken up (reader.py)
        if len(state.engines) == 1 and state.native is None:  # (the native loop's keys are summed on its thread)
            (engine,) = state.engines
            engine.inline = True
            engine.ring.on_publish = state.loop.wake  # a join event or a replica's update, published by another thread
            state.loop.after_pass = engine.handle_published
        else:
            for engine in state.engines:
                engine.start()

    @staticmethod
    def _thread(target, name: str, *args) -> None:
        threading.Thread(target=target, args=args, name=f"gw-server-{name}", daemon=True).start()

    def _engine(self, index: int) -> Engine:
        state = self.state
        assert state.replicas is not None
        ring = Ring(self.config.ring_slots, self.config.partition_bytes, Slot)
        return Engine(
            index,
            ring,
            state.num_workers,
            self.outgoing.reply,
            self.outgoing.fail,
            self.outgoing.ack,
            fail_rank=self.outgoing.fail_rank,
            deterministic=self.config.deterministic,
            forward=state.replicas.forward,
            batching=self.outgoing.held,
            receipts=state.receipts,
            sums=self.sums,
        )

    def _gauges(self) -> None:
        metrics, engines = self.state.metrics, self.state.engines
        metrics.gauge(
            "gradwire_ring_occupancy",
            "Ring slots claimed and not yet released",
            lambda: sum(e.ring.occupancy for e in engines),
        )
        metrics.gauge("gradwire_keys", "Keys this server sums", lambda: sum(len(e.keys) for e in engines))
        metrics.gauge("gradwire_workers_connected", "Workers connected to this server", lambda: len(self.links))
        metrics.gauge(
            "gradwire_server_optimizer_bytes",
            "Parameters and optimizer state this server holds (parameter-server mode)",
            lambda: optimizer_op.stats(self._key_states())["bytes"],
        )
        metrics.gauge(
            "gradwire_server_optimizer_updates",
            "Optimizer updates applied to this server's partitions (parameter-server mode)",
            lambda: optimizer_op.stats(self._key_states())["updates"],
        )
        metrics.gauge(
            "gradwire_server_delay_compensated",
            "Asynchronous pushes corrected for their delay before being applied (delay compensation, PS mode)",
            lambda: optimizer_op.stats(self._key_states())["delay_compensated"],
        )
        metrics.gauge(
            "gradwire_server_compression_residual_restarts",
            "Compressed keys whose error-feedback residual started from zero on this server in mid-training (their "
            "server died)",
            lambda: compressed.stats(self._key_states())["residual_restarts"],
        )
        metrics.collector(self._staleness_families)

    def wait(self, timeout: float | None = None) -> str | None:
        """Block until told to shut down; returns None, or the reason the job ended badly."""
        self.state.done.wait(timeout)
        return self.state.error

    def status(self) -> dict:
        """This server's view, for its /status."""
        state = self.state
        workers = {
            rank: {"peer": link.conn.peer, "shared_memory": link.arena is not None}
            for rank, link in list(state.links.items())
        }
        return {
            "role": "server",
            "rank": state.rank,
            "epoch": state.epoch,
            "standby": state.standby,
            "workers": workers,
            "keys": sum(len(e.keys) for e in state.engines) + (len(state.native.names) if state.native else 0),
            "datapath": "native" if state.native else "python",
            "rounds_completed": self.rounds_completed,
            "replicated_rounds": self.replicated_rounds,  # other servers' answered rounds kept here (failover)
            "ring_occupancy": sum(e.ring.occupancy for e in state.engines),
            "optimizer": optimizer_op.stats(self._key_states()),
            "compression": compressed.stats(self._key_states()),
            "error": state.error,
            "refused_connections": self.refusals.count,
            **state.metrics.snapshot(),
        }

    def stop(self) -> None:
        """Stop serving and close every connection."""
        state = self.state
        state.done.set()
        if self.admin is not None:
            self.admin.stop()
        endpoints.close_listener(
            self._listener
        )  # shutdown() first: a bare close() left each acceptor blocked, and the port
        endpoints.close_listener(self._unix_listener)  # listening, for the life of the process
        for engine in state.engines:
            engine.ring.close()
        if state.native is not None:
            state.native.stop()  # every worker link leaves the loop and is closed
        if state.replicas is not None:
            state.replicas.close()
        state.loop.stop(self.config.timeout)  # every worker connection leaves it and is closed (`_closed`)
        for link in list(state.links.values()):  # any the loop never took
            link.replies.put(None)
            link.conn.close()
        if state.scheduler is not None:
            state.scheduler.close()

    def _key_states(self) -> list:
        return [state for engine in self.state.engines for state in list(engine.keys.values())]

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
        for name, (top, avg) in sorted(optimizer_op.staleness_by_tensor(self._key_states()).items()):
            worst.add_metric([name], top)
            mean.add_metric([name], avg)
        return [worst, mean]

    @property
    def seeded_answers(self) -> int:
        """Workers answered with a sum another worker seeded after a failover (docs/faults.md)."""
        path = self.state.native
        if path is not None:
            path.counted()
        return sum(e.seeded_answers for e in self.state.engines) + (path.seeded_answers if path else 0)

    @property
    def replicated_rounds(self) -> int:
        """Rounds of other servers' keys kept here as their replica (GRADWIRE_FAILOVER_COPIES=replica)."""
        return sum(e.replicated for e in self.state.engines)

    @property
    def rounds_completed(self) -> int:
        return self.state.metrics.rounds  # counted once, where each finished round is handed out

    # -- connections -----------------------------------------------------------------------------

    def _serve(self, sock, addr) -> None:
        state = self.state
        endpoints.configure(sock, self.config.socket_buffer_bytes)
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "unix"
        conn = tcp.Connection(sock, self.config.partition_bytes, peer=peer)
        link = self._authenticate(conn)
        if link is None:
            return
        if isinstance(link, ReplicaPeer):  # a server whose keys this one replicates
            self.reader.serve_replica(link.conn)
            return
        # from here a frame, once begun, must arrive whole within the frame timeout (reader.py); idle between frames
        # is fine. The socket's own timeouts bound the replier's blocking sends.
        endpoints.set_frame_timeout(sock, self.config.frame_timeout)
        self._thread(link.reply_loop, "reply", state.epoch, state.rank)
        if state.done.is_set():
            self._closed_link(link)
        elif state.native is not None:
            state.native.add(link)
        else:
            state.loop.add(Incoming(link, self.reader, lambda incoming: self._closed_link(incoming.link)))

    def _closed_link(self, link: Replier) -> None:
        """A worker connection left the link loop (reader.py, or the native loop: a BYE, an error, or the server
        closing it): close it."""
        state = self.state
        link.replies.put(None)
        link.conn.close()
        link.release()
        with state.links_lock:
            if state.links.get(link.conn.peer_rank) is link:
                del state.links[link.conn.peer_rank]

    def _authenticate(self, conn: tcp.Connection) -> Replier | ReplicaPeer | None:
        """The handshake, within the handshake timeout and the cap on pending handshakes; None if refused."""
        state = self.state
        if not self._gate.enter(conn):
            return None
        try:
            conn.sock.settimeout(self.config.handshake_timeout)
            conn.handshake(state.secret, "server", state.rank, initiator=False)
            if state.standby:
                raise RemoteProtocolError("a standby server takes connections once it replaces a dead server")
            if conn.peer_role == "server":
                return ReplicaPeer(conn)
            if conn.peer_role != "worker" or not 0 <= conn.peer_rank < state.num_workers:
                raise RemoteProtocolError(f"only workers 0..{state.num_workers - 1} may connect")
            with state.links_lock:
                if conn.peer_rank in state.links:
                    raise RemoteProtocolError(f"worker {conn.peer_rank} is connected already")
                link = state.links[conn.peer_rank] = Replier(conn, state.metrics)
            return link
        except Exception as e:  # noqa: BLE001 - whatever the peer did, it is refused and the server goes on
            self._gate.refuse(conn, e)
            conn.close()
            return None
        finally:
            self._gate.leave()

    # -- stalls and the scheduler ----------------------------------------------------------------

    def stall_report(self, now: float | None = None) -> list[str]:
        """One line per round waiting longer than GRADWIRE_STALL_SECONDS: which ranks have not pushed what."""
        state = self.state
        now = time.monotonic() if now is None else now
        lines = []
        stalls = [stall for engine in state.engines for stall in engine.stalled(now, self.config.stall_seconds)]
        if state.native is not None:
            stalls += state.native.stalled(now, self.config.stall_seconds)
        for name, key, rnd, waited, missing in stalls:
            pushed = [r for r in range(state.num_workers) if r not in missing]
            lines.append(
                f"server {state.rank}: tensor {name!r} (key {key:016x}) round {rnd} has waited {waited:.1f}s for "
                f"worker(s) {missing}; pushed by {pushed}"
            )
        return lines

    def _replica_lost(self, rank: int, why: str) -> None:
        """Tell the scheduler that replica server `rank` is hung (server/replica.py): it fails it over."""
        scheduler = self.state.scheduler
        if scheduler is not None:
            try:
                scheduler.send_message(messages.ServerLost(server=rank, epoch=self.state.epoch, error=why))
            except GradwireError:
                pass  # no scheduler now: what waited on the replica is answered anyway (server/replica.py)

    def _control_loop(self) -> None:
        self.control.loop()
        self.stop()
