"""Start a benchmark job of either system on this machine and collect rank 0's timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gradwire.config import Config
from gradwire.scheduler import Scheduler

MiB = 1 << 20


@dataclass
class Timing:
    system: str
    workers: int
    servers: int
    bytes: int
    times: list[float]
    server_peak_rss: int = 0  # bytes, the largest over the servers (gradwire only)
    worker_cpu: float = 0.0  # CPU seconds of every worker process in the timed calls
    server_cpu: float = 0.0  # CPU seconds of every server process over the timed calls' span (gradwire only)

    @property
    def gigabytes(self) -> float:
        """Bytes reduced in the timed calls, over all workers (each worker's SIZE, per call), in GB."""
        return self.workers * self.bytes * len(self.times) / 1e9

    def cpu_per_gb(self, role: str = "all") -> float:
        """CPU seconds per GB reduced: of the workers, the servers, or all."""
        cpu = {"workers": self.worker_cpu, "servers": self.server_cpu}.get(role, self.worker_cpu + self.server_cpu)
        return cpu / self.gigabytes if self.gigabytes else 0.0

    @property
    def median(self) -> float:
        ordered = sorted(self.times)
        return ordered[len(ordered) // 2]


def _worker_cmd(system: str, sizes: list[int], repeats: int, warmup: int) -> list[str]:
    joined = ",".join(str(s) for s in sizes)
    return [sys.executable, "-m", "gradwire.bench.workers", system, joined, str(repeats), str(warmup)]


def _collect(procs: list[subprocess.Popen], what: str, timeout: float) -> list[str]:
    outputs = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"{what} rank {rank} did not finish within {timeout}s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"{what} rank {rank} exited with {proc.returncode}:\n{err[-3000:]}")
        outputs.append(out)
    return outputs


def _parse(system: str, n: int, k: int, outputs: list[str], server_cpu: CpuSampler | None = None) -> list[Timing]:
    """Rank 0's timings, with every rank's CPU seconds (and the servers' over the same span)."""
    rows = [json.loads(line) for line in outputs[0].splitlines() if line.startswith("{")]
    cpu = [json.loads(line[4:]) for out in outputs for line in out.splitlines() if line.startswith("CPU ")]
    timings = []
    for r in rows:
        mine = [c for c in cpu if c["bytes"] == r["bytes"]]
        t = Timing(system, n, k, r["bytes"], r["times"], worker_cpu=sum(c["cpu"] for c in mine))
        if server_cpu is not None and mine:
            t.server_cpu = server_cpu.between(min(c["start"] for c in mine), max(c["end"] for c in mine))
        timings.append(t)
    return timings


class CpuSampler:
    """The CPU seconds used so far by a set of processes, sampled every 20 ms (from /proc), so that the CPU spent
    between two wall-clock times can be read afterwards (interpolated between samples)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.samples: list[tuple[float, float]] = []
        self._last = {pid: 0.0 for pid in pids}  # a process that exited keeps its last reading

    def sample(self) -> None:
        for pid in self.pids:
            self._last[pid] = _cpu_seconds(pid) or self._last[pid]
        self.samples.append((time.time(), sum(self._last.values())))

    def between(self, start: float, end: float) -> float:
        return self._at(end) - self._at(start)

    def _at(self, when: float) -> float:
        before = [s for s in self.samples if s[0] <= when]
        after = [s for s in self.samples if s[0] >= when]
        if not before or not after:
            return (before or after or [(0.0, 0.0)])[-1 if before else 0][1]
        (t0, c0), (t1, c1) = before[-1], after[0]
        return c0 if t1 == t0 else c0 + (c1 - c0) * (when - t0) / (t1 - t0)


def run_gradwire(
    n: int, k: int, sizes: list[int], repeats: int, warmup: int, env: dict[str, str], timeout: float = 600
) -> list[Timing]:
    """One gradwire job: scheduler in this process, k server and n worker processes."""
    base = Config.from_env(env, num_workers=n, num_servers=k)
    scheduler = Scheduler(Config.from_env(env, role="scheduler", num_workers=n, num_servers=k)).start()
    job = {"GRADWIRE_SCHEDULER": scheduler.address, "GRADWIRE_NUM_WORKERS": str(n), "GRADWIRE_NUM_SERVERS": str(k)}
    child_env = os.environ | env | job | {"GRADWIRE_PARTITION_BYTES": str(base.partition_bytes)}
    servers = [
        subprocess.Popen(
            [sys.executable, "-m", "gradwire", "server"],
            env=child_env | {"GRADWIRE_RANK": str(r)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(k)
    ]
    workers = [
        subprocess.Popen(
            _worker_cmd("gradwire", sizes, repeats, warmup),
            env=child_env | {"GRADWIRE_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]
    watch = _ServerWatch(servers)
    try:
        out = _collect(workers, "gradwire worker", timeout)
        watch.stop()
        timings = _parse("gradwire", n, k, out, watch.cpu)
        for t in timings:
            t.server_peak_rss = watch.peak
        return timings
    finally:
        watch.stop()
        for proc in servers:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        scheduler.stop()


class _ServerWatch:
    """The servers' CPU use and peak RSS, sampled while they run (they exit as soon as the workers say bye)."""

    def __init__(self, servers: list[subprocess.Popen]) -> None:
        self.servers, self.peak = servers, 0
        self.cpu = CpuSampler([p.pid for p in servers])
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            self.cpu.sample()
            if len(self.cpu.samples) % 10 == 0:
                self.peak = max([self.peak] + [_peak_rss(p.pid) for p in self.servers])

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def run_gloo(n: int, sizes: list[int], repeats: int, warmup: int, timeout: float = 600) -> list[Timing]:
    """One torch.distributed gloo job of n ranks (ring all_reduce), rendezvous through a file."""
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{Path(tmp) / 'rendezvous'}"
        procs = [
            subprocess.Popen(
                _worker_cmd("gloo", sizes, repeats, warmup),
                env=os.environ | {"RANK": str(r), "WORLD_SIZE": str(n), "GRADWIRE_BENCH_INIT": init},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(n)
        ]
        return _parse("gloo", n, 0, _collect(procs, "gloo", timeout))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (all its threads); 0 if it has gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss(pid: int) -> int:
    """VmHWM (peak resident memory) of a live process, in bytes; 0 if it has gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
