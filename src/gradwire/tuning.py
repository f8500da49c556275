"""The data path's settings, derived from the job's links: partition size, window, and the cap on unanswered pushes.

A pure function of measured (or given) link rates and round-trip time, so it is tested as a table. The scheduler
derives the settings once the rates are known (the rendezvous's link probe, GRADWIRE_PLACEMENT=auto, which also times
each node's round trip; or GRADWIRE_LINK_RATE) and puts them in the address book; each worker uses them for every
setting the user did not set (explicit GRADWIRE_* wins).

Why these rules (measured on emulated 25-100 Mbit/s links, docs/netem.md; 2-core machine):
- Partition size: a partition should take about PARTITION_SECONDS on the worker's link. Shorter, and the Python cost
  of each partition (tens of microseconds on each side, per frame and per wake-up) becomes a sizeable share of the
  link's time; longer, and a step has too few partitions per server to overlap one partition's push with another's
  pull, and each round's start and end (one partition's time, with the link half idle) grow. At 100 Mbit/s this
  gives 32 KiB, at 50 Mbit/s 16 KiB: the sizes hand-tuning found best (n = 4 on 100 Mbit/s: 4 MiB partitions took
  2.86 s for 16 MiB, 32 KiB 1.54 s). On loopback and shared memory (GB/s) it stays at the 4 MiB default.
- Window (pushes not yet acknowledged, per server): enough to cover the link's bandwidth-delay product twice over,
  at least two partitions (one on the wire, the next behind it), and at least WINDOW_BYTES in flight per worker over
  all the servers its partitions spread over. Per worker, not per server: every worker fills every server's link, so
  a server's queue holds n windows; 128 KiB per server (window 8 at 16 KiB) queued 1 MiB in front of each server's
  50 Mbit/s link at n = k = 8, 160 ms that the last partitions of every call waited: 0.6 MiB took 2.9x its bound, 16
  MiB 1.18x. Window 2 there: 1.38x and 1.11x; at n = k = 4 on 100 Mbit/s 1.38x (was 1.65x) and 1.09x (the same)
  (`gradwire bench --netem --configs 8:8:50mbit:50mbit,4:4:100mbit:100mbit --sizes 0.6,16`, GRADWIRE_WINDOW 8, 4,
  2 side by side, 2026-12-03).
- Cap on unanswered partitions: only where the dedicated servers' links together are slower than the workers'
  (fan-in is the bottleneck, and TCP shares a server's download unfairly among its pushers, so workers that run ahead
  starve the rounds): n = 4, k = 2, 100 Mbit/s, 16 MiB: 2.85 s with a cap of 4 against 3.16-3.26 s without. Where
  the servers keep up, pacing (worker/credit.py) already keeps workers in step and the cap changed nothing:
  n = 4, k = 4: 1.44 s with a cap of 4, 1.46 s without; n = 8, k = 8, 50 Mbit/s: 3.08 s with 16, 3.05 s without
  (2026-11-30, docs/benchmarks.md). The cap never holds back a partition that comes earlier in the job-wide order
  than an unanswered one (worker/flow.py), so it cannot stall training whatever order hooks fire in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

KiB, MiB = 1 << 10, 1 << 20
PARTITION_SECONDS = 0.0035  # about a partition's time on the worker's link (rounded down to a power of two)
MIN_PARTITION, MAX_PARTITION = 16 * KiB, 4 * MiB
WINDOW_BYTES = 128 * KiB  # at least this much unacknowledged per worker, over all the servers
MIN_WINDOW, MAX_WINDOW = 2, 64
DEFAULT_WINDOW = 4  # where the links are unknown (loopback, shared memory)
FAN_IN_CAP = 4  # unanswered partitions per server where the servers' links are the bottleneck


SETTINGS = ("partition_bytes", "window", "unanswered")  # the Config fields a Tuning sets (where the user set none)


@dataclass(frozen=True)
class Tuning:
    """Settings for the data path, and why: the one type in which they travel (the scheduler's roster, the address
    book, RETUNE and REPLACE, a worker's state, /status), as a dict on the wire (`as_dict`, `from_dict`)."""

    partition_bytes: int
    window: int
    unanswered: int
    rate_bytes_per_s: float  # the link rate they were derived from (0: unknown)
    rtt_seconds: float
    reason: str
    workers_per_host: tuple[int, ...] = ()  # the hosts' link sharing they were derived for (the drift check's shares)
    derived_for: str | None = None  # why they were derived again (a failover, an elastic reset, drift); None: at start

    def as_dict(self) -> dict:
        return asdict(self) | {"workers_per_host": list(self.workers_per_host)}

    @classmethod
    def from_dict(cls, d: dict | None) -> Tuning | None:
        if not d:
            return None
        return cls(**{**d, "workers_per_host": tuple(d.get("workers_per_host") or ())})

    def settings(self) -> dict[str, int]:
        """What it sets in a worker's Config."""
        return {f: int(getattr(self, f)) for f in SETTINGS}

    def again(self, why: str) -> Tuning:
        """The same settings, derived again for `why`."""
        return replace(self, derived_for=why)

    def explained(self, more: str) -> Tuning:
        """The same settings with `more` added to the reason."""
        return replace(self, reason=self.reason + more)


def derive(
    worker_rates: Sequence[float],
    rtt_seconds: float = 0.0,
    default_partition: int = 4 * MiB,
    server_rates: Sequence[float] = (),
    servers: int = 0,
) -> Tuning:
    """Settings for workers whose links run at `worker_rates` bytes/s (one per worker; measured or given), dedicated
    servers at `server_rates`, with round-trip time `rtt_seconds`; `servers`: how many servers (dedicated and
    colocated) a worker's partitions spread over (0: the dedicated ones, or one). Unknown rates (empty, or any <= 0)
    keep the defaults."""
    rates = [r for r in worker_rates if r > 0]
    if not rates or len(rates) != len(worker_rates):
        return Tuning(default_partition, DEFAULT_WINDOW, 0, 0.0, rtt_seconds, "link rates unknown: defaults")
    rate = sorted(rates)[len(rates) // 2]  # the median: every worker must cut tensors the same way
    partition = _pow2_floor(rate * PARTITION_SECONDS)
    partition = max(MIN_PARTITION, min(MAX_PARTITION, default_partition, partition))
    bdp = rate * rtt_seconds
    spread = max(1, servers or len(server_rates))
    window = max(MIN_WINDOW, math.ceil(WINDOW_BYTES / (spread * partition)), math.ceil(2 * bdp / partition))
    window = min(MAX_WINDOW, window)
    # the servers' links are the bottleneck: fan-in from every worker, which TCP shares unfairly
    fan_in = bool(server_rates) and sum(server_rates) < 0.99 * sum(rates)
    cap = FAN_IN_CAP if fan_in else 0
    reason = (
        f"{rate * 8 / 1e6:.0f} Mbit/s per worker, RTT {rtt_seconds * 1e3:.2f} ms: {partition // KiB} KiB partitions "
        f"take "
        f"{partition / rate * 1e3:.2f} ms on the link; window {window} per server ({spread}) covers "
        f"{max(WINDOW_BYTES / spread, 2 * bdp) / KiB:.0f} KiB (2x the bandwidth-delay product, at least "
        f"{WINDOW_BYTES // KiB} KiB per worker, two partitions)"
    )
    if fan_in:
        reason += (
            f"; the servers' links ({sum(server_rates) * 8 / 1e6:.0f} Mbit/s together) are the bottleneck: cap {cap}"
        )
    return Tuning(partition, window, cap, rate, rtt_seconds, reason)


ETHERNET_MTU = 1500  # a link's MTU unless told otherwise (jumbo frames: 9000)


def framing(mtu: int) -> float:
    """Bytes on the wire per byte of TCP payload at `mtu`: Ethernet's 14-byte header, IP's 20 and TCP's 32 (with the
    timestamps Linux sends) around every segment. A link's rate counts them, so no TCP job gets below S/B times this
    (1.046 at 1500 bytes, 1.007 at 9000), the other direction's acknowledgements aside."""
    return (mtu + 14) / (mtu - 52)


def parse_rate(rate: str) -> float:
    """'100mbit' -> 1e8 bits per second (tc's spelling: kbit, mbit, gbit), as GRADWIRE_LINK_RATE and the emulated
    network's links are given."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)bit\s*", rate.lower())
    if not m:
        raise ValueError(f"rate must look like 100mbit, 1gbit or 500kbit, got {rate!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def _pow2_floor(x: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(x, 1.0)))))


# -- following the links while the job runs ---------------------------------------------------------------------------

DRIFT_BAND = 2.0  # the measured rate must be this far from the rate the settings were derived from (either way) ...
DRIFT_SAMPLES = 3  # ... in this many intervals in a row, with traffic (idle intervals neither count nor break a run)
DRIFT_COOLDOWN_INTERVALS = 6  # no re-derivation sooner than this many intervals after the last; doubled each time
FULL_WINDOW_SHARE = 0.5  # a slower link is believed only where the window was full this share of the busy time ...
HOST_BUSY_SHARE = 0.8  # ... and the job's hosts' CPUs were busy less than this share of the interval
# The measure reads this share of the link's rate: a push's acknowledgement queues behind sums on the way back, so
# the busy time includes some of the return's. Measured: 72 Mbit/s on 100 Mbit/s links that the rendezvous's probe
# read as 100 (`gradwire bench --netem --train --drift 1gbit:100mbit`, n = 4, k = 4, 2026-12-01); the rendezvous
# derived 32 KiB partitions for them, the uncorrected measure 16 KiB: 2.27 s a step against 1.61 s in that run.
MEASURED_SHARE = 0.75


@dataclass
class Sample:
    """One interval of one worker's network links: bytes acknowledged, seconds with a push unacknowledged, and seconds
    the sender waited on a full window (the links, not this worker's CPU, held it back). `sharers`: the workers whose
    samples it combines, which share one host's link (`of_host`); `rate` is per worker, as the settings are."""

    bytes: int
    busy_seconds: float
    full_seconds: float
    sharers: int = 1

    @property
    def rate(self) -> float:
        return self.bytes / self.busy_seconds / self.sharers if self.busy_seconds > 0 else 0.0

    @classmethod
    def of_host(cls, samples: Sequence[Sample]) -> Sample:
        """The samples of the workers of one host as one: the host link's bytes over the time it was busy.

        A worker's own rate is only its share of the link while the others push too, and up to the whole link while
        they wait: judged alone, four workers on a 100 Mbit/s host read 17-25 Mbit/s each where the settings were for
        98, and the job would re-cut itself mid-step. Their busy spans overlap in data-parallel training (every
        worker's backward pass ends at about the same time), so the host was busy about the longest of them; the
        window-full time keeps its share of the busy time."""
        busy = max((s.busy_seconds for s in samples), default=0.0)
        total_busy = sum(s.busy_seconds for s in samples)
        full = busy * sum(s.full_seconds for s in samples) / total_busy if total_busy > 0 else 0.0
        return cls(sum(s.bytes for s in samples), busy, full, len(samples))


class Drift:
    """Decides when the links the settings were derived from are no longer the links the job has.

    The model: a worker's pushes over the network move at the rate the settings were derived for (`Tuning.
    rate_bytes_per_s`), so a step's communication takes its bytes over that rate. Measured: each interval (a heartbeat),
    each worker's bytes acknowledged over the time some push of it was unacknowledged. Waiting for other workers
    (stragglers, a compute phase) is not in that time: a push is acknowledged as soon as its server has it, whoever
    else has pushed. The median over the workers, over MEASURED_SHARE, is the job's measured rate.

    A re-derivation is due when the measured rate is more than DRIFT_BAND times away from the model's, in
    DRIFT_SAMPLES intervals in a row that carried traffic; the new rate is the median of those intervals. Damping:
    - the band: the settings move in powers of two of the rate, so noise within 2x changes nothing, and the new
      model rate is the measured one, so the next re-derivation needs another 2x move from there;
    - a cooldown after each re-derivation, doubled every time (DRIFT_COOLDOWN_INTERVALS to start): however the links
      behave, the settings change at most log2(job length / interval) times, so they cannot oscillate;
    - a slower rate is believed only where the senders waited on a full window for most of the busy time, and the
      hosts had CPU to spare: a slow link fills the window while the CPUs idle; a sender short of CPU does not fill
      it, and a server (or a receiving thread) short of CPU fills it with the CPUs busy. Shrinking partitions where
      the CPU is what limits would cost more CPU per byte: a spiral down to the smallest partitions;
    - nothing moves past the partition sizes' bounds (a faster link than 4 MiB partitions need changes nothing).
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.cooldown = DRIFT_COOLDOWN_INTERVALS * interval
        self.not_before = 0.0
        self.run: list[float] = []  # the measured rates of the current run of drifted intervals
        self.direction = 0  # of that run: -1 slower, +1 faster
        self.last: dict = {}  # the last interval's judgement, for /status

    def observe(
        self, now: float, samples: Sequence[Sample], tuning: Tuning, host_busy: float | None = None
    ) -> float | None:
        """One interval's samples (one per worker that moved bytes) and the share of it the job's hosts' CPUs were
        busy (None: unknown); the rate to derive the settings for anew when a re-derivation is due, else None."""
        model, partition = tuning.rate_bytes_per_s, tuning.partition_bytes
        busy = [s for s in samples if s.busy_seconds > 0 and s.bytes > 0]
        if model <= 0 or not busy:
            return None  # nothing to compare with, or an idle interval
        rate = sorted(s.rate for s in busy)[len(busy) // 2] / MEASURED_SHARE
        full = sum(s.full_seconds for s in busy) / sum(s.busy_seconds for s in busy)
        direction = 0
        if rate > DRIFT_BAND * model and partition < MAX_PARTITION:
            direction = 1
        elif rate * DRIFT_BAND < model and partition > MIN_PARTITION and full >= FULL_WINDOW_SHARE:
            direction = -1 if host_busy is None or host_busy < HOST_BUSY_SHARE else 0
        self.last = {"measured_bytes_per_s": rate, "model_bytes_per_s": model, "window_full_share": round(full, 3)}
        self.last["host_cpu_busy_share"] = None if host_busy is None else round(host_busy, 3)
        if direction == 0 or direction != self.direction:
            self.run = []
        self.direction = direction
        if direction:
            self.run = [*self.run[1 - DRIFT_SAMPLES :], rate]
        if len(self.run) < DRIFT_SAMPLES or now < self.not_before:
            return None
        new = sorted(self.run)[len(self.run) // 2]
        self.run, self.direction = [], 0
        self.not_before = now + self.cooldown
        self.cooldown *= 2
        return new
