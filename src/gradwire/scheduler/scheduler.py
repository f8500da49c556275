"""The scheduler: one per job. Control traffic only; it never touches tensor bytes.

Life of a job, as seen here (each part in a module of its own, all working on one roster: roster.py):
1. rendezvous (rendezvous.py): every node connects, authenticates, and registers (role, requested rank, data
   address). When all `num_workers + num_servers` are in, ranks are fixed and everyone gets the address book.
2. service: workers declare tensors (declarations.py: every worker must declare the same shape and dtype; partitions
   are placed on servers), meet at barriers and joins (synchronisation.py), send heartbeats (liveness.py); the data
   path follows the links (adapt.py); an elastic job re-forms when its workers change (elastic.py).
3. end (departures.py): when every worker has said bye, servers are told to shut down, or the job waits for the
   workers to init() again (generations.py). A worker whose connection drops before its bye aborts the job: every
   node is told why, so nobody hangs. A server that dies is failed over (failover.py, docs/faults.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from gradwire.admin.http import AdminServer, json_handler
from gradwire.admin.metrics import Metrics
from gradwire.admin.stalls import watch_stalls
from gradwire.config import Config
from gradwire.errors import GradwireError
from gradwire.protocol import frames, messages
from gradwire.protocol.frames import FrameType
from gradwire.scheduler import rendezvous
from gradwire.scheduler.adapt import Adaptation
from gradwire.scheduler.departures import Departures
from gradwire.scheduler.elastic import Reforming
from gradwire.scheduler.failover import Failover
from gradwire.scheduler.generations import Generations
from gradwire.scheduler.lease import Lease, beat_seconds
from gradwire.scheduler.liveness import Liveness
from gradwire.scheduler.node import Node
from gradwire.scheduler.recovery import Recovery
from gradwire.scheduler.roster import Roster
from gradwire.scheduler.status import cluster_status, node_families
from gradwire.scheduler.synchronisation import Synchronisation
from gradwire.throttle import HandshakeGate
from gradwire.transport import endpoints, tcp
from gradwire.tuning import Tuning

log = logging.getLogger("gradwire.scheduler")


class Scheduler:
    """Runs a job's rendezvous and control plane: accepts the nodes' connections and hands each request to the part
    that serves it (`_handlers`).

    `start()` binds and returns at once (the address is then in `address`); `wait()` blocks until the
    job ends and returns its outcome (None, or the abort reason). Thread-safe; the roster's lock guards state.
    """

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.roster = roster = Roster(config, clock)
        self.adaptation = Adaptation(roster)
        self.membership = Reforming(roster, self.adaptation) if config.elastic else None
        self.rendezvous = rendezvous.Rendezvous(roster)
        self.generations = Generations(roster, self.rendezvous)
        self.failover = Failover(roster, self.adaptation)
        self.synchronisation = Synchronisation(roster)
        self.departures = Departures(roster, self.synchronisation, self.generations, self.failover, self.membership)
        self.lease = Lease(roster)
        self.liveness = Liveness(roster, self.failover, self.membership, self.lease.held)
        self.recovery = Recovery(roster)
        self.stepped_down: str | None = None  # why this scheduler stopped acting for the job (lease.py)
        self._handlers = self._dispatch_table()
        self._secret = config.secret_bytes()
        self._gate = HandshakeGate(config.max_pending_handshakes, log)
        self.refusals = self._gate.refusals
        self.metrics = Metrics("scheduler")
        self.admin: AdminServer | None = None
        if not self._secret:
            log.warning(
                "no job secret (GRADWIRE_SECRET): any process that can reach the scheduler can join the job; "
                "`gradwire launch` makes one for you"
            )
        host, port = config.scheduler_address
        self._listener = endpoints.listen(host, port, in_use_wait=5.0 if port else 0.0)
        self.address = f"{host}:{self._listener.getsockname()[1]}"

    # what tests and tools read of the job
    epoch = property(lambda self: self.roster.epoch)
    tuning = property(lambda self: self.roster.tuning)
    abort_reason = property(lambda self: self.roster.abort_reason)
    failovers = property(lambda self: self.failover.records)

    def start(self) -> Scheduler:
        """Start accepting connections in a background thread, and the admin endpoint (see `admin_url`)."""
        if self.config.admin_port >= 0:
            routes = {"/metrics": self.metrics.exposition, "/status": json_handler(self.status)}
            self.admin = AdminServer(self.config.admin_host, self.config.admin_port, routes)
            self.metrics.collector(lambda: node_families(self.roster))
        self._thread(endpoints.accept_forever, "accept", self._listener, self.roster.done, self._serve, "gw-sched-conn")
        self._thread(self.rendezvous.watch_deadline, "deadline")
        self._thread(self._watch_recovery, "recovery")
        if self.config.heartbeat_timeout > 0:
            self._thread(self.liveness.watch, "monitor")
        if self.config.stall_seconds > 0:
            self._thread(watch_stalls, "stalls", self.roster.done, self.config.stall_seconds, self.stall_report, log)
        if self.config.adapt and self.config.heartbeat_interval > 0:
            self._thread(self._adapt_loop, "adapt")
        if self.lease.on:
            self._thread(self._beat_loop, "beat")
        return self

    @staticmethod
    def _thread(target: Callable[..., None], name: str, *args: object) -> None:
        threading.Thread(target=target, args=args, name=f"gw-sched-{name}", daemon=True).start()

    def status(self) -> dict:
        """/status: the whole job (scheduler/status.py), and what this scheduler recovered (if it started into a
        running job: scheduler/recovery.py)."""
        refused = self.refusals.count
        status = cluster_status(self.roster, self.adaptation, self.membership, self.failover.records, refused)
        return status | {"term": self.roster.term, "recovered": self.recovery.record or None}

    def _watch_recovery(self) -> None:
        """Until a recovery completes (or the job ends, or starts afresh: then none can come): its deadline, then the
        failover of the servers it lost."""
        recovery, roster = self.recovery, self.roster
        while not roster.done.wait(0.2):
            if not recovery.active and roster.declarations is not None:
                return
            recovery.check_deadline(self.clock())
            if recovery.done.is_set():
                self._after_recovery()
                return

    def _after_recovery(self) -> None:
        """Once the job is recovered: a re-cut and a server failover that the last scheduler left under way are
        completed; then the servers that died while no scheduler ran (they did not report to this one) are failed over,
        and an elastic job re-forms without the workers that did."""
        roster = self.roster
        with roster.lock:
            lost, self.recovery.lost = self.recovery.lost, []
            left, self.recovery.left = self.recovery.left, []
            under_way, self.recovery.under_way = self.recovery.under_way, None
            recut, self.recovery.recut = self.recovery.recut, (0, None, [])
            for node, why in left:
                assert self.membership is not None
                self.membership.left(node, why)
        self._end_recut(*recut)

        def fail_over() -> None:
            if under_way is not None:
                self.failover.resume(*under_way)  # first: a later failover's epoch is higher
            for node, why in lost:
                self.failover.server_lost(node, why)

        if under_way is not None or lost:
            threading.Thread(target=fail_over, name="gw-sched-failover", daemon=True).start()

    def _end_recut(self, number: int, retune: messages.Retune | None, to: list[int]) -> None:
        """After a recovery: re-cuts go on numbered after the latest the workers heard of (`number`); one the last
        scheduler left under way ends as it ended for the workers it told (`retune` to the others, `to`), or is
        cancelled (scheduler/recovery.py)."""
        roster = self.roster
        with roster.lock:
            self.adaptation.recuts = max(self.adaptation.recuts, number)
            if retune is not None and retune.switch:
                roster.tuning = Tuning.from_dict(retune.tuning)
        if retune is not None:
            log.warning("ending re-cut %d that the last scheduler left under way: telling workers %s", number, to)
            roster.tell([w for w in roster.workers if w.rank in to], retune)

    def _beat_loop(self) -> None:
        """A job with standby schedulers: beat every node, and step down the moment the lease is lost (lease.py)."""
        while not self.roster.done.wait(beat_seconds(self.config)):
            if self.recovery.active and not self.recovery.done.is_set():
                continue  # a standby (or a restart) still collecting reports: nothing to beat yet
            self.lease.beat()
            if not self.lease.held():
                self.step_down()

    def step_down(self) -> None:
        """Stop acting for the job for good, without a word to its nodes (another scheduler may act for it now): they
        find the connections closed, and report to the next scheduler."""
        roster = self.roster
        with roster.lock:
            if roster.done.is_set():
                return
            self.stepped_down = why = self.lease.why_lost()
            roster.abort_reason = f"stepped down (term {roster.term}): {why}"
            roster.done.set()
        log.error("scheduler of term %d steps down: %s", roster.term, why)
        self.stop()

    def check_heartbeats(self, now: float | None = None) -> list[Node]:
        """Declare lost every node silent past GRADWIRE_HEARTBEAT_TIMEOUT (liveness.py); returns them."""
        return self.liveness.check(now)

    def _adapt_loop(self) -> None:
        """Every heartbeat interval, the drift check over the workers' counters (scheduler/adapt.py)."""
        while not self.roster.done.wait(self.config.heartbeat_interval):
            with self.roster.lock:
                if self.lease.held():
                    self.adaptation.tick(self.clock())

    def stall_report(self, now: float | None = None) -> list[str]:
        """One line per tensor whose declaration has waited past GRADWIRE_STALL_SECONDS for some workers' (a
        collective that not every worker calls; the servers report rounds that wait for data)."""
        declarations = self.roster.declarations
        return declarations.stalled(self.config.stall_seconds, now) if declarations is not None else []

    def wait(self, timeout: float | None = None) -> str | None:
        """Block until the job ends; returns None on a clean end, else the abort reason."""
        self.roster.done.wait(timeout)
        return self.roster.abort_reason

    @property
    def admin_url(self) -> str | None:
        return self.admin.url if self.admin else None

    def stop(self) -> None:
        """Close every connection and the listener."""
        self.roster.done.set()
        if self.admin is not None:
            self.admin.stop()
            self.admin = None
        endpoints.close_listener(self._listener)  # free the port at once: a restarted scheduler may bind it again
        for node in list(self.roster.nodes):
            node.conn.close()

    # -- connections -----------------------------------------------------------------------------

    def _serve(self, sock, addr) -> None:
        conn = tcp.Connection(sock, max_payload=0, peer=f"{addr[0]}:{addr[1]}")
        node = None
        if not self._gate.enter(conn):
            return
        try:
            try:  # authenticate and register within the handshake timeout
                sock.settimeout(self.config.handshake_timeout)
                conn.handshake(self._secret, "scheduler", 0, initiator=False)
                node = self._register(conn)
                sock.settimeout(None)
            finally:
                self._gate.leave()
            while True:
                header = conn.recv_header()
                if header.type == FrameType.PROBE and node.probe is not None:  # GRADWIRE_PLACEMENT=auto
                    conn.recv_into(memoryview(node.probe_buffer)[: header.length])
                    node.probe.on_frame()
                    continue
                if header.type != FrameType.CONTROL:
                    raise GradwireError(f"{node.role} {node.rank} sent an unexpected {header.type.name} frame")
                if self._handle(node, frames.decode_json(conn.recv_body(header))):
                    return
        except Exception as e:  # one connection's failure never stops the scheduler
            conn.close()
            if node is None:
                self._gate.refuse(conn, f"dropped before registration: {e}")
            elif self.recovery.withdraw(node):
                return  # it reported and went away before the job was rebuilt: it is reported no longer
            elif not self.lease.held():
                self.step_down()  # not this scheduler's to act on
            else:
                self.departures.disconnected(node, e)

    def _register(self, conn: tcp.Connection) -> Node:
        _, body = conn.recv_json(FrameType.CONTROL)
        first = messages.parse(body)
        roster = self.roster
        if isinstance(first, messages.Resume):  # a node of a running job: this scheduler recovers it (recovery.py)
            with roster.lock:
                if roster.nodes and not self.recovery.active:
                    raise GradwireError(
                        f"{first.role} {first.rank} resumes a job, but this scheduler started a new one"
                    )
            node = self.recovery.report(conn, first, self.clock())
            if self.recovery.done.is_set():
                self._after_recovery()
            return node
        if not isinstance(first, messages.Register):
            raise GradwireError(f"first message from {conn.peer} must be register, got {first.op}")
        if self.config.standby:
            why = f"{first.role} {first.rank} registered with a standby scheduler: it only takes a running job over"
            conn.send_message(messages.Abort(f"{why} (register with GRADWIRE_SCHEDULER)"))
            raise GradwireError(why)
        if self.recovery.active and not self.recovery.done.is_set():
            raise GradwireError("the scheduler is recovering a running job: only its nodes may report now")
        node = rendezvous.node_of(conn, first, self.clock())
        with roster.lock:
            if self.generations.admit_locked(node):
                return node
            if self.membership is not None and roster.declarations is not None and node.role == "worker":
                self.membership.join(node)  # elastic: held until the next reset
                roster.nodes.append(node)
                return node
            self.rendezvous.admit_locked(node)
        return node

    # -- requests --------------------------------------------------------------------------------

    def _dispatch_table(self) -> dict[type, tuple[str | None, Callable[[Node, Any], object]]]:
        """message type -> (the role that may send it, None: any; its handler). A handler's True: the node has said
        bye."""
        return {
            messages.Declare: (None, self._declare),
            messages.Blocked: ("worker", self._blocked),
            messages.FailoverReport: ("worker", self.failover.reported),
            messages.ProbeResult: (None, self._probe_result),
            messages.Heartbeat: (None, lambda node, m: self.liveness.heartbeat(node, m.stats)),
            messages.Beat: (None, self.lease.answered),
            messages.RecutRounds: ("worker", self._recut_rounds),
            messages.Reply: ("server", self._server_reply),
            messages.Barrier: (None, lambda node, m: self.synchronisation.enter_barrier(node, m.id, m.number)),
            messages.Join: ("worker", self._join),
            messages.Rejoin: ("worker", self._rejoin),
            messages.ServerLost: (None, self._server_lost),
            messages.Bye: (None, self.departures.said_bye),
        }

    def _handle(self, node: Node, body: dict) -> bool:
        """Serve one request; True when the node has said bye."""
        message = messages.parse(body)
        node.heard = self.clock()
        role, handler = self._handlers.get(type(message), (None, None))
        if handler is None or role not in (None, node.role):
            raise GradwireError(f"{node.role} {node.rank} sent unexpected op {message.op!r}")
        if not isinstance(message, (messages.Beat, messages.Heartbeat)) and not self.lease.held():
            self.step_down()  # it may no longer act for the job: another scheduler may
            raise GradwireError(f"stepped down: {node.role} {node.rank}'s {message.op} is not answered here")
        return bool(handler(node, message))

    def _declare(self, node: Node, m: messages.Declare) -> None:
        declarations = self.roster.declarations
        if declarations is None:
            raise GradwireError(f"worker {node.rank} declared a tensor before the rendezvous completed")
        declarations.declare(node.rank, m, lambda reply: self._answer_declaration(node, m.id, reply))

    def _answer_declaration(self, node: Node, request_id: int, reply: dict) -> None:
        try:
            node.conn.send_message(messages.Reply(request_id, reply))
        except GradwireError:
            pass  # that worker's own loss is handled on its connection
        # after the reply, so the declarer gets the TensorError; a mismatch among workers fails only the tensor
        if "error" in reply and reply.get("abort", True) and not reply.get("mismatch"):
            self.roster.abort(reply["error"])

    def _blocked(self, node: Node, m: messages.Blocked) -> None:
        declarations = self.roster.declarations
        if declarations is not None:
            declarations.blocked(m.name, node.rank)
            self.synchronisation.break_barrier_deadlocks()

    def _probe_result(self, node: Node, m: messages.ProbeResult) -> None:
        if node.probe is None:
            raise GradwireError(f"{node.role} {node.rank} sent a probe result with no probe running")
        node.probe.on_result(m)

    def _recut_rounds(self, node: Node, m: messages.RecutRounds) -> None:
        with self.roster.lock:
            self.adaptation.answered(node, m)

    def _server_reply(self, node: Node, m: messages.Reply) -> None:
        declarations = self.roster.declarations
        if declarations is not None:
            declarations.ack(m.id)

    def _join(self, node: Node, m: messages.Join) -> None:
        self.synchronisation.join(node, m.id, {str(k): int(v) for k, v in m.rounds.items()})

    def _rejoin(self, node: Node, m: messages.Rejoin) -> None:
        with self.roster.lock:
            if self.membership is None:
                raise GradwireError(f"worker {node.rank} asked to rejoin, but the job is not elastic")
            self.membership.rejoin(node, m.id)

    def _server_lost(self, node: Node, m: messages.ServerLost) -> None:
        """A worker lost its link to a server, or a server its replica (a replica that acknowledges nothing)."""
        servers, server = self.roster.servers, m.server
        if node.role == "server" and node.rank == server:
            raise GradwireError(f"server {server} reported itself lost")
        if 0 <= server < len(servers) and m.epoch >= servers[server].since_epoch:
            self.failover.server_lost(servers[server], f"{node.role} {node.rank} lost it: {m.error}")
