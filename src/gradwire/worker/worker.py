"""The worker: one per training process. A facade: it keeps the life cycle (start, shutdown) and wires the parts
that hold the concepts (docs/architecture.md): the tensor table (tensors.py), declaring, the calls, the control
connection, connecting, re-cuts and re-tunes (recut.py), failover and seeds, elastic resets; all share one
`WorkerState` (state.py).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

from gradwire.admin import timeline
from gradwire.admin.node import NodeAdmin
from gradwire.admin.timeline import Timeline
from gradwire.config import Config
from gradwire.errors import JobAborted
from gradwire.protocol import messages
from gradwire.protocol.frames import FrameType, encode_header
from gradwire.tuning import SETTINGS
from gradwire.worker.aggregation import LOCAL_PARTITION_BYTES, Hierarchy, LocalAggregation
from gradwire.worker.calls import Calls
from gradwire.worker.connecting import Connecting
from gradwire.worker.control import Control
from gradwire.worker.declaring import Declaring
from gradwire.worker.elastic import Elastic
from gradwire.worker.failover import Failover
from gradwire.worker.native_path import why_not
from gradwire.worker.recut import Retuning
from gradwire.worker.report import Report
from gradwire.worker.state import SHUTDOWN_JOIN_SECONDS, WorkerState
from gradwire.worker.tensors import TensorTable

log = logging.getLogger("gradwire.worker")


def _of_part(part: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` of the worker's part `part` (an attribute of the Worker) as a method of the Worker: its name,
    signature and docstring are the part's (functools.wraps), so `help()` and a reader follow it there."""

    @functools.wraps(method)
    def call(self: Worker, *args: Any, **kwargs: Any) -> Any:
        return method(getattr(self, part), *args, **kwargs)

    return call


