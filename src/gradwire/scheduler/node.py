"""A node of the job as the scheduler sees it: its connection, role, rank, addresses, liveness and measured link, and
the link measurement in progress (`Probe`, driven by scheduler/probe.py)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from gradwire.errors import GradwireError
from gradwire.protocol.messages import ProbeResult
from gradwire.transport import tcp


class Probe:
    """One node's measurement, filled by its connection thread (`on_frame`, `on_result`)."""

    def __init__(self, frames: int) -> None:
        self.frames = frames  # the upload burst's frames (scheduler/probe.py)
        self.arrivals: list[float] = []
        self.down = 0.0
        self.up_done = threading.Event()
        self.down_done = threading.Event()
        self.pong = threading.Event()

    def on_frame(self) -> None:
        self.arrivals.append(time.monotonic())
        if len(self.arrivals) == self.frames:
            self.up_done.set()

    def on_result(self, result: ProbeResult) -> None:
        if result.pong:
            self.pong.set()
            return
        if result.down is None:
            raise GradwireError("a probe result needs `down` (a rate) or `pong`")
        self.down = result.down
        self.down_done.set()


@dataclass
class Node:
    """A registered node as the scheduler sees it."""

    conn: tcp.Connection
    role: str
    requested_rank: int | None
    host: str
    port: int
    slot_bytes: int = 0
    unix: str = ""
    host_id: str = ""
    rank: int = -1
    standby: bool = False  # an idle server that takes a dead server's place
    since_epoch: int = 1  # the epoch from which it holds its rank (a promoted standby's is later)
    said_bye: bool = False
    final_bye: bool = True  # its bye came at process exit (no init() can follow), not from shutdown()
    lost: bool = False
    admin: int = -1  # its admin endpoint's port (-1: none), on admin_host
    admin_host: str = ""
    last_seen: float = field(default_factory=time.monotonic)  # of its last heartbeat (the scheduler's clock)
    heard: float = field(default_factory=time.monotonic)  # of its last message of any kind
    answered: float = field(default_factory=time.monotonic)  # when the latest beat it answered was sent (lease.py)
    stats: dict = field(default_factory=dict)  # the counters of its last heartbeat
    colocated: bool = False  # a server on a worker host (GRADWIRE_COLOCATED)
    link_rate: float = 0.0  # bytes/s: configured (GRADWIRE_LINK_RATE) or measured (GRADWIRE_PLACEMENT=auto)
    rtt: float = 0.0  # seconds, to the scheduler (measured with the link rate; 0: not measured)
    probe: Probe | None = None  # a measurement in progress
    probe_buffer: bytearray = field(default_factory=bytearray, repr=False)
    rate: float = 0.0  # bytes per second pushed and pulled, between its last two heartbeats
    round_rate: float = 0.0  # rounds per second, likewise

    def conn_closed(self) -> bool:
        """This scheduler has closed the node's connection (or never had one: a node that did not report)."""
        return bool(getattr(self.conn, "closed", True))
