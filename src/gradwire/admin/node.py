"""What every server and worker runs beside its work: the admin endpoint and the heartbeat to the scheduler."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gradwire.admin.http import AdminServer, json_handler
from gradwire.admin.metrics import Metrics
from gradwire.config import Config
from gradwire.errors import GradwireError
from gradwire.protocol import messages
from gradwire.transport import tcp

log = logging.getLogger("gradwire.admin")


class NodeAdmin:
    """The admin endpoint (/metrics, /status, /healthz) of a node, and its heartbeat thread."""

    def __init__(self, config: Config, metrics: Metrics, status: Callable[[], dict]) -> None:
        self.config, self.metrics = config, metrics
        self.http = None
        if config.admin_port >= 0:
            routes = {"/metrics": metrics.exposition, "/status": json_handler(status)}
            self.http = AdminServer(config.admin_host, config.admin_port, routes)
        self._stop = threading.Event()

    @property
    def advertised_host(self) -> str:
        """Where others reach the endpoint: its bind address, or the node's own when it binds every interface."""
        host = self.config.admin_host
        return self.config.host if host in ("", "0.0.0.0", "::") else host

    @property
    def port(self) -> int:
        """The admin port, or -1 when the endpoint is off."""
        return self.http.port if self.http else -1

    def start_heartbeat(self, scheduler: Callable[[], tcp.Connection | None]) -> None:
        """Send {op: heartbeat, stats} to the scheduler (`scheduler()`: its connection now, which changes when a
        scheduler resumes the job) every interval until `stop`."""
        threading.Thread(target=self._beat, args=(scheduler,), name="gw-heartbeat", daemon=True).start()

    def _beat(self, scheduler: Callable[[], tcp.Connection | None]) -> None:
        while not self._stop.wait(self.config.heartbeat_interval):
            conn = scheduler()
            try:
                if conn is not None:
                    conn.send_message(messages.Heartbeat(self.metrics.snapshot()))
            except GradwireError:
                continue  # lost: the control loop finds out, and may reach a scheduler that resumes the job

    def stop(self) -> None:
        """Stop the heartbeat and the endpoint. Idempotent."""
        self._stop.set()
        http, self.http = self.http, None
        if http:
            http.stop()
