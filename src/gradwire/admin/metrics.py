"""Prometheus metrics of one node, prefix `gradwire_`, base units (bytes, seconds). No per-key labels.

Each node has its own registry (no process-wide singleton), so a whole cluster can run in one process. Counters
are bumped on the data path (a lock and an add, about a microsecond, once per partition); gauges are computed when
scraped. Without prometheus_client installed, `Metrics` still counts (the counters back /status too) and /metrics
says how to get the text format.
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
import time
from collections.abc import Callable

try:
    import prometheus_client as prom
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
    from prometheus_client.utils import floatToGoString
except ImportError:  # pragma: no cover - the dev and metrics extras install it
    prom = None

STAGES = ("queued", "push", "wait", "pull")
# partitions take from ~50 us (shared memory) to seconds (slow links)
COUNTERS = (
    ("gradwire_pushed_bytes", "Bytes pushed (workers: sent; servers: received)"),
    ("gradwire_pulled_bytes", "Bytes of sums pulled (workers: received; servers: sent)"),
    ("gradwire_rounds_completed", "Rounds completed (servers: keys summed; workers: push_pulls completed)"),
)
BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


try:
    _CLOCK_TICK = os.sysconf("SC_CLK_TCK")
except (AttributeError, ValueError, OSError):  # pragma: no cover - not a POSIX host
    _CLOCK_TICK = 100


class Metrics:
    """The metrics of one node (role: scheduler, server or worker). Thread-safe.

    The data path's counters and the stage histogram are plain numbers under one lock, taken once per partition and
    direction; prometheus_client sees them only when /metrics is read (a collector). Its own Counter and Histogram
    took 6 locks and ~60 us of Python per partition on a worker (yappi, 64 KiB partitions over TCP), a sizeable
    share of what a small partition costs.
    """

    def __init__(self, role: str) -> None:
        self.role = role
        self._pushed = 0
        self._pulled = 0
        self._rounds = 0
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.extra: Callable[[], dict] | None = None  # more counters for the heartbeat (a worker's link use)
        # counts kept elsewhere, added in before the counters are read (a server's native loop: server/native_path.py)
        self.before_read: Callable[[], None] | None = None
        # per stage: partitions per bucket of BUCKETS (and past the last), and the seconds in all
        self._buckets = [[0] * (len(BUCKETS) + 1) for _ in STAGES]
        self._seconds = [0.0] * len(STAGES)
        self.registry = prom.CollectorRegistry(auto_describe=True) if prom else None
        if prom is not None:
            self.registry.register(_Collector(self._families))

    def counts(self) -> tuple[int, int, int]:
        """(bytes pushed, bytes pulled, rounds), with the counts kept elsewhere added in (`before_read`)."""
        if self.before_read is not None:
            self.before_read()
        with self._lock:
            return self._pushed, self._pulled, self._rounds

    bytes_pushed = property(lambda self: self.counts()[0])
    bytes_pulled = property(lambda self: self.counts()[1])
    rounds = property(lambda self: self.counts()[2])

    def pushed(self, n: int) -> None:
        with self._lock:
            self._pushed += n

    def pulled(self, n: int) -> None:
        with self._lock:
            self._pulled += n

    def round_done(self, n: int = 1) -> None:
        with self._lock:
            self._rounds += n

    def stages(self, counts: list[list[int]], seconds: list[float]) -> None:
        """Partitions' stages counted elsewhere (the native data path's loop: the same buckets), added in."""
        with self._lock:
            for i, per_bucket in enumerate(counts):
                for j, n in enumerate(per_bucket):
                    self._buckets[i][j] += n
            for i, value in enumerate(seconds):
                self._seconds[i] += value

    def partition(self, pulled: int, *seconds: float) -> None:
        """A partition's sum came back: `pulled` bytes, and its time in each of STAGES, in that order."""
        with self._lock:
            self._pulled += pulled
            for i, value in enumerate(seconds):
                self._buckets[i][bisect.bisect_left(BUCKETS, value)] += 1
                self._seconds[i] += value

    def _families(self) -> list:
        """The counters and the stage histogram, in prometheus_client's types (when /metrics is read)."""
        counts = self.counts()
        with self._lock:
            buckets = [list(b) for b in self._buckets]
            seconds = list(self._seconds)
        families = []
        for (name, doc), value in zip(COUNTERS, counts, strict=True):
            family = CounterMetricFamily(name, doc, labels=["role"])
            family.add_metric([self.role], value)
            families.append(family)
        if self.role == "worker":
            histogram = HistogramMetricFamily(
                "gradwire_partition_stage_seconds", "Time a partition spends in each stage", labels=["stage"]
            )
            for stage, counted, total in zip(STAGES, buckets, seconds, strict=True):
                cumulative = list(itertools.accumulate(counted))
                edges = [floatToGoString(b) for b in BUCKETS] + ["+Inf"]
                histogram.add_metric([stage], list(zip(edges, cumulative, strict=True)), total)
            families.append(histogram)
        return families

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
        pushed, pulled, rounds = self.counts()
        with self._lock:
            counters = {
                "bytes_pushed": pushed,
                "bytes_pulled": pulled,
                "rounds": rounds,
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
