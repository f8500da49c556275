"""The worker: one per training process. Owns the links to every server and the scheduler connection."""

from __future__ import annotations

import itertools
import json
import logging
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from gradwire import partition
from gradwire.admin import timeline
from gradwire.admin.metrics import Metrics
from gradwire.admin.node import NodeAdmin
from gradwire.admin.timeline import Timeline
from gradwire.config import Config
from gradwire.errors import (
    ConfigError,
    GradwireError,
    GradwireTimeout,
    JobAborted,
    MembershipChanged,
    TensorError,
    TensorMismatch,
    WorkerLost,
    abort_error,
)
from gradwire.protocol import dtypes, messages, update
from gradwire.protocol.frames import REPLAY, SEED, FrameType, encode_header
from gradwire.scheduler.client import join
from gradwire.transport import shm, tcp
from gradwire.worker.control import Request
from gradwire.worker.credit import Credit
from gradwire.worker.handle import Handle
from gradwire.worker.link import ServerLink
from gradwire.worker.lost_link import LostLink
from gradwire.worker.tensors import Recut, Tensor
from gradwire.worker.work import Saved, Work

log = logging.getLogger("gradwire.worker")
SHUTDOWN_JOIN_SECONDS = 5.0
SEED_PRIORITY = 1 << 62  # seeds leave a new link before anything else


