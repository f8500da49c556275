"""What every part of a server reads: its place in the job (rank, epoch, number of workers, standby), its engines,
its links to the workers, the replicas it forwards to, and the scheduler connection. The parts (reader.py,
control.py, replier.py) share one `ServerState`; the facade (server.py) wires them.
"""

from __future__ import annotations

import threading
from typing import Any

from gradwire.admin.metrics import Metrics
from gradwire.config import Config
from gradwire.server.engine import Engine
from gradwire.server.receipts import Receipts
from gradwire.server.replica import Replicas
from gradwire.server.replier import Replier
from gradwire.transport import tcp
from gradwire.transport.loop import LinkLoop


class ServerState:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.secret = config.secret_bytes()
        self.rank = -1
        self.standby = False
        self.epoch = 0  # frames of another epoch are refused
        self.term = 0  # the scheduler's term: none of an older one is followed (scheduler/recovery.py)
        self.registration: dict = {}  # what it registered with (its report to a resuming scheduler repeats it)
        self.num_workers = 0
        self.everyone = 0  # the bitmask of every worker's rank
        self.engines: list[Engine] = []
        self.links: dict[int, Replier] = {}  # each worker's end of its connection, by rank
        self.links_lock = threading.Lock()
        self.loop = LinkLoop("gw-server-links")  # reads every worker connection (reader.py)
        # or the native loop owns them, and sums the plain keys: native_path.NativeServer (Any: it imports this module)
        self.native: Any = None
        self.replicas: Replicas | None = None  # forwards to the servers replicating this one's keys
        self.receipts: Receipts | None = None  # which workers have the sums of held keys (server/receipts.py)
        self.scheduler: tcp.Connection | None = None
        self.metrics = Metrics("server")
        self.done = threading.Event()
        self.error: str | None = None  # why the job ended badly

    def set_workers(self, num_workers: int) -> None:
        self.num_workers, self.everyone = num_workers, (1 << num_workers) - 1

    def engine_of(self, key: int) -> Engine:
        """The engine that owns `key`."""
        return self.engines[key % len(self.engines)]
