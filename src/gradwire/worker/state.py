"""What every part of a worker reads: its place in the job (rank, size, epoch, hosts), the settings in force, its
links and credit, and whether it can still be used. The parts (calls, declaring, control, recut, failover, elastic,
connecting) share one `WorkerState` and never reach into each other's fields; the facade (worker.py) wires them.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Protocol

from gradwire.admin.metrics import Metrics
from gradwire.admin.timeline import Timeline
from gradwire.config import Config
from gradwire.errors import ConfigError, JobAborted, MembershipChanged
from gradwire.protocol.messages import AddressBook
from gradwire.transport.loop import LinkLoop
from gradwire.tuning import Tuning
from gradwire.worker.credit import Credit
from gradwire.worker.handle import Handle
from gradwire.worker.link import ServerLink
from gradwire.worker.lost_link import LostLink
from gradwire.worker.tensors import Tensor
from gradwire.worker.work import Transfer

SHUTDOWN_JOIN_SECONDS = 5.0  # how long a closing worker waits for each of its threads


class DataPath(Protocol):
    """The boundary between a worker's Python and a data path that owns its links (the glossary's data path;
    worker/native_path.py's `NativePath`): calls go in as their partitions' plan, handles come back completed, and the
    links' use comes back for the drift check. Where none owns them, the links move their own frames
    (worker/link.py)."""

    def submit(self, tensor: Tensor, rnd: int, transfer: Transfer, handle: Handle, servers: list[int]) -> None:
        """Move `transfer`'s partitions of `tensor`'s round `rnd` (to `servers`, by partition); `handle` completes (its
        declaration's part) or fails once every answer is in."""

    def link_use(self) -> tuple[float, int, float]:
        """(seconds some push was unacknowledged, bytes acknowledged, seconds work waited on a full window)."""

    def outstanding(self, name: str) -> list[int]:
        """The servers with partitions of `name` not answered yet."""

    def held(self, name: str) -> list[int]:
        """The servers whose sums of `name` are held until every worker has them."""

    def credit_used(self) -> int:
        """Bytes pushed and not yet acknowledged, over all links."""

    def trace(self, on: bool) -> None:
        """Each answered partition's stages into the worker's timeline from now on (`on`), or no longer."""

    def stop(self, reason: BaseException) -> None:
        """Every call in flight fails with `reason`; the links are given back (closed where cut off mid-frame)."""


class WorkerState:
    def __init__(self, config: Config) -> None:
        self.config = config  # with the scheduler's derived settings, where not set explicitly (`apply_book`)
        self.secret = config.secret_bytes()
        self.rank = -1
        self.size = 0
        self.local_rank = 0
        self.local_size = 1
        self.epoch = 0
        self.term = 0  # the scheduler's term: none of an older one is followed (scheduler/recovery.py)
        self.book: AddressBook | None = None  # the last address book, its servers as failovers changed them
        self.barriers = self.barriers_passed = 0  # the job's barriers this worker entered (Barrier.number), and passed
        self.hosts: list[str] = []  # each worker's host, by rank (cross_rank, is_homogeneous)
        self.placement: dict = {}  # the scheduler's weights and the rates it used
        self.tuning: Tuning | None = None  # the scheduler's derived data-path settings (gradwire/tuning.py)
        # local aggregation's partition size for tensors that stay on this worker's host (0: it is off), and so the
        # size of the shared-memory slots to the host's servers (worker/aggregation.py)
        self.local_partition_bytes = 0
        self.partition_bytes = config.partition_bytes  # of tensors declared from now on
        self.slot_limit = config.partition_bytes  # the servers' slot size (the address book's)
        self.lock = threading.Lock()  # guards the tensor table and the counters below
        self.links: list[ServerLink | LostLink] = []  # by server index
        self.loop = LinkLoop(f"gw-links-{id(self):x}")  # moves every link's frames (started with the first link)
        self.native: DataPath | None = None  # the data path the links are lent to, where one applies (native_path.py)
        self.credit: Credit | None = None
        self.timeline: Timeline | None = None
        self.metrics = Metrics("worker")
        self.abort: JobAborted | None = None  # why the job ended for this worker
        self.membership_error: MembershipChanged | None = None  # elastic: why calls fail until reset()
        self.closed = False
        self.standalone = False  # in a one-worker job init() made itself (gradwire/standalone.py)
        self.active = 0  # push_pull handles in flight
        self.clock_skew = 0.0  # the scheduler's wall clock minus this host's (seconds)

    def credit_used(self) -> int:
        """Bytes pushed and not yet acknowledged, over all links (the data path's that owns them, if one does)."""
        if self.native is not None:
            return self.native.credit_used()
        return self.credit.used if self.credit else 0

    def check_usable(self) -> None:
        if self.abort is not None:
            raise self.abort
        if self.membership_error is not None:
            raise self.membership_error
        if self.closed:
            raise ConfigError("this worker has been shut down; call init() again to start a new job")

    def apply_book(self, book: AddressBook) -> None:
        """The address book (at the rendezvous, or an elastic reset): place, hosts, placement and settings."""
        self.rank, self.size, self.epoch = book.rank, book.num_workers, book.epoch
        self.term, self.book = max(self.term, book.term), replace(book, servers=[dict(s) for s in book.servers])
        self.barriers = self.barriers_passed = book.barriers  # numbered as the job's, for joiners too
        self.tuning = Tuning.from_dict(book.tuning)
        self.config = self.config.tuned(self.tuning)  # derived from the links, where not set explicitly
        self.placement = book.placement or {}
        hosts = book.workers
        self.hosts = list(hosts)
        same_host = [r for r, h in enumerate(hosts) if h == hosts[self.rank]] if hosts else [self.rank]
        self.local_rank = self.config.local_rank if self.config.local_rank is not None else same_host.index(self.rank)
        self.local_size = self.config.local_size if self.config.local_size is not None else len(same_host)
        live = [s for s in book.servers if not s.get("lost")]
        self.slot_limit = min(int(s["slot_bytes"]) for s in live) if live else self.config.partition_bytes
        self.partition_bytes = min(self.config.partition_bytes, self.slot_limit)

    def carry_limit(self) -> int:
        """The largest partition every link of this worker carries: the servers' slots, and the shared-memory slots
        this worker's arenas were made with (at the partition size of the time)."""
        arenas = [link.arena.slot_bytes for link in self.links if isinstance(link, ServerLink) and link.arena]
        return min([self.slot_limit, *arenas])

    def pacing_lead(self) -> int:
        """Pacing's lead in bytes: GRADWIRE_PACING partitions of the partition size in use."""
        return self.config.pacing * self.partition_bytes

    def new_credit(self) -> Credit:
        return Credit(self.config.credit_bytes, self.pacing_lead())