class Worker:
    """A worker's connection to the job.

    Blocking: `start`, `declare`, `barrier`, `synchronize` and `push_pull` block (each at most
    `config.timeout`); `push_pull_async` and `poll` do not. Thread-safe, but one tensor name may have
    only one push_pull in flight at a time.
    """

    def __init__(self, config: Config) -> None:
        self.state = state = WorkerState(config)
        self.table = TensorTable()
        self.control = Control(state)
        self.declaring = Declaring(state, self.table, self.control)
        self.retuning = Retuning(state, self.table, self.control, self.declaring)
        self.connecting = Connecting(state)
        self.failover = Failover(state, self.table, self.control, self.retuning, self.connecting)
        self.elastic = Elastic(state, self.table, self.control, self.connecting, self.failover, self.retuning)
        self.elastic.reformed = self.aggregate
        self.control.report = Report(state, self.table, self.control, self.declaring, self.failover, self.retuning)
        self.calls = Calls(state, self.table, self.control, self.declaring, self.retuning.recut)
        self.admin: NodeAdmin | None = None

    # the API (gradwire/__init__.py and the adapters call these): each is the method of the part that holds it
    declare = _of_part("declaring", Declaring.declare)
    push_pull_async = _of_part("calls", Calls.push_pull_async)
    push_pull = _of_part("calls", Calls.push_pull)
    push_pull_inplace = _of_part("calls", Calls.push_pull_inplace)
    synchronize = _of_part("calls", Calls.synchronize)
    reduce_scatter_async = _of_part("calls", Calls.reduce_scatter_async)
    gather_async = _of_part("calls", Calls.gather_async)
    update_async = _of_part("calls", Calls.update_async)
    join = _of_part("calls", Calls.join)
    barrier = _of_part("control", Control.barrier)
    reset = _of_part("elastic", Elastic.reset)

    # what the API and tools read of this worker
    config = property(lambda self: self.state.config)
    rank = property(lambda self: self.state.rank)
    size = property(lambda self: self.state.size)
    local_rank = property(lambda self: self.state.local_rank)
    local_size = property(lambda self: self.state.local_size)
    epoch = property(lambda self: self.state.epoch)
    hosts = property(lambda self: self.state.hosts)
    placement = property(lambda self: self.state.placement)
    tuning = property(lambda self: self.state.tuning)
    metrics = property(lambda self: self.state.metrics)
    timeline = property(lambda self: self.state.timeline)
    credit = property(lambda self: self.state.credit)
    links = property(lambda self: self.state.links)
    recut = property(lambda self: self.retuning.recut)
    failovers = property(lambda self: self.failover.records)
    resets = property(lambda self: self.elastic.resets)
    joining = property(lambda self: self.elastic.joining)

    def start(self) -> Worker:
        """Rendezvous, connect to every server, and pass the first barrier."""
        state = self.state
        if state.config.switch_interval > 0:
            # I/O threads wait up to one switch interval (default 5 ms) for the GIL while the training
            # thread runs Python: 3x to 60x slower messages, measured (shared/MEASUREMENTS.md).
            sys.setswitchinterval(state.config.switch_interval)
        self.admin = NodeAdmin(state.config, state.metrics, self.status)
        self.control.conn, book = self.connecting.rendezvous(self.admin.port, self.admin.advertised_host)
        self.control.report.registration = self.connecting.registration
        state.apply_book(book)
        state.credit = state.new_credit()
        if state.config.timeline:
            self.start_timeline(timeline.path_for(state.config.timeline, state.rank), len(book.servers))
        self.aggregate(book)  # first: it sizes the shared-memory slots to the host's servers
        self.connecting.connect_all(book.servers, self.failover.hooks)
        state.metrics.gauge(
            "gradwire_credit_in_flight_bytes",
            "Bytes pushed and not yet acknowledged",
            state.credit_used,
        )
        state.metrics.gauge("gradwire_push_pulls_in_flight", "push_pull handles not yet complete", lambda: state.active)
        state.metrics.extra = self.elastic.link_use
        self.control.start(
            {
                messages.Replace: self.failover.on_replace,
                messages.Reseed: self.failover.on_seed,
                messages.Reset: self.elastic.on_reset,
                messages.Members: self.elastic.on_members,
                messages.Recut: self.retuning.on_recut,
                messages.Retune: self.retuning.on_retune,
            }
        )
        self.admin.start_heartbeat(lambda: self.control.conn)
        self.barrier()
        log.info("worker %d/%d ready with %d servers", state.rank, state.size, len(state.links))
        return self

    def aggregate(self, book: messages.AddressBook) -> None:
        """Local aggregation (worker/aggregation.py) where this job's layout has it, for the membership in `book`."""
        state = self.state
        if self.calls.aggregation is not None:
            self.calls.aggregation.close()
            self.calls.aggregation = None
        hierarchy = Hierarchy.of(state.rank, book.worker_hosts, book.servers, state.config.local_aggregation)
        state.local_partition_bytes = min(LOCAL_PARTITION_BYTES, state.slot_limit) if hierarchy else 0
        if hierarchy is not None:
            self.calls.aggregation = LocalAggregation(self.calls, hierarchy)
            log.info("worker %d: local aggregation on: %s", state.rank, hierarchy.status())

    def start_timeline(self, path: str, servers: int | None = None) -> None:
        """Start writing this worker's timeline to `path` (`{rank}` in it is replaced), as GRADWIRE_TIMELINE does;
        a timeline already being written is closed first. `servers`: its tracks (default: one per link)."""
        state = self.state
        self.stop_timeline()
        count = len(state.links) if servers is None else servers
        state.timeline = Timeline(
            path.format(rank=state.rank) if "{rank}" in path else path,
            state.rank,
            state.config.timeline_steps,
            {i: f"server {i}" for i in range(count)},
            skew=state.clock_skew,
        )
        for link in state.links:
            link.timeline = state.timeline
        if state.native is not None:
            state.native.trace(True)

    def stop_timeline(self) -> None:
        """Stop writing the timeline (its file keeps what was written)."""
        timeline, self.state.timeline = self.state.timeline, None
        for link in self.state.links:
            link.timeline = None
        if self.state.native is not None:
            self.state.native.trace(False)
        if timeline is not None:
            timeline.close()

    def leave(self) -> None:
        """After `shutdown(final=False)`: close the scheduler connection, the worker's last word (its process
        ends, or it has joined the job's next generation). Idempotent."""
        if self.control.conn is not None:
            self.control.conn.close()
        self.control.join_thread()

    def status(self) -> dict:
        """This worker's view, for its /status."""
        state = self.state
        links = [
            {
                "server": link.server,
                "peer": link.conn.peer,
                "transport": link.transport,
                "tcp_segment_bytes": link.conn.segment_bytes(),  # 8948 where the path runs jumbo frames
                "outstanding_tensors": len(link.outstanding()),
            }
            for link in state.links
        ]
        tuning, config = state.tuning, state.config
        return {
            "role": "worker",
            "rank": state.rank,
            "size": state.size,
            "epoch": state.epoch,
            "term": state.term,  # the scheduler's; and each time one resumed the job (scheduler/recovery.py)
            "scheduler_resumes": self.control.resumes[-5:],
            "tensors": len(self.table.tensors),
            "push_pulls_in_flight": state.active,
            "credit_in_flight_bytes": state.credit_used(),
            "failover_copy_bytes": self.failover.kept_bytes(),  # kept of the last sums for a failover
            "servers": links,
            "aborted": str(state.abort) if state.abort else None,
            "local_aggregation": self.calls.aggregation and self.calls.aggregation.status(),
            "data_path": {
                # what moves this worker's bytes: the native loop, or the Python path and why (worker/native_path.py)
                "worker": "native" if state.native is not None else f"python ({why_not(state, state.links)})",
                "partition_bytes": state.partition_bytes,
                "window": config.window,
                "unanswered": config.unanswered,
                "why": tuning.reason if tuning else "the defaults and GRADWIRE_* settings",
                "derived_again": tuning and tuning.derived_for,  # after a failover or an elastic reset
                "set_explicitly": sorted(config.explicit & set(SETTINGS)),
                "recuts": self.recut.history[-5:],  # tensors cut anew while the job runs (scheduler/adapt.py)
            },
            **state.metrics.snapshot(),
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
        state = self.state
        if state.closed:
            return
        state.closed = True
        if self.calls.aggregation is not None:
            self.calls.aggregation.close()
        for link in state.links:
            link.close(JobAborted("worker shut down"), farewell=encode_header(FrameType.BYE, 0))
        self.control.send(messages.Bye(final, error))
        if final and self.control.conn is not None:
            self.control.conn.close()
        for link in state.links:
            link.join(SHUTDOWN_JOIN_SECONDS)
        state.loop.stop(SHUTDOWN_JOIN_SECONDS)
        if final:
            self.control.join_thread()
        if self.admin is not None:
            self.admin.stop()
        if state.timeline is not None:
            state.timeline.close()
