"""Prometheus metrics of one node, prefix `gradwire_`, base units (bytes, seconds). No per-key labels.

Each node has its own registry (no process-wide singleton), so a whole cluster can run in one process. Counters
are bumped on the data path (a lock and an add, about a microsecond, once per partition); gauges are computed when
scraped. Without prometheus_client installed, `Metrics` still counts (the counters back /status too) and /metrics
says how to get the text format.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

try:
    import prometheus_client as prom
except ImportError:  # pragma: no cover - the dev and metrics extras install it
    prom = None

STAGES = ("queued", "push", "wait", "pull")
# partitions take from ~50 us (shared memory) to seconds (slow links)
BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


try:
    _CLOCK_TICK = os.sysconf("SC_CLK_TCK")
except (AttributeError, ValueError, OSError):  # pragma: no cover - not a POSIX host
    _CLOCK_TICK = 100


class Metrics:
    """The metrics of one node (role: scheduler, server or worker). Thread-safe."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self.rounds = 0
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.extra: Callable[[], dict] | None = None  # more counters for the heartbeat (a worker's link use)
        self.registry = prom.CollectorRegistry(auto_describe=True) if prom else None
        if prom is None:
            return
        r, labels = self.registry, {"role": role}
        self._pushed = prom.Counter(
            "gradwire_pushed_bytes", "Bytes pushed (workers: sent; servers: received)", ["role"], registry=r
        ).labels(**labels)
        self._pulled = prom.Counter(
            "gradwire_pulled_bytes", "Bytes of sums pulled (workers: received; servers: sent)", ["role"], registry=r
        ).labels(**labels)
        self._rounds = prom.Counter(
            "gradwire_rounds_completed",
            "Rounds completed (servers: keys summed; workers: push_pulls completed)",
            ["role"],
            registry=r,
        ).labels(**labels)
        self._stage = prom.Histogram(
            "gradwire_partition_stage_seconds",
            "Time a partition spends in each stage",
            ["stage"],
            buckets=BUCKETS,
            registry=r,
        )
        self._stages = {s: self._stage.labels(stage=s) for s in STAGES}

    def pushed(self, n: int) -> None:
        with self._lock:
            self.bytes_pushed += n
        if prom:
            self._pushed.inc(n)

    def pulled(self, n: int) -> None:
        with self._lock:
            self.bytes_pulled += n
        if prom:
            self._pulled.inc(n)

    def round_done(self, n: int = 1) -> None:
        with self._lock:
            self.rounds += n
        if prom:
            self._rounds.inc(n)

    def stage(self, name: str, seconds: float) -> None:
        if prom:
            self._stages[name].observe(seconds)

    def gauge(self, name: str, doc: str, fn: Callable[[], float], labels: dict[str, str] | None = None) -> None:
        """A gauge computed when scraped."""
        if not prom:
            return
        if labels:
            g = prom.Gauge(name, doc, list(labels), registry=self.registry)
            g.labels(**labels).set_function(fn)
        else:
            prom.Gauge(name, doc, registry=self.registry).set_function(fn)

    def collector(self, fn: Callable[[], list]) -> None:
        """A custom collector: fn() returns prometheus metric families (for labelled gauges over nodes)."""
        if prom:
            self.registry.register(_Collector(fn))

    def snapshot(self) -> dict:
        with self._lock:
            counters = {
                "bytes_pushed": self.bytes_pushed,
                "bytes_pulled": self.bytes_pulled,
                "rounds": self.rounds,
                "uptime_seconds": time.monotonic() - self.started,
            }
        # outside the lock, which the data path takes once per partition: a file read, and the extra's own locks
        return counters | host_cpu() | (self.extra() if self.extra else {})

    def exposition(self) -> tuple[int, str, bytes]:
        """The /metrics response."""
        if not prom:
            return 503, "text/plain", b"prometheus_client is not installed: pip install 'gradwire[metrics]'\n"
        return 200, prom.CONTENT_TYPE_LATEST, prom.generate_latest(self.registry)


def host_cpu() -> dict:
    """This host's CPU seconds so far, busy and in all (every core; Linux's /proc/stat): the scheduler's drift check
    tells a slow link from a host short of CPU with them (tuning.Drift). Empty where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return {}
    busy = sum(fields) - fields[3] - fields[4]
    return {"host_cpu_busy_seconds": busy / _CLOCK_TICK, "host_cpu_seconds": sum(fields) / _CLOCK_TICK}


class _Collector:
    def __init__(self, fn: Callable[[], list]) -> None:
        self.fn = fn

    def collect(self):  # noqa: ANN201 - prometheus_client's protocol
        return self.fn()
