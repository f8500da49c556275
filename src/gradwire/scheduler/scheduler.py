"""The scheduler: one per job. Control traffic only; it never touches tensor bytes.

Life of a job, as seen here:
1. rendezvous: every node connects, authenticates, and registers (role, requested rank, data address).
   When all `num_workers + num_servers` are in, ranks are fixed and everyone gets the address book.
2. service: workers declare tensors (the scheduler checks every worker declares the same shape and dtype,
   and places partitions on servers), and meet at barriers.
3. end: when every worker has said bye, servers are told to shut down. A worker whose connection drops before
   its bye aborts the job: every node is told why, so nobody hangs.

A server that dies (its connection drops, it falls silent, or a worker reports it) is failed over when
GRADWIRE_SERVER_FAILOVER is on: the epoch goes up, its keys go to a standby (at the same index) or are re-placed
on the surviving servers, and every worker is told (REPLACE) so it can resend what the server had not answered
(docs/faults.md). With no server left to take them, the job aborts naming the server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gradwire import tuning
from gradwire.admin.http import AdminServer, json_handler
from gradwire.admin.metrics import Metrics
from gradwire.config import Config
from gradwire.errors import GradwireError
from gradwire.protocol import frames, messages
from gradwire.protocol.frames import FrameType
from gradwire.scheduler import probe
from gradwire.scheduler.adapt import Adaptation
from gradwire.scheduler.declarations import Declarations
from gradwire.scheduler.elastic import Membership
from gradwire.scheduler.node import Node
from gradwire.scheduler.placing import placement_weights
from gradwire.scheduler.status import cluster_status, node_families
from gradwire.throttle import HandshakeGate
from gradwire.transport import tcp

log = logging.getLogger("gradwire.scheduler")
# a worker whose process ended mid-job: how long before the rounds that need it fail (see _bye)
DEPARTED_GRACE_SECONDS = 2.0


class Scheduler:
    """Runs a job's rendezvous and control plane.

    `start()` binds and returns at once (the address is then in `address`); `wait()` blocks until the
    job ends and returns its outcome (None, or the abort reason). Thread-safe; one lock guards state.
    """

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # injected: tests drive failure detection with a fake clock, not sleeps
        self.config = config
        self.epoch = 1
        self._secret = config.secret_bytes()
        self._lock = threading.Lock()
        self._nodes: list[Node] = []
        self._workers: list[Node] = []
        self._servers: list[Node] = []
        self._standby: list[Node] = []  # standby servers not yet promoted
        self.failovers: list[dict] = []  # one record per failover: server, epoch, where its keys went, duration
        self.membership = Membership(self) if config.elastic else None  # elastic mode (scheduler/elastic.py)
        # epoch -> (set once every live worker reported, {worker rank: {key: (round held, round resent)}})
        self._failover_states: dict[int, tuple[threading.Event, dict[int, dict]]] = {}
        self.placement_info: dict = {}  # the placement's mode, rates and weights (in the address book, /status)
        self.tuning: dict | None = None  # the data path's settings derived from the links (tuning.py)
        self.rate_scale = 1.0  # the links' rate now over the one measured at the start (the drift check: adapt.py)
        self.adaptation = Adaptation(self)
        self.declarations: Declarations | None = None  # once ranks are fixed
        self._barrier: list[tuple[Node, int]] = []
        self._joins: dict[int, tuple[Node, int, dict[str, int]]] = {}  # workers in hvd.join: (node, request, rounds)
        self._join_lock = threading.Lock()
        self._ending = False  # every worker said bye; servers are being shut down
        # every worker called shutdown(): the job waits GRADWIRE_REINIT_SECONDS for them to init() again (a new
        # generation: the same servers, afresh); the workers of that generation as they register
        self._between: list[Node] | None = None
        self._generation = threading.Event()  # set when a new generation has begun (or the job ends)
        self._done = threading.Event()
        self._gate = HandshakeGate(config.max_pending_handshakes, log)
        self.refusals = self._gate.refusals
        self.metrics = Metrics("scheduler")
        self.admin: AdminServer | None = None
        self.abort_reason: str | None = None
        if not self._secret:
            log.warning(
                "no job secret (GRADWIRE_SECRET): any process that can reach the scheduler can join the job; "
                "`gradwire launch` makes one for you"
            )
        host, port = config.scheduler_address
        self._listener = tcp.listen(host, port)
        self.address = f"{host}:{self._listener.getsockname()[1]}"

    @property
    def expected(self) -> int:
        return self.config.num_workers + self.config.num_servers + self.config.num_standby

    def start(self) -> Scheduler:
        """Start accepting connections in a background thread, and the admin endpoint (see `admin_url`)."""
        if self.config.admin_port >= 0:
            routes = {"/metrics": self.metrics.exposition, "/status": json_handler(lambda: cluster_status(self))}
            self.admin = AdminServer(self.config.admin_host, self.config.admin_port, routes)
            self.metrics.collector(lambda: node_families(self))
        threading.Thread(target=self._accept_loop, name="gw-sched-accept", daemon=True).start()
        threading.Thread(target=self._rendezvous_deadline, name="gw-sched-deadline", daemon=True).start()
        if self.config.heartbeat_timeout > 0:
            threading.Thread(target=self._monitor, name="gw-sched-monitor", daemon=True).start()
        if self.config.stall_seconds > 0:
            threading.Thread(target=self._watch_stalls, name="gw-sched-stalls", daemon=True).start()
        if self.config.adapt and self.config.heartbeat_interval > 0:
            threading.Thread(target=self._adapt_loop, name="gw-sched-adapt", daemon=True).start()
        return self

    def _adapt_loop(self) -> None:
        """Every heartbeat interval, the drift check over the workers' counters (scheduler/adapt.py)."""
        while not self._done.wait(self.config.heartbeat_interval):
            with self._lock:
                self.adaptation.tick(self.clock())

    def stall_report(self, now: float | None = None) -> list[str]:
        """One line per tensor whose declaration has waited past GRADWIRE_STALL_SECONDS for some workers' (a
        collective that not every worker calls; the servers report rounds that wait for data)."""
        declarations = self.declarations
        return declarations.stalled(self.config.stall_seconds, now) if declarations is not None else []

    def _watch_stalls(self) -> None:
        while not self._done.wait(self.config.stall_seconds / 2):
            for line in self.stall_report():
                log.warning("stall: %s", line)

    def wait(self, timeout: float | None = None) -> str | None:
        """Block until the job ends; returns None on a clean end, else the abort reason."""
        self._done.wait(timeout)
        return self.abort_reason

    @property
    def admin_url(self) -> str | None:
        return self.admin.url if self.admin else None

    def stop(self) -> None:
        """Close every connection and the listener."""
        self._done.set()
        if self.admin is not None:
            self.admin.stop()
            self.admin = None
        tcp.close_listener(self._listener)  # free the port at once: a restarted scheduler may bind it again
        for node in list(self._nodes):
            node.conn.close()

    # -- connections -----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._done.is_set():
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, addr), name="gw-sched-conn", daemon=True).start()

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
            self._on_disconnect(node, conn, e)

    def _register(self, conn: tcp.Connection) -> Node:
        _, body = conn.recv_json(FrameType.CONTROL)
        if messages.check(body) != messages.REGISTER:
            raise GradwireError(f"first message from {conn.peer} must be register, got {body.get('op')}")
        rank = body.get("rank")
        node = Node(
            conn,
            str(body["role"]),
            None if rank is None else int(rank),
            str(body["host"]),
            int(body["port"]),
            slot_bytes=int(body.get("slot_bytes", 0)),
            unix=str(body.get("unix", "")),
            host_id=str(body.get("host_id", "")),
            admin=int(body.get("admin", -1)),
            admin_host=str(body.get("admin_host", "")) or conn.peer.rsplit(":", 1)[0],
            standby=bool(body.get("standby", False)),
            colocated=bool(body.get("colocated", False)),
            link_rate=float(body.get("link_rate", 0.0)),
        )
        node.heard = node.last_seen = self.clock()
        with self._lock:
            if self._between is not None and node.role == "worker":
                self._between.append(node)
                self._nodes.append(node)
                log.info(
                    "worker from %s registered for a new generation (%d/%d)",
                    conn.peer,
                    len(self._between),
                    self.config.num_workers,
                )
                if len(self._between) == self.config.num_workers:
                    workers, self._between = self._between, None
                    self._generation.set()
                    threading.Thread(target=self._new_generation, args=(workers,), daemon=True).start()
                return node
            if self.membership is not None and self.declarations is not None and node.role == "worker":
                self.membership.join(node)  # elastic: held until the next reset
                self._nodes.append(node)
                return node
            if len(self._nodes) >= self.expected:
                raise GradwireError(f"job is full: {self.expected} nodes registered already")
            self._nodes.append(node)
            log.info("registered %s from %s (%d/%d)", node.role, conn.peer, len(self._nodes), self.expected)
            if len(self._nodes) == self.expected:
                self._assign_ranks_locked()
        return node

    def _assign_ranks_locked(self) -> None:
        try:
            for role, count, group in (
                ("worker", self.config.num_workers, self._workers),
                ("server", self.config.num_servers, self._servers),
                ("standby", self.config.num_standby, self._standby),
            ):
                members = [n for n in self._nodes if _role(n) == role]
                group.extend(_rank(role, count, members) if role != "standby" else _number(members, count))
        except GradwireError as e:
            self._abort_locked(str(e))
            return
        given = all(n.link_rate > 0 for n in self._workers + [s for s in self._servers if not s.colocated])
        if self.config.placement == "auto" and not given:  # measure first, without the lock; then as below
            threading.Thread(target=self._measure_then_publish, name="gw-sched-probe", daemon=True).start()
            return
        self._publish_locked()

    def _measure_then_publish(self) -> None:
        started = time.monotonic()
        try:
            nodes = self._workers + [s for s in self._servers if not s.colocated]
            hosts = probe.measure_links(nodes, self.config.timeout)
        except GradwireError as e:
            with self._lock:
                self._abort_locked(f"measuring the links for GRADWIRE_PLACEMENT=auto failed: {e}")
            return
        log.info(
            "measured %d links in %.1f s: %s",
            len(hosts),
            time.monotonic() - started,
            ", ".join(
                f"{n.role} {n.rank} {n.link_rate * 8 / 1e6:.1f} Mbit/s"
                for n in self._workers + self._servers
                if n.link_rate
            ),
        )
        with self._lock:
            self._publish_locked()

    def _derive_tuning(self, info: dict) -> dict | None:
        """The data path's settings (gradwire/tuning.py) for the links described by `info` (placement_weights'):
        the worker hosts' and dedicated servers' rates, and the median round trip. None when rates are unknown."""
        rates = info.get("rates_bytes_per_s") or {}
        if not rates:
            return None
        dedicated = [r for r, c in zip(rates.get("servers") or [], info.get("colocated") or [], strict=False) if not c]
        # a worker-server round trip is about the mean of the two nodes' round trips to the scheduler (a star)
        rtts = sorted(n.rtt for n in self._workers + self._servers if n.rtt > 0)
        rtt = rtts[len(rtts) // 2] if rtts else 0.0
        scale = self.rate_scale  # where the drift check found the links faster or slower than measured at the start
        # the workers of one host share its link: each pushes and pulls its own copy, so each has its share of it
        sharing = info["workers_per_host"]  # placing.link_sharers
        workers = [r * scale / m for r, m in zip(rates["worker_hosts"], sharing, strict=True) for _ in range(m)]
        derived = tuning.derive(workers, rtt, server_rates=[r * scale for r in dedicated]).as_dict()
        derived["workers_per_host"] = sharing  # the drift check judges the links in the same shares (adapt.py)
        if max(sharing, default=1) > 1:
            most = max(sharing)
            derived["reason"] += f" (a host's link shared by {'up to ' if min(sharing) < most else ''}{most} workers)"
        return derived

    def derived_tuning_locked(self) -> dict | None:
        """The settings for the job as it is now: its live servers, the rates measured at the start (times the
        drift check's scale). None where a rate is unknown."""
        live = [s for s in self._servers if not s.lost]
        _, info = placement_weights(self.config.placement, self._workers, live, self.config.server_efficiency)
        return self._derive_tuning(info)

    def retune_locked(self, why: str) -> dict | None:
        """Re-derive the settings for the job as it is now (after a failover or an elastic reset: other workers,
        fewer servers), from the rates measured at the start. Kept as they are where a node's rate is unknown (a
        standby or a joining worker on a host never measured). Returns the settings in force."""
        self.adaptation.cancel(why)  # a re-cut in progress: the job it was for has changed
        new = self.derived_tuning_locked()
        if new is not None and self.tuning is not None:
            keys = ("partition_bytes", "window", "unanswered")
            if any(new[k] != self.tuning[k] for k in keys):
                log.info("data path re-derived (%s): %s", why, new["reason"])
            self.tuning = new | {"derived_for": why}
        return self.tuning

    def _publish_locked(self, to: list[Node] | None = None) -> None:
        """Placement weights from the split model, the declarations, and the address book for everyone (or `to`)."""
        weights, self.placement_info = placement_weights(
            self.config.placement, self._workers, self._servers, self.config.server_efficiency
        )
        self.tuning = self._derive_tuning(self.placement_info)
        if self.tuning:
            log.info("data path tuning: %s", self.tuning["reason"])
        self.declarations = Declarations(
            self.config,
            [s.slot_bytes for s in self._servers],
            lambda rank, body: self._servers[rank].conn.send_json(FrameType.CONTROL, body),
            weights,
            num_workers=len(self._workers),
            address_of=lambda rank: _server_entry(self._servers[rank]),
        )
        book = self._address_book()
        for node in self._nodes if to is None else to:
            node.conn.send_json(
                FrameType.CONTROL,
                book | {"op": messages.ADDRESS_BOOK, "rank": node.rank, "standby": node.standby},
            )
        log.info("rendezvous complete: %d workers, %d servers", len(self._workers), len(self._servers))

    def _address_book(self) -> dict:
        # "lost": its keys moved onto the others (failover without a standby)
        servers = [_server_entry(s) | {"lost": s.lost} for s in self._servers]
        return {
            "epoch": self.epoch,
            "num_workers": len(self._workers),
            "servers": servers,
            "workers": [w.host for w in self._workers],
            "placement": self.placement_info,
            "tuning": self.tuning,  # derived from the links (gradwire/tuning.py); None when their rates are unknown
            "wall_time": time.time(),  # the job's clock: workers align their timelines to it
        }

    def _rendezvous_deadline(self) -> None:
        deadline = self.clock() + self.config.timeout
        while not self._done.wait(0.2):
            with self._lock:
                if self._workers or self._servers:
                    return
                if self.clock() > deadline:
                    have = {r: sum(n.role == r for n in self._nodes) for r in ("worker", "server")}
                    self._abort_locked(
                        f"rendezvous timed out after {self.config.timeout}s: {have['worker']}/"
                        f"{self.config.num_workers} workers and {have['server']}/{self.config.num_servers} "
                        "servers registered"
                    )
                    return

    # -- requests --------------------------------------------------------------------------------

    def _handle(self, node: Node, body: dict) -> bool:
        """Serve one request; True when the node has said bye."""
        op = messages.check(body)
        node.heard = self.clock()
        if op == messages.DECLARE:
            if self.declarations is None:
                raise GradwireError(f"worker {node.rank} declared a tensor before the rendezvous completed")
            self.declarations.declare(node.rank, body, lambda reply: self._answer_declaration(node, body["id"], reply))
        elif op == messages.BLOCKED and node.role == "worker" and self.declarations is not None:
            self.declarations.blocked(str(body["name"]), node.rank)
            self._break_barrier_deadlocks()
        elif op == messages.FAILOVER_STATE and node.role == "worker":
            with self._lock:
                entry = self._failover_states.get(int(body["epoch"]))
                if entry is not None:
                    everyone, reported = entry
                    reported[node.rank] = {int(k): (int(v[0]), int(v[1]), bool(v[2])) for k, v in body["keys"].items()}
                    if len(reported) >= len(self._live_workers()):
                        everyone.set()
        elif op == messages.PROBE_RESULT and node.probe is not None:
            node.probe.on_result(body)
        elif op == messages.HEARTBEAT:
            self._heartbeat(node, body["stats"])
        elif op == messages.RECUT_ROUNDS and node.role == "worker":
            with self._lock:
                self.adaptation.answered(node, body)
        elif op == messages.REPLY and node.role == "server":
            if self.declarations is not None:
                self.declarations.ack(int(body["id"]))
        elif op == messages.BARRIER:
            self._enter_barrier(node, int(body["id"]))
        elif op == messages.JOIN and node.role == "worker":
            self._join(node, int(body["id"]), {str(k): int(v) for k, v in body["rounds"].items()})
        elif op == messages.REJOIN and node.role == "worker":
            with self._lock:
                if self.membership is None:
                    raise GradwireError(f"worker {node.rank} asked to rejoin, but the job is not elastic")
                self.membership.rejoin(node, int(body["id"]))
        elif op == messages.SERVER_LOST and node.role == "worker":
            server = int(body["server"])
            if 0 <= server < len(self._servers) and int(body.get("epoch", 0)) >= self._servers[server].since_epoch:
                self._server_lost(self._servers[server], f"worker {node.rank} lost it: {body.get('error', '?')}")
        elif op == messages.BYE:
            # shutdown() in a process that lives on keeps its connection open: it may init() again, and its
            # connection closing (at exit, or once it has registered anew) is its final word
            node.final_bye = bool(body.get("final", True)) or node.role != "worker"
            if body.get("error") and self._failed(node, str(body["error"])):
                return True
            self._bye(node)
            return node.final_bye
        else:
            raise GradwireError(f"{node.role} {node.rank} sent unexpected op {op!r}")
        return False

    def _heartbeat(self, node: Node, stats: dict) -> None:
        now = self.clock()
        if not isinstance(stats, dict):
            raise GradwireError(f"{node.role} {node.rank} sent a malformed heartbeat")
        try:
            moved = (stats["bytes_pushed"] + stats["bytes_pulled"]) - (
                node.stats.get("bytes_pushed", 0) + node.stats.get("bytes_pulled", 0)
            )
            elapsed = max(now - node.last_seen, 1e-6)
            node.rate = max(0.0, moved / elapsed) if node.stats else 0.0
            node.round_rate = max(0.0, (stats["rounds"] - node.stats.get("rounds", 0)) / elapsed) if node.stats else 0.0
        except (KeyError, TypeError):
            raise GradwireError(f"{node.role} {node.rank} sent a malformed heartbeat") from None
        node.stats, node.last_seen = stats, now

    def _monitor(self) -> None:
        while not self._done.wait(self.config.heartbeat_interval):
            self.check_heartbeats()

    def check_heartbeats(self, now: float | None = None) -> list[Node]:
        """Declare lost every running node silent for longer than GRADWIRE_HEARTBEAT_TIMEOUT (aborts the job).

        Catches what a closed connection does not: a hung process, a host that vanished, a network partition.
        """
        now = self.clock() if now is None else now
        with self._lock:
            if not (self._workers or self._servers) or self._ending or self._done.is_set():
                return []
            joiners = (self.membership.joiners if self.membership is not None else []) + (self._between or [])
            silent = [
                n
                for n in self._nodes
                if not (n.said_bye or n.lost) and now - n.heard > self.config.heartbeat_timeout and n not in joiners
            ]
            servers = [n for n in silent if n.role == "server" and self._can_fail_over_locked(n)]
            silent = [n for n in silent if n not in servers]
            if self.membership is not None:
                for node in [n for n in silent if n.role == "worker"]:
                    self.membership.left(node, f"silent for {now - node.heard:.0f}s")
                silent = [n for n in silent if n.role != "worker"]
            for node in silent:
                node.lost = True
            if silent:
                first = silent[0]
                self._abort_locked(
                    f"lost {first.role} {first.rank} at {first.host}: silent for {now - first.heard:.0f}s "
                    f"(GRADWIRE_HEARTBEAT_TIMEOUT={self.config.heartbeat_timeout:g})",
                    lost=(first.role, first.rank),
                )
        for node in servers:
            self._server_lost(node, f"silent for {now - node.heard:.0f}s")
        return silent + servers

    def _break_barrier_deadlocks(self) -> None:
        """A worker blocked on a collective that waits for a worker waiting in a barrier: neither can go on (the
        barrier waits for the first). Fail that collective now, on every worker that called it."""
        declarations = self.declarations
        if declarations is None:
            return
        with self._lock:
            in_barrier = [n.rank for n, _ in self._barrier]
        for rank in in_barrier:
            declarations.cancel(f"worker {rank} entered a barrier without calling it", rank=rank, blocked_only=True)

    def _answer_declaration(self, node: Node, request_id: int, reply: dict) -> None:
        try:
            node.conn.send_json(FrameType.CONTROL, {"op": messages.REPLY, "id": request_id} | reply)
        except GradwireError:
            pass  # that worker's own loss is handled on its connection
        # after the reply, so the declarer gets the TensorError; a mismatch among workers fails only the tensor
        if "error" in reply and reply.get("abort", True) and not reply.get("mismatch"):
            with self._lock:
                self._abort_locked(reply["error"])

    def _enter_barrier(self, node: Node, request_id: int) -> None:
        with self._lock:
            self._barrier.append((node, request_id))
            gone = [w for w in self._workers if w.said_bye and not w.lost]
            complete = gone or len(self._barrier) >= sum(not w.lost for w in self._workers)
            if complete:
                waiting, self._barrier = self._barrier, []
        if not complete:
            self._break_barrier_deadlocks()
            return
        reply: dict = {"op": messages.REPLY}
        if gone:  # a worker that has left never enters: fail the barrier now instead of at the timeout
            reply |= {"error": _departed(gone), "lost_rank": gone[0].rank}
        for waiter, rid in waiting:
            waiter.conn.send_json(FrameType.CONTROL, reply | {"id": rid})

    def _join(self, node: Node, request_id: int, rounds: dict[str, int]) -> None:
        """Worker `node` is out of data (hvd.join). Until every worker has joined, the others' allreduces go on
        with zeros in the joined workers' place (the servers are told; declarations stop waiting for them). Once every
        worker has, each is answered with the last to join and, per tensor, the latest round any worker reached (a
        joined worker skipped rounds, and numbers its next one after them). One join at a time (each worker's request
        comes on its own thread): the servers must learn the joined sets in the order they were made."""
        with self._join_lock:
            self._join_locked(node, request_id, rounds)

    def _join_locked(self, node: Node, request_id: int, rounds: dict[str, int]) -> None:
        with self._lock:
            self._joins[node.rank] = (node, request_id, rounds)
            live = [w for w in self._workers if not w.lost]
            complete = all(w.rank in self._joins for w in live)
            joined = set() if complete else set(self._joins)
            servers = [s for s in self._servers if not s.lost and not s.standby]
            waiting = list(self._joins.values()) if complete else []
            if complete:
                self._joins = {}
        assert self.declarations is not None
        # every server has it in its engines' rings before anything that follows: the declarations that complete
        # now, and (once all have joined) the workers' next pushes, which must not be taken for joined ones'
        body = {"op": messages.JOINED, "ranks": sorted(joined)}
        for server in servers:
            if not self.declarations.call(server.rank, body):
                log.warning("server %d did not confirm the joined workers %s", server.rank, sorted(joined))
        self.declarations.set_joined(joined)
        if not complete:
            return
        latest: dict[str, int] = {}
        for _, _, reported in waiting:
            for name, rnd in reported.items():
                latest[name] = max(latest.get(name, 0), rnd)
        for waiter, rid, _ in waiting:
            reply = {"op": messages.REPLY, "id": rid, "last": node.rank, "rounds": latest}
            try:
                waiter.conn.send_json(FrameType.CONTROL, reply)
            except GradwireError:
                pass  # its own loss is handled on its connection

    def _bye(self, node: Node) -> None:
        with self._lock:
            node.said_bye = True
            waiting = self._barrier if node.role == "worker" and node in self._workers else []
            self._barrier = [] if waiting else self._barrier
        for waiter, rid in waiting:
            body = {"op": messages.REPLY, "id": rid, "error": _departed([node]), "lost_rank": node.rank}
            try:
                waiter.conn.send_json(FrameType.CONTROL, body)
            except GradwireError:
                pass  # that worker's own loss is handled on its connection
        if node.role == "worker" and self.declarations is not None:
            self.declarations.leave(node.rank, f"worker {node.rank} left the job (called shutdown())")
        if node.role == "worker" and node in self._workers:
            # the others' rounds that need its pushes fail on the servers, not at the timeout: at once after a
            # shutdown(); a moment later where its process ends, so that a launcher sees that exit first and names it
            # (not the others', which the failed rounds cause)
            if node.final_bye:
                timer = threading.Timer(DEPARTED_GRACE_SECONDS, self._tell_departed)
                timer.daemon = True
                timer.start()
            else:
                self._tell_departed()
        with self._lock:
            if not all(w.said_bye or w.lost for w in self._workers) or node.role != "worker":
                return
            if self.membership is not None and node not in self._workers:
                return  # a joiner that gave up
            if (
                self.membership is None
                and self.config.reinit_seconds > 0
                and not all(w.final_bye for w in self._workers)
            ):
                self._between, self._barrier, self._joins = [], [], {}
                self._generation.clear()
                threading.Thread(target=self._await_generation, name="gw-sched-reinit", daemon=True).start()
                log.info(
                    "every worker called shutdown(); waiting %gs for them to init() again", self.config.reinit_seconds
                )
                return
        self._end("every worker said bye; job complete")

    def _failed(self, node: Node, error: str) -> bool:
        """A worker's process ends because its script raised `error`. In an elastic job that ends the job, naming it:
        only membership changes are recovered from (Horovod's rule), since the replacement would run the same script
        into the same error, and the survivors would otherwise wait in rounds it never pushes. True if it did."""
        with self._lock:
            if self.membership is None or node not in self._workers or self._ending or self._done.is_set():
                return False
            node.lost = True
        why = (
            f"worker {node.rank} at {node.host} failed: {error}. An elastic job re-forms around a worker that dies or "
            "goes silent, not one whose training script raised: a replacement would raise it too"
        )
        # a moment later, as for a departure (_bye): a launcher then sees this worker's exit first and names it
        timer = threading.Timer(DEPARTED_GRACE_SECONDS, self._abort, args=(why, ("worker", node.rank)))
        timer.daemon = True
        timer.start()
        return True

    def _finishing_locked(self) -> bool:
        """Some worker of the job has said bye (shutdown(), or its process ended): its work is done, and the others
        are finishing theirs."""
        return any(w.said_bye for w in self._workers)

    def _tell_departed(self) -> None:
        """Tell the servers which workers have left (said bye) while others go on (server/engine.set_departed)."""
        with self._lock:
            left = sorted(w.rank for w in self._workers if w.said_bye)
            if self._done.is_set() or len(left) == len(self._workers):
                return  # the job is over, or ends now: no round waits
            self._tell([s for s in self._servers if not s.lost], {"op": messages.DEPARTED, "ranks": left})

    def _end(self, why: str) -> None:
        """Shut the servers down and end the job."""
        with self._lock:
            servers = [s for s in self._servers if not s.lost] + self._standby
            joiners = self.membership.joiners if self.membership is not None else []
            joiners += self._between or []  # a new generation that never filled up
            self._between = None
            # before the shutdowns go out: a server that closes on receiving one has not been lost
            self._ending = True
        self._tell(servers, {"op": messages.SHUTDOWN})
        self._tell(joiners, {"op": messages.ABORT, "message": "the job ended before it joined"})
        log.info("%s", why)
        self._done.set()

    # -- generations: shutdown() and init() again ---------------------------------------------------

    def _final_bye(self, node: Node) -> None:
        """A worker that had called shutdown() is gone for good (its process ended, or it registered anew). Once
        every worker of the last generation is, and no new one has registered, nobody can init() again."""
        with self._lock:
            node.final_bye = True
            over = self._between == [] and node in self._workers and all(w.final_bye for w in self._workers)
        if over:
            self._generation.set()
            self._end("every worker process has left; job complete")

    def _await_generation(self) -> None:
        """End the job unless the workers init() again within GRADWIRE_REINIT_SECONDS (all of them within
        GRADWIRE_TIMEOUT once the first is back), or once every worker process has gone (`_final_bye`)."""
        if self._generation.wait(self.config.reinit_seconds):
            return
        with self._lock:
            started = bool(self._between)
        if started and self._generation.wait(self.config.timeout):
            return
        if not self._done.is_set():
            self._end(f"no worker called init() again within {self.config.reinit_seconds:g}s; job complete")

    def _new_generation(self, workers: list[Node]) -> None:
        """The same servers, afresh: every key forgotten, a new epoch, new ranks, new declarations."""
        with self._lock:
            try:
                ranked = _rank("worker", self.config.num_workers, workers)
            except GradwireError as e:
                self._abort_locked(str(e))
                return
            for old, new in zip(self._workers, ranked, strict=False):
                new.link_rate = new.link_rate or old.link_rate  # measured at the first rendezvous
            self._nodes = [n for n in self._nodes if n.role != "worker" or n in workers]
            self._workers = ranked
            self.epoch += 1
            epoch, declarations = self.epoch, self.declarations
        assert declarations is not None
        for server in [s for s in self._servers if not s.lost]:
            body = {"op": messages.RESET, "epoch": epoch, "num_workers": len(ranked), "forget": True}
            if not declarations.call(server.rank, body):
                with self._lock:
                    self._abort_locked(f"server {server.rank} did not reset for the new generation (epoch {epoch})")
                return
        with self._lock:
            self._publish_locked(to=ranked)
        log.info("a new generation of %d workers started (epoch %d)", len(ranked), epoch)

    def _on_disconnect(self, node: Node | None, conn: tcp.Connection, error: Exception) -> None:
        conn.close()
        if node is None:
            self._gate.refuse(conn, f"dropped before registration: {error}")
            return
        if node.role == "server" and (node in self._servers or node in self._standby):
            self._server_lost(node, str(error))
            return
        if node.said_bye and not node.final_bye:
            self._final_bye(node)
            return
        with self._lock:
            if node.said_bye or node.lost or self._ending or self._done.is_set():
                return
            elastic = self.membership is not None and node.role == "worker"
            finishing = elastic and node in self._workers and self._finishing_locked()
            if elastic and not finishing:
                assert self.membership is not None
                self.membership.left(node, str(error))
                return
            if not finishing:
                node.lost = True
                self._abort_locked(f"lost {node.role} {node.rank} at {node.host}: {error}", lost=(node.role, node.rank))
                return
        # elastic, and the job is finishing (another worker is done): a departure, not a loss to re-form around (the
        # survivors would roll back and train again), nor one to abort on
        log.info("worker %d at %s ended while the job finishes: %s", node.rank, node.host, error)
        node.final_bye = True
        self._bye(node)

    # -- failover (docs/faults.md) ---------------------------------------------------------------

    def _can_fail_over_locked(self, node: Node) -> bool:
        live = [s for s in self._servers if not s.lost and s is not node]
        return self.config.server_failover and self.declarations is not None and bool(live or self._standby)

    def _server_lost(self, node: Node, why: str) -> None:
        """A server is gone: fail it over (in a thread of its own: it waits on the new owners), or abort."""
        with self._lock:
            if node.lost or node.said_bye or self._ending or self._done.is_set():
                return
            if node in self._standby:  # an idle standby: nothing to move
                node.lost = True
                self._standby.remove(node)
                log.warning("standby server at %s lost: %s", node.host, why)
                return
            if not self._can_fail_over_locked(node):
                node.lost = True
                self._abort_locked(f"lost server {node.rank} at {node.host}: {why}", lost=("server", node.rank))
                return
            node.lost = True
            self.epoch += 1
            standby = self._standby.pop(0) if self._standby else None
            if standby is not None:
                standby.rank = node.rank
                standby.standby = False
                standby.since_epoch = self.epoch
                self._servers[node.rank] = standby
            epoch = self.epoch
        assert self.declarations is not None
        self.declarations.abandon(node.rank)  # what waits on the dead server's replies goes on without them
        node.conn.close()  # fence it: a server the workers cannot reach must not go on summing
        threading.Thread(
            target=self._fail_over, args=(node, standby, epoch, why), name="gw-sched-failover", daemon=True
        ).start()

    def _fail_over(self, dead: Node, standby: Node | None, epoch: int, why: str) -> None:
        started = self.clock()
        assert self.declarations is not None
        log.warning("lost server %d at %s (%s): failing over in epoch %d", dead.rank, dead.host, why, epoch)
        try:
            with self.declarations.moving:  # declarations answered meanwhile wait: their keys may be moving
                # keys whose optimizer state the dead server held go to their replica, which has it (server/replica.py)
                moved = self.declarations.move_to_replicas(dead.rank)
                if standby is not None:
                    # confirmed before the workers hear of it: they connect to it at once, and a standby not yet
                    # promoted refuses them (the dead server's keys may all have gone to replicas: nothing else to
                    # wait on)
                    promote = {"op": messages.PROMOTE, "rank": dead.rank, "epoch": epoch}
                    self.declarations.revive(dead.rank)
                    if not self.declarations.call(dead.rank, promote):
                        raise GradwireError(
                            f"the standby taking server {dead.rank}'s place did not confirm its promotion"
                        )
                    self.declarations.register_all(dead.rank)
                    address: dict | None = _server_entry(standby)
                else:
                    moved |= self.declarations.evict(dead.rank)
                    address = None
        except (GradwireError, ValueError) as e:
            with self._lock:
                self._abort_locked(f"lost server {dead.rank} at {dead.host} ({why}) and could not fail over: {e}")
            return
        with self._lock:
            settings = self.retune_locked(f"server {dead.rank} lost")
        body = {"op": messages.REPLACE, "epoch": epoch, "server": dead.rank, "standby": address, "moved": moved}
        body["tuning"] = settings
        everyone, reported = threading.Event(), {}
        with self._lock:
            workers = self._live_workers()
            self._failover_states[epoch] = (everyone, reported)
        self._tell(workers, body)  # a worker that cannot be told is lost, which its own connection reports
        # every worker reports, per moved key, the round of the sum it holds and the round it resends; a round that
        # one worker resends and others hold the sum (or their contributions) of was being answered when the server
        # died: seed it (or replay them)
        if not everyone.wait(min(self.config.timeout, 60)):
            log.warning("not every worker reported its state after the failover in epoch %d", epoch)
        with self._lock:
            self._failover_states.pop(epoch, None)
            seeds = seeds_needed(dict(reported))
            seeders = {rank: self._workers[rank] for rank in seeds if rank < len(self._workers)}
        for rank, worker in seeders.items():
            self._tell([worker], {"op": messages.SEED, "epoch": epoch, "keys": seeds[rank]})
        record = {
            "server": dead.rank,
            "epoch": epoch,
            "seeds": sum(len(k) for k in seeds.values()),
            "to": "standby" if standby is not None else "survivors",
            "tensors_moved": len(moved),
            "seconds": self.clock() - started,
            "why": why,
        }
        self.failovers.append(record)
        log.warning(
            "server %d failed over to %s in %.1f ms (epoch %d)",
            dead.rank,
            record["to"],
            record["seconds"] * 1e3,
            epoch,
        )

    def _abort(self, reason: str, lost: tuple[str, int] | None = None) -> None:
        """`_abort_locked`, unless the job has ended meanwhile."""
        with self._lock:
            if not self._done.is_set():
                self._abort_locked(reason, lost)

    def _abort_locked(self, reason: str, lost: tuple[str, int] | None = None) -> None:
        if self.abort_reason is None:
            self.abort_reason = reason
            log.error("aborting the job: %s", reason)
        body = {"op": messages.ABORT, "message": reason}
        if lost is not None:
            body |= {"lost_role": lost[0], "lost_rank": lost[1]}
        self._tell(self._nodes, body)
        self._done.set()

    def _live_workers(self) -> list[Node]:
        """The workers of the job now: not lost, not gone."""
        return [w for w in self._workers if not (w.lost or w.said_bye)]

    @staticmethod
    def _tell(nodes: list[Node], body: dict) -> None:
        """Send a control message to each node; one that cannot be reached is lost, which its connection reports."""
        for node in nodes:
            try:
                node.conn.send_json(FrameType.CONTROL, body)
            except GradwireError:
                pass


def _departed(workers: list[Node]) -> str:
    ranks = ", ".join(str(w.rank) for w in workers)
    return (
        f"worker {ranks} left the job (called shutdown()) and will never enter this barrier: every worker must "
        "reach the same barriers before shutting down"
    )


def _server_entry(server: Node) -> dict:
    """How a worker reaches a server (the address book's entry, and a promoted standby's)."""
    return {
        "host": server.host,
        "port": server.port,
        "slot_bytes": server.slot_bytes,
        "unix": server.unix,
        "host_id": server.host_id,
    }


def seeds_needed(reported: dict[int, dict[int, tuple[int, int, bool]]]) -> dict[int, list[list[int]]]:
    """{worker: [[key, round], ...]} to seed: for each moved key, a round some worker resends while others hold
    what they got of it (the dead server answered some workers only). A holder of the sum: one seeds it, the lowest
    rank. Holders of only their contributions (a sliced key, whose ranks each pull a slice): every one replays its
    own, and with the waiting workers' resent pushes the round is whole again."""
    out: dict[int, list[list[int]]] = {}
    keys = {k for state in reported.values() for k in state}
    for key in sorted(keys):
        waiting = {state[key][1] for state in reported.values() if key in state and state[key][1] >= 0}
        for rnd in sorted(waiting):
            holders = sorted(r for r, state in reported.items() if key in state and state[key][0] == rnd)
            sums = [r for r in holders if not reported[r][key][2]]
            for rank in sums[:1] or holders:
                out.setdefault(rank, []).append([key, rnd])
    return out


def _role(node: Node) -> str:
    return "standby" if node.standby else node.role


def _number(standby: list[Node], count: int) -> list[Node]:
    """Standby servers: ranks are assigned when one takes a dead server's place; until then -1."""
    if len(standby) != count:
        raise GradwireError(f"expected {count} standby servers, {len(standby)} registered")
    return list(standby)


def _rank(role: str, count: int, nodes: list[Node]) -> list[Node]:
    """Fix ranks: requested ones are honoured, the rest fill the gaps in order of arrival."""
    if len(nodes) != count:
        raise GradwireError(f"expected {count} {role}s, {len(nodes)} registered")
    ranks: dict[int, Node] = {}
    for node in nodes:
        r = node.requested_rank
        if r is None:
            continue
        if not 0 <= r < count:
            raise GradwireError(f"{role} asked for rank {r}, outside [0, {count})")
        if r in ranks:
            raise GradwireError(f"two {role}s asked for rank {r} ({ranks[r].conn.peer} and {node.conn.peer})")
        ranks[r] = node
    free = iter(r for r in range(count) if r not in ranks)
    for node in nodes:
        if node.requested_rank is None:
            ranks[next(free)] = node
    for r, node in ranks.items():
        node.rank = r
        node.conn.peer_rank = r
    return [ranks[r] for r in range(count)]
