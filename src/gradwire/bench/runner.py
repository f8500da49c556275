"""Start a benchmark job of either system on this machine and collect rank 0's timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
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

    @property
    def median(self) -> float:
        ordered = sorted(self.times)
        return ordered[len(ordered) // 2]


def _worker_cmd(system: str, sizes: list[int], repeats: int, warmup: int) -> list[str]:
    joined = ",".join(str(s) for s in sizes)
    return [sys.executable, "-m", "gradwire.bench.workers", system, joined, str(repeats), str(warmup)]


def _collect(procs: list[subprocess.Popen], what: str, timeout: float) -> str:
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
    return outputs[0]


def _parse(system: str, n: int, k: int, out: str) -> list[Timing]:
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [Timing(system, n, k, r["bytes"], r["times"]) for r in rows]


def run_gradwire(
    n: int, k: int, sizes: list[int], repeats: int, warmup: int, env: dict[str, str], timeout: float = 600
) -> list[Timing]:
    """One gradwire job: scheduler in this process, k server and n worker processes."""
    base = Config.from_env(env, num_workers=n, num_servers=k)
    scheduler = Scheduler(Config.from_env(env, role="scheduler", num_workers=n, num_servers=k)).start()
    child_env = (
        os.environ
        | env
        | {
            "GRADWIRE_SCHEDULER": scheduler.address,
            "GRADWIRE_NUM_WORKERS": str(n),
            "GRADWIRE_NUM_SERVERS": str(k),
            "GRADWIRE_PARTITION_BYTES": str(base.partition_bytes),
        }
    )
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
    peaks = [0]
    done = threading.Event()

    def sample() -> None:  # servers exit as soon as the workers say bye: read their peak while they run
        while not done.wait(0.2):
            peaks[0] = max([peaks[0]] + [_peak_rss(p.pid) for p in servers])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = _collect(workers, "gradwire worker", timeout)
        done.set()
        sampler.join()
        peak = peaks[0]
        timings = _parse("gradwire", n, k, out)
        for t in timings:
            t.server_peak_rss = peak
        return timings
    finally:
        done.set()
        for proc in servers:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        scheduler.stop()


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


def _peak_rss(pid: int) -> int:
    """VmHWM (peak resident memory) of a live process, in bytes; 0 if it has gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