class Worker:
    """A worker's connection to the job.

    Blocking: `start`, `declare`, `barrier`, `synchronize` and `push_pull` block (each at most
    `config.timeout`); `push_pull_async` and `poll` do not. Thread-safe, but one tensor name may have
    only one push_pull in flight at a time.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.rank = -1
        self.size = 0
        self.local_rank = 0
        self.local_size = 1
        self.epoch = 0
        self._secret = config.secret_bytes()
        self._scheduler: tcp.Connection | None = None
        self._links: list[ServerLink] = []
        self._tensors: dict[str, Tensor] = {}
        self._versions: dict[str, list[tuple[tuple[int, ...], dtypes.DType]]] = {}  # user name -> its signatures
        self._lock = threading.Lock()
        self._requests: dict[int, Request] = {}  # to the scheduler, by id, until answered (worker/control.py)
        self._ids = itertools.count(1)
        self._partition_bytes = config.partition_bytes
        self._slot_limit = config.partition_bytes  # the servers' slot size (the address book's)
        self._round_floor: dict[str, int] = {}  # tensors others summed while this worker had joined: their rounds
        self._abort: JobAborted | None = None
        self._closed = False
        self._control_thread: threading.Thread | None = None
        self._active = 0  # push_pull handles in flight
        self.metrics = Metrics("worker")
        self.timeline: Timeline | None = None
        self.credit: Credit | None = None
        self.admin: NodeAdmin | None = None
        # failover (docs/faults.md): each key's last sum, the server of every key, and moves the scheduler announced
        self._saved: dict[int, Saved] | None = {} if config.server_failover else None
        self._owner: dict[int, int] = {}
        self._moves: dict[str, list[int]] = {}
        self._failover_lock = threading.Lock()
        self.failovers: list[dict] = []  # what happened at each failover, for status and tests
        self._lost_at: dict[int, float] = {}  # when a link to each server died (wall clock), for the record
        # elastic mode (docs/faults.md): why calls fail until reset(), and how many workers wait to join
        self._membership_error: MembershipChanged | None = None
        self.joining = 0
        self.resets: list[dict] = []
        self.placement: dict = {}
        self.tuning: dict | None = None  # the scheduler's derived data-path settings (gradwire/tuning.py)
        self._rejoin_id = -1
        self._clock_skew = 0.0  # the scheduler's wall clock minus this host's (seconds)
        self.hosts: list[str] = []
        # re-cuts (scheduler/adapt.py): the rounds reported for the one in step 1 (calls past them wait for RETUNE)
        self.recut = Recut(self._lock)  # re-cuts while the job runs (worker/tensors.py)
        self._use_before: dict[str, float] = {}  # link use counted by credits and links since replaced (elastic reset)

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> Worker:
        """Rendezvous, connect to every server, and pass the first barrier."""
        if self.config.switch_interval > 0:
            # I/O threads wait up to one switch interval (default 5 ms) for the GIL while the training
            # thread runs Python: 3x to 60x slower messages, measured (shared/MEASUREMENTS.md).
            sys.setswitchinterval(self.config.switch_interval)
        self.admin = NodeAdmin(self.config, self.metrics, self.status)
        book = self._rendezvous()
        self._apply_book(book)
        self.credit = self._new_credit()
        if self.config.timeline:
            tracks = {i: f"server {i}" for i in range(len(book["servers"]))}
            self.timeline = Timeline(
                timeline.path_for(self.config.timeline, self.rank),
                self.rank,
                self.config.timeline_steps,
                tracks,
                skew=self._clock_skew,
            )
        self._connect_all(book["servers"])
        self.metrics.gauge(
            "gradwire_credit_in_flight_bytes",
            "Bytes pushed and not yet acknowledged",
            lambda: self.credit.used if self.credit else 0,
        )
        self.metrics.gauge("gradwire_push_pulls_in_flight", "push_pull handles not yet complete", lambda: self._active)
        self.metrics.extra = self._link_use
        self._control_thread = threading.Thread(target=self._control_loop, name="gw-worker-control", daemon=True)
        self._control_thread.start()
        assert self._scheduler is not None
        self.admin.start_heartbeat(self._scheduler)
        self.barrier()
        log.info("worker %d/%d ready with %d servers", self.rank, self.size, len(self._links))
        return self

    def start_timeline(self, path: str) -> None:
        """Start writing this worker's timeline to `path` (`{rank}` in it is replaced), as GRADWIRE_TIMELINE does;
        a timeline already being written is closed first."""
        self.stop_timeline()
        tracks = {link.server: f"server {link.server}" for link in self._links}
        timeline = Timeline(
            path.format(rank=self.rank) if "{rank}" in path else path,
            self.rank,
            self.config.timeline_steps,
            tracks,
            skew=self._clock_skew,
        )
        self.timeline = timeline
        for link in self._links:
            link.timeline = timeline

    def stop_timeline(self) -> None:
        """Stop writing the timeline (its file keeps what was written)."""
        timeline, self.timeline = self.timeline, None
        for link in self._links:
            link.timeline = None
        if timeline is not None:
            timeline.close()

    def leave(self) -> None:
        """After `shutdown(final=False)`: close the scheduler connection, the worker's last word (its process
        ends, or it has joined the job's next generation). Idempotent."""
        if self._scheduler is not None:
            self._scheduler.close()
        if self._control_thread is not None and self._control_thread is not threading.current_thread():
            self._control_thread.join(SHUTDOWN_JOIN_SECONDS)

    def _apply_book(self, book: dict) -> None:
        self.rank, self.size, self.epoch = book["rank"], book["num_workers"], book["epoch"]
        self.tuning = book.get("tuning")
        self.config = self.config.tuned(self.tuning)  # derived from the links, where not set explicitly
        self.placement = book.get("placement") or {}  # the scheduler's weights and the rates it used
        hosts = book.get("workers") or []
        self.hosts = list(hosts)  # each worker's host, by rank (cross_rank, is_homogeneous)
        same_host = [r for r, h in enumerate(hosts) if h == hosts[self.rank]] if hosts else [self.rank]
        self.local_rank = self.config.local_rank if self.config.local_rank is not None else same_host.index(self.rank)
        self.local_size = self.config.local_size if self.config.local_size is not None else len(same_host)
        live = [s for s in book["servers"] if not s.get("lost")]
        self._slot_limit = min(int(s["slot_bytes"]) for s in live) if live else self.config.partition_bytes
        self._partition_bytes = min(self.config.partition_bytes, self._slot_limit)

    def _retune(self, tuning: dict | None) -> None:
        """The scheduler re-derived the data path's settings (after a failover): every link's window and cap from
        now on, and the partition size of tensors declared from now on (declared ones keep their keys)."""
        if not tuning or tuning == self.tuning:
            return
        self.tuning = tuning
        self.config = self.config.tuned(tuning)
        self._partition_bytes = min(self.config.partition_bytes, self._carry_limit())
        if self.credit is not None:  # pacing's lead is counted in partitions
            self.credit.set_lead(self._pacing_lead())
        for link in self._links:
            if isinstance(link, ServerLink):
                link.set_flow(self.config.window, self.config.unanswered)

    def _carry_limit(self) -> int:
        """The largest partition every link of this worker carries: the servers' slots, and the shared-memory slots
        this worker's arenas were made with (at the partition size of the time)."""
        arenas = [link.arena.slot_bytes for link in self._links if isinstance(link, ServerLink) and link.arena]
        return min([self._slot_limit, *arenas])

    def _link_use(self) -> dict:
        """The network links' use so far, for the heartbeat: the scheduler's drift check (tuning.Drift)."""
        busy, moved = self.credit.busy() if self.credit else (0.0, 0)
        full = sum(link.flow.full_seconds for link in self._links if getattr(link, "network", False))
        now = {"link_busy_seconds": busy, "link_bytes": moved, "window_full_seconds": full}
        return {k: self._use_before.get(k, 0) + v for k, v in now.items()}

    def _recut_rounds(self, body: dict) -> None:
        """RECUT (step 1 of a re-cut, worker/tensors.py): report each tensor's round, and hold calls two rounds
        past it until RETUNE says where the new partitions begin."""
        with self._lock:
            rounds = self.recut.hold(list(self._tensors.values()), int(body["generation"]))
        reply = {
            "op": messages.RECUT_ROUNDS,
            "generation": body["generation"],
            "rounds": rounds,
            "largest_partition": self._carry_limit(),
        }
        if "partition_bytes" in self.config.explicit:
            reply["fixed"] = True
        assert self._scheduler is not None
        self._scheduler.send_json(FrameType.CONTROL, reply)

    def _on_retune(self, body: dict) -> None:
        """RETUNE: new settings (scheduler/adapt.py); `switch`: per tensor, the round from which it is cut anew."""
        self._retune(body["tuning"])
        generation, switch = int(body.get("generation", 0)), body.get("switch") or {}
        with self._lock:
            who = f"worker {self.rank}"
            successors = self.recut.cut(self._tensors, switch, generation, self._partition_bytes, who)
        for new in successors:
            self._send_declaration(new, "sum", None, None, None, None)
        if successors:
            log.info(
                "worker %d re-cuts %d tensors into %d-byte partitions",
                self.rank,
                len(successors),
                self._partition_bytes,
            )

    def _connect_all(self, servers: list[dict]) -> None:
        links: list[ServerLink | LostLink] = []
        for index, server in enumerate(servers):
            links.append(LostLink(index, self._resubmit) if server.get("lost") else self._link(index, server))
        self._links = links
        for link in links:
            link.start()

    def _new_credit(self) -> Credit:
        return Credit(self.config.credit_bytes, self._pacing_lead())

    def _pacing_lead(self) -> int:
        """Pacing's lead in bytes: GRADWIRE_PACING partitions of the partition size in use."""
        return self.config.pacing * self._partition_bytes

    def _link(self, index: int, server: dict) -> ServerLink:
        conn, arena = self._connect_server(server)
        assert self.credit is not None
        link = ServerLink(
            conn,
            index,
            self.rank,
            self.epoch,
            self.config.window,
            self.credit,
            arena,
            self.metrics,
            self.timeline,
            self.config.unanswered,
            saved=self._saved,
            on_lost=self._on_link_lost if self._saved is not None else None,
        )
        weights = [float(w) for w in self.placement.get("weights") or []]
        if link.transport == "tcp" and index < len(weights):  # only links on the network are paced
            self.credit.pace(index, weights[index] / sum(weights))
        return link

    def _connect_server(self, server: dict) -> tuple[tcp.Connection, shm.Arena | None]:
        """To a server on this host and network namespace a Unix socket with shared slots; else TCP."""
        options = dict(
            secret=self._secret,
            role="worker",
            rank=self.rank,
            max_payload=self._slot_limit,  # partitions may grow to the servers' slots: a re-cut (scheduler/adapt.py)
            timeout=self.config.timeout,
            buffer_bytes=self.config.socket_buffer_bytes,
        )
        local = server.get("host_id") and server["host_id"] == tcp.host_identity()
        if self.config.transport in ("auto", "unix") and local and server.get("unix"):
            try:
                conn = tcp.connect(server["unix"], **options)  # type: ignore[arg-type]
            except OSError as e:
                log.info("Unix socket to server at %s failed (%s); using TCP", server["host"], e)
            else:
                return conn, self._attach_shared(conn) if self.config.transport == "auto" else None
        return tcp.connect((server["host"], int(server["port"])), **options), None  # type: ignore[arg-type]

    def _attach_shared(self, conn: tcp.Connection) -> shm.Arena | None:
        """Offer the server shared slots; None (plain socket transfers) if either side cannot."""
        window = self.config.window
        try:
            arena = shm.Arena.create(window, 2 * window, self._partition_bytes)
        except (OSError, ValueError) as e:
            log.info("no shared memory (%s); using the socket", e)
            return None
        try:
            body = {"path": arena.path, "push": arena.push, "pull": arena.pull, "slot_bytes": arena.slot_bytes}
            conn.send_json(FrameType.SHM_ATTACH, body)
            conn.sock.settimeout(self.config.timeout)
            _, reply = conn.recv_json(FrameType.SHM_ATTACH)
            conn.sock.settimeout(None)
        finally:
            arena.unlink()  # mapped on both sides now (or refused): nothing stays in /dev/shm
        if not reply.get("ok"):
            log.info("server refused shared memory: %s", reply.get("error"))
            arena.close()
            return None
        return arena

    def _rendezvous(self) -> dict:
        """Join the job; also the skew of this host's wall clock against the scheduler's, from the address book's
        stamp (late by the book's one-way trip: well under a millisecond on a LAN), for the timeline's time base."""
        self._scheduler, book = join(
            self.config,
            "worker",
            port=0,
            admin=self.admin.port,
            admin_host=self.admin.advertised_host,
            host_id=tcp.host_identity(),
            link_rate=self.config.link_rate_bytes(),
        )
        self._clock_skew = float(book.get("wall_time", time.time())) - time.time()
        return book

    def status(self) -> dict:
        """This worker's view, for its /status."""
        links = [
            {
                "server": link.server,
                "peer": link.conn.peer,
                "transport": link.transport,
                "outstanding_tensors": len(link.outstanding()),
            }
            for link in self._links
        ]
        return {
            "role": "worker",
            "rank": self.rank,
            "size": self.size,
            "epoch": self.epoch,
            "tensors": len(self._tensors),
            "push_pulls_in_flight": self._active,
            "credit_in_flight_bytes": self.credit.used if self.credit else 0,
            "servers": links,
            "aborted": str(self._abort) if self._abort else None,
            "data_path": {
                "partition_bytes": self._partition_bytes,
                "window": self.config.window,
                "unanswered": self.config.unanswered,
                "why": (self.tuning or {}).get("reason", "the defaults and GRADWIRE_* settings"),
                "derived_again": (self.tuning or {}).get("derived_for"),  # after a failover or an elastic reset
                "set_explicitly": sorted(self.config.explicit & {"partition_bytes", "window", "unanswered"}),
                "recuts": self.recut.history[-5:],  # tensors cut anew while the job runs (scheduler/adapt.py)
            },
            **self.metrics.snapshot(),
        }

    def shutdown(self, final: bool = True, error: str | None = None) -> None:
        """Say bye to the servers and the scheduler, close everything, and join this worker's threads. Idempotent.

        `error`: the process ends because the training script raised this (gradwire/session.py reads it at exit). In an
        elastic job the scheduler then ends the job naming it rather than re-forming: a replacement would raise it too.

        `final=False` (gradwire.shutdown()): this process may init() again. The scheduler connection stays open
        until `leave()` (or the process's end) closes it; until every worker has left so, or for at most
        GRADWIRE_REINIT_SECONDS, the scheduler and servers wait for a new generation instead of ending the job.

        Joining matters: daemon threads still alive when the interpreter finalizes have been seen to abort the
        process ("terminate called without an active exception") once PyTorch is loaded.
        """
        if self._closed:
            return
        self._closed = True
        for link in self._links:
            try:
                link.conn.send([_bye()])
            except GradwireError:
                pass
            link.close(JobAborted("worker shut down"))
        if self._scheduler is not None:
            try:
                bye = {"op": messages.BYE, "final": final} | ({"error": error} if error else {})
                self._scheduler.send_json(FrameType.CONTROL, bye)
            except GradwireError:
                pass
            if final:
                self._scheduler.close()
        for link in self._links:
            link.join(SHUTDOWN_JOIN_SECONDS)
        if final and self._control_thread is not None and self._control_thread is not threading.current_thread():
            self._control_thread.join(SHUTDOWN_JOIN_SECONDS)
        if self.admin is not None:
            self.admin.stop()
        if self.timeline is not None:
            self.timeline.close()

    # -- tensors ---------------------------------------------------------------------------------

    def declare(
        self,
        name: str,
        shape: tuple[int, ...] | list[int],
        dtype: object,
        key_op: str = "sum",
        slices: list[tuple[int, int]] | None = None,
        meta: str | None = None,
        wait: bool = True,
        members: list[int] | None = None,
        op_args: dict | None = None,
    ) -> Tensor:
        """Declare a tensor (idempotent). Every worker must declare `name` with the same shape and dtype.

        A declaration completes when every worker has made it: the scheduler compares them all first, so a worker
        that disagrees (another shape, dtype or collective) fails it on every worker at once with a TensorMismatch
        naming each worker's call, before any byte moves, and the job goes on. With `wait` False this returns at
        once; calls on the tensor then wait for the declaration and go out when it completes.

        A name used again with another shape or dtype (two models whose parameters share names, a metric whose
        length changes) is a new declaration: each (name, shape, dtype) is its own tensor on the servers, numbered
        in the order this worker first used it (`name`, then `name#1`, `name#2`, ...). Workers running the same
        program number them alike, and the scheduler checks each number's shape across workers as for any name.

        `key_op` is what the servers compute over its rounds (server/ops.py: sum, min, max, product, gather), and
        `slices`, per rank, the (first element, count) of the result that rank pulls (None: all of it). `meta` is
        anything else every worker must agree on (a broadcast's root rank), checked like the shape. `members` are
        the ranks that call it (a process set; None: every worker): only they declare it, and its rounds are theirs.
        `op_args` configure a built operation (`optimizer`: protocol/update.py), checked across workers like the shape.
        """
        shape = tuple(int(d) for d in shape)
        wire = dtypes.from_numpy(dtype)
        cut = tuple((int(a), int(b)) for a, b in slices) if slices is not None else None
        ranks = tuple(sorted(members)) if members is not None else None
        args = update.encode_args(op_args) if op_args is not None else None
        signature = (shape, wire, key_op, cut, meta, ranks, args)
        with self._lock:
            versions = self._versions.setdefault(name, [])
            if signature not in versions:
                versions.append(signature)
            version = versions.index(signature)
            internal = name if version == 0 else f"{name}#{version}"
            if ranks is not None:  # a process set's tensor is its own, whatever other sets call theirs
                internal += "@ranks" + "-".join(map(str, ranks))
            tensor = self._tensors.get(internal)
            new = tensor is None
            if tensor is None:
                tensor = self._tensors[internal] = Tensor(
                    internal, shape, wire, user_name=name, signature=signature, root=internal
                )
                tensor.round = self._round_floor.pop(internal, 0)  # rounds others summed while this worker had joined
        if new:
            self._send_declaration(tensor, key_op, cut, meta, ranks, args)
        if wait:
            if not tensor.ready.wait(self.config.timeout):
                raise GradwireTimeout(
                    f"worker {self.rank}: the declaration of {internal!r} did not complete in {self.config.timeout}s: "
                    "every worker must declare it (call the same collective on it)",
                    tensor=internal,
                )
            if tensor.error is not None:
                raise tensor.error
        return tensor

    def _send_declaration(
        self,
        tensor: Tensor,
        key_op: str,
        slices: tuple | None,
        meta: str | None,
        members: tuple | None,
        args: str | None,
    ) -> None:
        # a server-side update's pushes carry a trailer after each partition's data: partitions leave room for it
        trailer = update.TRAILER_BYTES if key_op == "optimizer" else 0
        body = {
            "op": messages.DECLARE,
            "name": tensor.name,
            "shape": list(tensor.shape),
            "dtype": tensor.dtype.name,
            "partition_bytes": self._partition_bytes - trailer,
        }
        if args is not None:
            body["op_args"] = json.loads(args)
            tensor.stateful = True
        if key_op != "sum":
            body["key_op"] = key_op
        if slices is not None:
            body["slices"] = [list(s) for s in slices]
        if meta is not None:
            body["meta"] = meta
        if members is not None:
            body["members"] = list(members)
        try:
            self._check_usable()
            self._request_async(body, lambda reply: self._declared(tensor, reply))
        except GradwireError as e:
            self._declared(tensor, None, e)

    def _declared(self, tensor: Tensor, reply: dict | None, error: GradwireError | None = None) -> None:
        """The scheduler answered a declaration (on the control thread; `reply` None: cancelled by `error`, or by
        an abort or a membership change): complete the tensor, and send or fail the calls that waited for it."""
        if reply is None:
            error = error or self._abort or self._membership_error or JobAborted(f"worker {self.rank}: cancelled")
        elif "error" in reply:
            kind = TensorMismatch if reply.get("mismatch") else TensorError
            error = kind(f"worker {self.rank}: {reply['error']}", tensor=tensor.name, rank=self.rank)
        with self._lock:
            if error is None:
                assert reply is not None
                num = int(np.prod(tensor.shape, dtype=np.int64))
                # the job's partition size (the scheduler's answer), so every worker cuts the tensor the same way
                tensor.parts = partition.split(num, tensor.dtype.itemsize, int(reply["partition_bytes"]))
                tensor.keys = [partition.key_of(tensor.name, p.index) for p in tensor.parts]
                # a failover may have moved the tensor between the scheduler's reply and now
                tensor.servers = list(self._moves.get(tensor.name, reply["servers"]))
                self._owner.update(zip(tensor.keys, tensor.servers, strict=True))
            else:  # forgotten, so that the name may be declared again (with the shapes the workers agree on)
                tensor.error = error
                if self._tensors.get(tensor.name) is tensor:
                    del self._tensors[tensor.name]
                versions = self._versions.get(tensor.user_name, [])
                if tensor.signature in versions and versions.index(tensor.signature) == len(versions) - 1:
                    versions.pop()
            waiting, tensor.waiting = tensor.waiting, []
            tensor.ready.set()
        for fn in waiting:
            fn(error)

    def push_pull_async(
        self,
        array: np.ndarray,
        name: str,
        average: bool = False,
        priority: int = 0,
        out: np.ndarray | None = None,
        dtype: object = None,
        op: str = "sum",
        members: list[int] | None = None,
    ) -> Handle:
        """Start summing `array` across workers; the sum (or average) lands in `out` (a new array if None).
        `op` is the reduction: "sum" (the default), "min", "max" or "product". `members`: only these ranks take
        part (a process set; each of them calls it, the average divides by their number).

        `out` may be `array` itself (in place). Neither may be modified until the handle completes.
        `dtype` overrides the wire dtype name (e.g. "bfloat16" for uint16-held bfloat16 bits).
        """
        self._check_usable()
        if not isinstance(array, np.ndarray):
            raise TensorError(f"push_pull of {name!r} needs a numpy array, got {type(array).__name__}", tensor=name)
        # np.ascontiguousarray turns a 0-dim array into shape (1,): keep the caller's shape (a scalar is a tensor)
        src = array if array.flags.c_contiguous else np.ascontiguousarray(array).reshape(array.shape)
        if out is None:
            out = np.empty_like(src)
        elif out.shape != src.shape or out.dtype != src.dtype:
            raise TensorError(
                f"worker {self.rank}: push_pull of {name!r} got an input of {src.dtype}{list(src.shape)} but an "
                f"output of {out.dtype}{list(out.shape)}; pass an output of the input's shape and dtype",
                tensor=name,
                rank=self.rank,
            )
        elif not out.flags.c_contiguous:
            raise TensorError(
                f"worker {self.rank}: the output of push_pull {name!r} must be C-contiguous (got strides "
                f"{out.strides}); pass np.ascontiguousarray(out) or no output",
                tensor=name,
                rank=self.rank,
            )
        tensor = self.declare(name, src.shape, dtype or src.dtype, op, wait=False, members=members)
        return self._launch(
            tensor, out, src.reshape(-1), 0, out.reshape(-1), 0, self._divisor(average, members), priority
        )

    def _launch(
        self,
        tensor: Tensor,
        out: np.ndarray,
        send: np.ndarray,
        send_at: int,
        pull: np.ndarray,
        pull_at: int,
        average: int,
        priority: int,
        extra: np.ndarray | None = None,
        partial: bool = False,
        same_round: bool = False,
    ) -> Handle:
        """Push every partition of `tensor`'s next round: `send` holds the elements [send_at, send_at + len) of the
        tensor that this worker contributes (all of them for a reduction, its own segment for a gather); the result's
        elements [pull_at, pull_at + len) land in `pull` (a view of `out`): all of them, or this rank's slice.
        `extra`: bytes every partition's push carries after its data (a server-side update's trailer). `partial`: the
        answers are not results to keep for a failover (reads of a server's state). `same_round`: not a new round
        (a read or write that its server answers outside the rounds)."""
        tensor = self._follow(tensor)
        handle, rnd = self._begin(tensor, out, same_round)

        def submit(error: GradwireError | None) -> None:
            if error is not None:
                handle.fail(error)
                return
            with self._lock:
                servers = list(tensor.servers)
            handle.add_parts(len(tensor.parts))
            code, sent, pulled = tensor.dtype.code, len(send), len(pull)
            extra_view = memoryview(extra).cast("B") if extra is not None else None
            for part, key, server in zip(tensor.parts, tensor.keys, servers, strict=True):
                lo, hi = part.start, part.start + part.count
                give = send[min(max(lo - send_at, 0), sent) : min(max(hi - send_at, 0), sent)]
                take = pull[min(max(lo - pull_at, 0), pulled) : min(max(hi - pull_at, 0), pulled)]
                sliced = len(take) < hi - lo
                work = Work(
                    tensor.name,
                    key,
                    rnd,
                    code,
                    give,
                    take,
                    average,
                    handle,
                    part.index,
                    partial=partial or sliced,
                    replayable=sliced and not partial,
                )
                self._links[server].submit(work.trail(extra_view), priority)
            handle.part_done()  # the declaration's part

        with self._lock:
            declared = tensor.ready.is_set()
            if not declared:
                tensor.waiting.append(submit)
        if declared:
            submit(tensor.error)
        return handle

    def _follow(self, tensor: Tensor) -> Tensor:
        """The tensor whose keys take `tensor`'s next round: itself, or its re-cut's successor from the round the
        scheduler chose (worker/tensors.py). Waits while a re-cut's step 1 holds the round, and for the successor's
        declaration (neither waits for the data path); a successor the scheduler refused is dropped on every worker
        alike, and the tensor keeps its partitions."""
        if tensor.successor is None and not self.recut.holds:
            return tensor
        deadline = time.monotonic() + self.config.timeout
        with self._lock:
            current = self.recut.wait_turn(tensor, self.config.timeout, f"worker {self.rank}")
            previous = [t for t in tensor.chain() if t is not current and t.in_flight is not None]
        if previous:  # what _begin checks, across the re-cut
            raise self._in_flight_error(previous[0])
        if current is not tensor and not current.ready.wait(max(0.0, deadline - time.monotonic())):
            raise GradwireTimeout(
                f"worker {self.rank}: the re-cut of {tensor.root!r} was not declared in {self.config.timeout}s",
                tensor=current.name,
            )
        if current.error is not None:
            with self._lock:
                for t in tensor.chain():
                    if t.successor is not None and t.successor[1] is current:
                        t.successor = None
            log.warning("worker %d: %r keeps its partitions: %s", self.rank, tensor.root, current.error)
            return self._follow(tensor)
        return current

    def _divisor(self, average: bool, members: list[int] | None) -> int:
        """What the sum is divided by: the number of ranks taking part, for an average."""
        return (self.size if members is None else len(members)) if average else 1

    def _check_output(self, what: str, name: str, out: np.ndarray, count: int, dtype: np.dtype) -> None:
        if out.size != count or not out.flags.c_contiguous or out.dtype != dtype:
            raise TensorError(
                f"worker {self.rank}: {what} for {self.size} workers needs a C-contiguous output of {count} {dtype} "
                f"elements, got {out.size} {out.dtype}",
                tensor=name,
                rank=self.rank,
            )

    def reduce_scatter_async(
        self,
        array: np.ndarray,
        name: str,
        slices: list[tuple[int, int]],
        out: np.ndarray,
        average: bool = False,
        priority: int = 0,
        op: str = "sum",
        dtype: object = None,
        members: list[int] | None = None,
    ) -> Handle:
        """Reduce `array` across workers and receive only this worker's part of the result: worker r receives
        `slices[r]` = (first element, count) of the flattened result into its `out`. Each worker pushes all of its
        array and pulls only its slice (half an allreduce's bytes). Every worker passes the same `slices`."""
        self._check_usable()
        src = np.ascontiguousarray(array).reshape(array.shape)
        first, count = slices[self.rank] if len(slices) == self.size else (0, -1)
        self._check_output(f"reduce-scatter of {name!r} with slices {slices}", name, out, count, src.dtype)
        tensor = self.declare(name, src.shape, dtype or src.dtype, op, slices, wait=False, members=members)
        n = self._divisor(average, members)
        return self._launch(tensor, out, src.reshape(-1), 0, out.reshape(-1), first, n, priority)

    def gather_async(
        self,
        array: np.ndarray,
        name: str,
        counts: list[int],
        out: np.ndarray,
        slices: list[tuple[int, int]] | None = None,
        priority: int = 0,
        shape: tuple[int, ...] | None = None,
        meta: str | None = None,
        dtype: object = None,
        members: list[int] | None = None,
    ) -> Handle:
        """Concatenate every worker's `array` (flattened), in rank order, on the servers.

        `counts[r]` is the number of elements worker r contributes (this worker's must be `array.size`). The result
        has sum(counts) elements; worker r receives `slices[r]` = (first, count) of them into its `out` (None: all
        of them). So a broadcast is a gather to which only the root contributes, and an alltoall is one gather per
        destination that only the destination pulls. Every worker passes the same `counts` and `slices`. `shape` is
        what the tensor is declared as (checked across workers); it defaults to (sum(counts),). `dtype` overrides the
        wire dtype's name (bfloat16 held as uint16).
        """
        self._check_usable()
        counts = [int(c) for c in counts]
        if len(counts) != self.size or counts[self.rank] != array.size or min(counts) < 0:
            raise TensorError(
                f"worker {self.rank}: gather of {name!r} got counts {counts} for {self.size} workers and "
                f"{array.size} elements of its own",
                tensor=name,
                rank=self.rank,
            )
        total = sum(counts)
        first, count = slices[self.rank] if slices is not None else (0, total)
        self._check_output(f"gather of {name!r}", name, out, count, array.dtype)
        src = np.ascontiguousarray(array).reshape(-1)
        tensor = self.declare(
            name, shape or (total,), dtype or src.dtype, "gather", slices, meta, wait=False, members=members
        )
        return self._launch(tensor, out, src, sum(counts[: self.rank]), out.reshape(-1), first, 1, priority)

    def update_async(
        self,
        array: np.ndarray | None,
        name: str,
        out: np.ndarray,
        args: dict,
        kind: int = update.GRAD,
        hyper: list[float] | None = None,
        which: int = 0,
        priority: int = 0,
        members: list[int] | None = None,
    ) -> Handle:
        """Parameter-server mode (docs/ps-mode.md): tensor `name`'s servers hold its parameters and the state of the
        optimizer `args` (protocol/update.py). `kind` GRAD: push the gradients `array`; the new parameters land in
        `out` once every member's are in (or, asynchronous, once this worker is within the staleness bound). INIT
        (every member, once): the first member's parameters `array` are installed and land in `out` on every member.
        READ: tensor `which` of the servers' state lands in `out` (`array` None). WRITE: `array` becomes tensor
        `which` (-1: the parameters, with the optimizer's state afresh); the parameters land in `out`. Reads and
        writes go to the servers alone, outside the rounds (any worker, any time between its updates).
        `hyper`: the algorithm's hyper-parameters for this push, in the order of update.HYPER."""
        self._check_usable()
        if out.dtype.name not in update.DTYPES or not out.flags.c_contiguous:
            raise TensorError(
                f"worker {self.rank}: a server-side optimizer's tensor {name!r} must be C-contiguous float32 or "
                f"float64, got {out.dtype}",
                tensor=name,
                rank=self.rank,
            )
        if array is not None and (array.shape != out.shape or array.dtype != out.dtype):
            raise TensorError(
                f"worker {self.rank}: update of {name!r}: input {array.dtype}{list(array.shape)}, parameters "
                f"{out.dtype}{list(out.shape)}",
                tensor=name,
                rank=self.rank,
            )
        send = np.ascontiguousarray(array).reshape(-1) if array is not None else out.reshape(-1)[:0]
        tensor = self.declare(name, out.shape, out.dtype, "optimizer", wait=False, members=members, op_args=args)
        extra = update.trailer(kind, which, hyper)
        direct = kind in (update.READ, update.WRITE)
        return self._launch(
            tensor, out, send, 0, out.reshape(-1), 0, 1, priority, extra=extra, partial=direct, same_round=direct
        )

    def _begin(self, tensor: Tensor, out: np.ndarray, same_round: bool = False) -> tuple[Handle, int]:
        """A handle for the tensor's next round, and that round (numbered here, in call order; `same_round`: the
        last one again). The handle counts one part for the declaration, and the partitions once they are known."""
        self._check_usable()
        with self._lock:
            if tensor.in_flight is not None:
                raise self._in_flight_error(tensor)
            tensor.round += 0 if same_round else 1
            if self._active == 0 and self.timeline:
                self.timeline.new_step()  # a step: from no push_pull in flight to one
            self._active += 1
            handle = Handle(tensor.name, out, 1, self._finished)
            tensor.in_flight = handle
        return handle, tensor.round

    def _in_flight_error(self, tensor: Tensor) -> TensorError:
        return TensorError(
            f"a push_pull of {tensor.root or tensor.name!r} is already in flight on worker {self.rank}: synchronize "
            "its handle before pushing the tensor again, or give each concurrent tensor its own name (two "
            "models whose parameters share names: pass named_parameters with a prefix per model)",
            tensor=tensor.name,
            rank=self.rank,
        )

    def _finished(self, handle: Handle) -> None:
        self.metrics.round_done()
        with self._lock:
            self._active -= 1
            tensor = self._tensors.get(handle.name)
            if tensor is not None and tensor.in_flight is handle:
                tensor.in_flight = None

    def synchronize(self, handle: Handle) -> np.ndarray:
        """Wait for a handle; returns the output array, raises the error that failed it.

        Waiting for a tensor whose declaration is not complete (other workers have not called it yet) is said to the
        scheduler: if one of them is waiting in a barrier meanwhile, neither can go on, and the scheduler fails the
        declaration at once rather than both waiting until the timeout (a collective one worker skipped)."""
        if not handle.done():
            with self._lock:
                tensor = self._tensors.get(handle.waits_on or handle.name)
                pending = tensor is not None and not tensor.ready.is_set()
            if pending and self._scheduler is not None:
                try:
                    self._scheduler.send_json(FrameType.CONTROL, {"op": messages.BLOCKED, "name": tensor.name})
                except GradwireError:
                    pass  # the control loop reports a lost scheduler
        return handle.wait(self.config.timeout, describe=lambda: self._describe_outstanding(handle.name))

    def push_pull(
        self, array: np.ndarray, name: str, average: bool = False, priority: int = 0, op: str = "sum"
    ) -> np.ndarray:
        """Sum (or reduce by `op`) `array` across workers (blocking); returns a new array."""
        return self.synchronize(self.push_pull_async(array, name, average, priority, op=op))

    def push_pull_inplace(self, array: np.ndarray, name: str, average: bool = False, priority: int = 0) -> np.ndarray:
        """Sum `array` across workers into itself (blocking); returns `array`."""
        if not array.flags.c_contiguous:
            raise TensorError(f"in-place push_pull of {name!r} needs a C-contiguous array", tensor=name)
        return self.synchronize(self.push_pull_async(array, name, average, priority, out=array))

    def _describe_outstanding(self, name: str) -> str:
        busy = [f"server {link.server} ({link.conn.peer})" for link in self._links if name in link.outstanding()]
        return f"; partitions still out on {', '.join(busy)}" if busy else ""

    # -- control ---------------------------------------------------------------------------------

    def join(self) -> int:
        """Horovod's join: this worker is out of data. Until every worker has joined, the others' allreduces go on
        with zeros in this worker's place (an average still divides by every worker, as Horovod's does; an
        allgather, broadcast, alltoall or reducescatter fails on them with TensorMismatch). Blocks until every worker
        has joined (no timeout: the others may train on for long; a lost worker still ends it, with WorkerLost), then
        returns the rank of the last to join, the same on every worker."""
        self._check_usable()
        with self._lock:
            rounds = {t.name: t.round for t in self._tensors.values()}
        request = self._request_async({"op": messages.JOIN, "rounds": rounds})
        request.wait()
        if request.reply is None:  # woken by an abort or a membership change
            self._check_usable()
            raise JobAborted(f"worker {self.rank}: join was cancelled", rank=self.rank)
        reply = request.reply
        with self._lock:  # rounds the others summed while this worker had joined: the next is after them
            for name, rnd in reply.get("rounds", {}).items():
                tensor = self._tensors.get(name)
                if tensor is not None:
                    tensor.round = max(tensor.round, int(rnd))
                else:
                    self._round_floor[name] = max(self._round_floor.get(name, 0), int(rnd))
        return int(reply["last"])

    def barrier(self) -> None:
        """Block until every worker has entered the barrier. Raises WorkerLost at once if a worker has left the
        job (shut down) and so can never enter it."""
        reply = self._request({"op": messages.BARRIER})
        if "error" in reply:
            raise WorkerLost(f"worker {self.rank}: barrier failed: {reply['error']}", int(reply["lost_rank"]))

    def _request_async(
        self, body: dict, callback: Callable[[dict | None], None] | None = None, rejoin: bool = False
    ) -> Request:
        """Send a request without waiting (worker/control.py). With a `callback`, `callback(reply)` runs on the
        control thread when the reply comes, or `callback(None)` if an abort or a membership change cancels it
        first."""
        rid, request = next(self._ids), Request(callback)
        with self._lock:
            self._requests[rid] = request
            if rejoin:
                self._rejoin_id = rid
        assert self._scheduler is not None
        self._scheduler.send_json(FrameType.CONTROL, body | {"id": rid})
        return request

    def _request(self, body: dict, check: bool = True, rejoin: bool = False) -> dict:
        if check:
            self._check_usable()
        request = self._request_async(body, rejoin=rejoin)
        if not request.wait(self.config.timeout):
            raise GradwireTimeout(
                f"worker {self.rank}: scheduler did not answer {body['op']} in {self.config.timeout}s"
            )
        if request.reply is None:  # woken by an abort or a membership change, not a reply
            self._check_usable()
            raise JobAborted(f"worker {self.rank}: {body['op']} was cancelled", rank=self.rank)
        return request.reply

    def _control_loop(self) -> None:
        """The scheduler's messages, one at a time, each to its handler; an ABORT ends the loop."""
        assert self._scheduler is not None
        handlers: dict[str, Callable[[dict], None]] = {
            messages.REPLY: self._answered,
            messages.REPLACE: self._fail_over,
            messages.SEED: self._send_seeds,
            messages.RESET: self._membership_changed,
            messages.MEMBERS: self._members,
            messages.RECUT: self._recut_rounds,
            messages.RETUNE: self._on_retune,
        }
        try:
            while True:
                _, body = self._scheduler.recv_json(FrameType.CONTROL)
                op = messages.check(body)
                if op == messages.ABORT:
                    self._fail_all(abort_error(body, rank=self.rank))
                    return
                handler = handlers.get(op)
                if handler is not None:
                    handler(body)
        except GradwireError as e:
            if not self._closed:
                self._fail_all(JobAborted(f"worker {self.rank} lost the scheduler: {e}", rank=self.rank))

    def _answered(self, body: dict) -> None:
        """A REPLY: the request with its id is answered."""
        with self._lock:
            request = self._requests.pop(int(body["id"]), None)
        if request is not None:
            request.answer(body)

    def _members(self, body: dict) -> None:
        """MEMBERS: workers wait to join (elastic); the next `state.commit()` re-forms the job with them."""
        self.joining = int(body["joining"])

    # -- elastic mode (docs/faults.md) -------------------------------------------------------------

    def _membership_changed(self, body: dict) -> None:
        """RESET from the scheduler: cancel everything in flight; calls raise MembershipChanged until reset()."""
        lost = body.get("lost_rank")
        error = MembershipChanged(
            f"worker {self.rank}: the job's workers changed ({body.get('message', '?')}); restore the last commit and "
            "call reset() (gradwire.torch.elastic.run does both)",
            lost_rank=lost if isinstance(lost, int) else None,
            rank=self.rank,
        )
        self._cancel(error)

    def _cancel(self, error: MembershipChanged) -> None:
        with self._lock:
            if self._membership_error is None:
                self._membership_error = error
            # not our rejoin request, if one is out: its reply is the new membership
            cancelled = [r for rid, r in self._requests.items() if rid != self._rejoin_id]
            self._requests = {rid: r for rid, r in self._requests.items() if rid == self._rejoin_id}
        for request in cancelled:
            request.cancel()
        for link in self._links:
            link.close(error)

    def reset(self) -> None:
        """Elastic mode: re-form the job after a MembershipChanged (or at a commit, when workers are joining).

        Cancels anything still in flight, waits for the scheduler to fix the new membership (this worker's rank may
        change), starts every tensor's rounds afresh, reconnects to the servers and passes a barrier. The caller
        then brings every worker to the same state (`state.sync()`: a broadcast from rank 0).
        """
        if not self.config.elastic:
            raise ConfigError("reset() is for elastic jobs: start them with GRADWIRE_MIN_WORKERS (--min-workers)")
        if self._abort is not None:
            raise self._abort
        self._cancel(MembershipChanged(f"worker {self.rank} is re-forming the job"))
        for link in self._links:
            link.join(SHUTDOWN_JOIN_SECONDS)
        started, old_rank, old_size = time.monotonic(), self.rank, self.size
        book = self._request({"op": messages.REJOIN}, check=False, rejoin=True)
        if self._abort is not None:
            raise self._abort
        with self._lock:
            self._apply_book(book)
            for tensor in self._tensors.values():
                tensor.round, tensor.in_flight = 0, None
                tensor.successor = None  # rounds start afresh, on the tensors' first cut (a joiner knows no other)
            self.recut.release()
            self._use_before = self._link_use()
            self._round_floor.clear()
            self._active = 0
            if self._saved is not None:
                self._saved.clear()
            self._membership_error = None
            self.joining = 0
        self.credit = self._new_credit()  # the cancelled pushes' credit is not coming back
        self._connect_all(book["servers"])
        self.barrier()
        self.resets.append(
            {"epoch": self.epoch, "rank": self.rank, "size": self.size, "seconds": time.monotonic() - started}
        )
        log.info(
            "worker %d (was %d of %d) re-formed the job in epoch %d: %d workers, in %.0f ms",
            self.rank,
            old_rank,
            old_size,
            self.epoch,
            self.size,
            self.resets[-1]["seconds"] * 1e3,
        )

    # -- failover (docs/faults.md) -----------------------------------------------------------------

    def _on_link_lost(self, link: ServerLink, error: BaseException) -> None:
        """A server's connection died (a link thread calls this once): tell the scheduler, keep the work."""
        if self._closed:  # shutting down: servers close connections after our bye
            return
        self._lost_at[link.server] = time.time()
        log.warning(
            "worker %d lost server %d (%s): %s; its unanswered partitions wait for the scheduler to move its keys",
            self.rank,
            link.server,
            link.conn.peer,
            error,
        )
        if self._scheduler is not None and not self._closed:
            try:
                self._scheduler.send_json(
                    FrameType.CONTROL,
                    {"op": messages.SERVER_LOST, "server": link.server, "epoch": link.epoch, "error": str(error)},
                )
            except GradwireError:
                pass  # the control loop reports a lost scheduler

    def _fail_over(self, body: dict) -> None:
        """The scheduler moved a dead server's keys (to a standby at the same index, or onto the survivors).

        The dead link is retired (its submits redirected) only after the new owners are known. Then the worker tells
        the scheduler, per moved key, the round of the sum it holds and the round it resends; the scheduler asks one
        holder to seed each round that another worker still waits for (`_send_seeds`), so seeds move only where
        the dead server died mid-answer.
        """
        started, told_at = time.monotonic(), time.time()
        dead, self.epoch = int(body["server"]), int(body["epoch"])
        self._retune(body.get("tuning"))
        old = self._links[dead]
        with self._failover_lock:
            orphans = old.detach(SHUTDOWN_JOIN_SECONDS)
            standby = body.get("standby")
            if standby and not self._replace_link(dead, standby):
                return
            moved = {str(name): [int(s) for s in servers] for name, servers in body["moved"].items()}
            moved_keys = self._move_keys(moved, dead)
            orphans += old.retire(self._resubmit)
            seeded = self._seed_state(moved_keys)
            for work in orphans:
                self._resubmit(work, 0)
            state = self._failover_state(moved_keys, orphans)
        if self._scheduler is not None:  # even empty: the scheduler waits for every worker's report
            try:
                self._scheduler.send_json(
                    FrameType.CONTROL, {"op": messages.FAILOVER_STATE, "epoch": self.epoch, "keys": state}
                )
            except GradwireError:
                pass  # the control loop reports a lost scheduler
        record = {
            "server": dead,
            "epoch": self.epoch,
            "standby": bool(standby),
            "resent": len(orphans),
            "seeds": seeded,  # parameters resent for a server-side optimizer; plus _send_seeds's, if any
            "seconds": time.monotonic() - started,
            "lost_at": self._lost_at.pop(dead, None),  # wall clock: when this worker saw the connection die
            "told_at": told_at,  # when the scheduler's REPLACE arrived
        }
        self.failovers.append(record)
        log.warning(
            "worker %d: server %d's keys moved (%s); resent %d partitions in %.1f ms",
            self.rank,
            dead,
            "to a standby" if standby else "onto the surviving servers",
            len(orphans),
            record["seconds"] * 1e3,
        )

    def _replace_link(self, dead: int, standby: dict) -> bool:
        """A link to the standby that took server `dead`'s place; False (and every call failed) if unreachable."""
        try:
            self._links[dead] = self._link(dead, standby)
        except (GradwireError, OSError) as e:
            self._fail_all(JobAborted(f"worker {self.rank} cannot reach standby server {dead}: {e}", rank=self.rank))
            return False
        self._links[dead].start()
        return True

    def _move_keys(self, moved: dict[str, list[int]], dead: int) -> list[int]:
        """Record the tensors' new servers (`moved`: name -> a server per partition); the keys whose server changed,
        or was `dead` (kept by a standby at its index)."""
        with self._lock:
            owner = dict(self._owner)
            for name, servers in moved.items():
                self._moves[name] = servers
                tensor = self._tensors.get(name)
                if tensor is not None and tensor.keys:  # (one still being declared takes `_moves` then)
                    owner.update(zip(tensor.keys, servers, strict=True))
                    tensor.servers = servers
            moved_keys = [k for k, s in owner.items() if s == dead or s != self._owner.get(k)]
            self._owner = owner
        return moved_keys

    def _failover_state(self, moved_keys: list[int], orphans: list[Work]) -> dict[str, list[int]]:
        """Per moved key: [the round of the sum held, the round resent, whether what is held is this worker's
        contribution] (the scheduler's FAILOVER_STATE: who seeds what, docs/faults.md)."""
        pending = {w.key: w.round for w in orphans}
        saved = self._saved or {}
        return {
            str(k): [
                saved[k].round if k in saved else -1,
                pending.get(k, -1),
                int(k in saved and saved[k].contribution),
            ]
            for k in moved_keys
            if k in saved or k in pending
        }

    def _seed_state(self, keys: list[int]) -> int:
        """Resend the parameters this worker holds of every moved key whose servers hold state (parameter-server
        mode, docs/ps-mode.md), ahead of its resent pushes: the new server starts from them."""
        with self._lock:
            stateful = {k for t in self._tensors.values() if t.stateful for k in t.keys}
        saved = self._saved or {}
        return sum(self._seed(key, saved[key]) for key in keys if key in stateful and key in saved)

    def _send_seeds(self, body: dict) -> None:
        """Resend the sums (or, for sliced keys, the contributions) the scheduler asked for: a round another worker
        still waits for. One already replaced by a later round's is not needed any more: that later round could only
        complete once everyone had this one."""
        saved = self._saved or {}
        asked = [int(k) for k, rnd in body["keys"] if int(k) in saved and saved[int(k)].round == int(rnd)]
        sent = sum(self._seed(key, saved[key]) for key in asked)
        if self.failovers:
            self.failovers[-1]["seeds"] += sent
        log.warning("worker %d: seeded %d sums the new servers' workers were waiting for", self.rank, sent)

    def _seed(self, key: int, saved: Saved) -> bool:
        """Send the sum this worker holds of `key` to the key's server, flagged SEED (its contribution to a sliced
        round: REPLAY); False if it holds none (or the key has no server)."""
        with self._lock:
            server = self._owner.get(key)
        if server is None or saved.round < 0:
            return False
        flag = REPLAY if saved.contribution else SEED
        seed = Work("", key, saved.round, saved.dtype, saved.data, saved.data, 1, None, seed=flag)
        self._links[server].submit(seed, SEED_PRIORITY)
        return True

    def _resubmit(self, work: Work, priority: int) -> None:
        """Push a partition again, to its key's server now."""
        with self._lock:
            server = self._owner[work.key]
        self._links[server].submit(work, priority)

    def _fail_all(self, error: JobAborted) -> None:
        self._abort = error
        log.error("%s", error)
        with self._lock:
            cancelled = list(self._requests.values())
            self._requests.clear()
        for request in cancelled:
            request.cancel()
        for link in self._links:
            link.close(error)

    def _check_usable(self) -> None:
        if self._abort is not None:
            raise self._abort
        if self._membership_error is not None:
            raise self._membership_error
        if self._closed:
            raise ConfigError("this worker has been shut down; call init() again to start a new job")


def _bye() -> bytes:
    return encode_header(FrameType.BYE, 0)
