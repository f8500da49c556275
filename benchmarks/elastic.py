"""`python -m benchmarks --elastic`: the elastic example under a SIGKILL at a random moment, run after run.

Each run launches `examples/elastic_train.py` as a user would (`gradwire launch -n 3 -s 2 --min-workers 2
--max-workers 3`), SIGKILLs worker 2 at one moment and reads, from the job's own output: whether the launcher exited
0, the final accuracy, and, from the scheduler's log (GRADWIRE_LOG_LEVEL=INFO: the job's timestamps), how long after
the kill the job re-formed without the worker and re-formed again with the launcher's replacement. A run that does not
end by its deadline is a hang: it is killed, counted and reported. The moments:
- `mid-training`: a random time between the first and the last epoch (inside a step, at a commit or between them);
- `epoch-end`: as rank 0 reports the end of a random epoch;
- `shutdown`: as rank 0 prints the final accuracy (the work is done; nothing is re-formed or replaced).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO

from benchmarks import ROOT

MOMENTS = ("mid-training", "epoch-end", "shutdown")
EXAMPLE = ROOT / "examples" / "elastic_train.py"
_LOGGED = re.compile(r"^\[scheduler\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) gradwire\.scheduler \w+ (.*)$")


@dataclass
class ElasticRun:
    """One run of the example with one SIGKILL."""

    moment: str
    code: int | None  # the launcher's exit code; None: it hung and was killed
    seconds: float  # launch to the launcher's exit
    accuracy: float | None
    killed_at: float | None = None  # wall clock of the kill (None: the job ended first)
    reformed_after: float | None = None  # seconds from the kill to the job re-formed without the worker
    joined_after: float | None = None  # ... to the job re-formed with the replacement in it
    exit_after: float | None = None  # seconds from rank 0's final accuracy to the launcher's exit
    output: str = field(default="", repr=False)

    @property
    def completed(self) -> bool:
        return self.code == 0 and self.accuracy is not None


def run_once(moment: str, epochs: int = 5, timeout: float = 120, seed: int | None = None) -> ElasticRun:
    """Launch the example, SIGKILL worker 2 at `moment` (MOMENTS), and collect what happened. Never hangs: past
    `timeout` the job is killed and the run reported with code None."""
    marker = uuid.uuid4().hex  # finds this run's worker 2 among the machine's processes
    cmd = [sys.executable, "-m", "gradwire", "launch", "-n", "3", "-s", "2", "--min-workers", "2"]
    cmd += ["--max-workers", "3", "--", sys.executable, str(EXAMPLE), "--epochs", str(epochs)]
    env = os.environ | {"GRADWIRE_LOG_LEVEL": "INFO", "GRADWIRE_ELASTIC_RUN": marker, "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    watch = _Watch(moment, epochs, random.Random(seed), lambda: _kill_worker(marker, 2))
    reader = threading.Thread(target=watch.read, args=(proc.stdout,), daemon=True)
    reader.start()
    try:
        code: int | None = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    ended = time.monotonic()
    reader.join(5)
    assert proc.stdout is not None
    proc.stdout.close()
    watch.stop()
    output = "".join(watch.lines)
    killed = watch.killed[0] if watch.killed else None
    result = ElasticRun(moment, code, ended - started, _accuracy(output), killed, output=output)
    result.exit_after = ended - watch.result_at[0] if watch.result_at else None
    if killed is not None:
        result.reformed_after = _logged_after(output, killed, "with 2 workers")
        result.joined_after = _logged_after(output, killed, "with 3 workers")
    return result


class _Watch:
    """Reads a run's output and kills the worker at the run's moment."""

    def __init__(self, moment: str, epochs: int, rng: random.Random, kill: Callable[[], bool]) -> None:
        self.moment, self.epochs, self.rng, self._kill = moment, epochs, rng, kill
        self.kill_epoch = rng.randrange(1, max(2, epochs - 1))
        self.lines: list[str] = []
        self.killed: list[float] = []  # wall clock of the kill
        self.result_at: list[float] = []  # when rank 0 printed the final accuracy (monotonic)
        self.epoch_ends: list[float] = []
        self.timer: threading.Timer | None = None

    def read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line)
            if line.startswith("[worker 0] epoch ") and self.moment == "mid-training" and self.timer is None:
                self.epoch_ends.append(time.monotonic())
                if len(self.epoch_ends) == 2:  # an epoch's length: somewhere in the epochs still to come
                    rest = (self.epochs - 3) * (self.epoch_ends[1] - self.epoch_ends[0])
                    self.timer = threading.Timer(self.rng.uniform(0, max(rest, 0.0)), self.kill)
                    self.timer.start()
            elif line.startswith(f"[worker 0] epoch {self.kill_epoch}:") and self.moment == "epoch-end":
                self.kill()
            elif line.startswith('[worker 0] {"accuracy"'):
                self.result_at.append(time.monotonic())
                if self.moment == "shutdown":
                    self.kill()

    def kill(self) -> None:
        if not self.killed and self._kill():
            self.killed.append(time.time())

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


def _kill_worker(marker: str, rank: int) -> bool:
    """SIGKILL the worker process of rank `rank` in the run marked `marker` (read from /proc: its environment)."""
    wanted = {f"GRADWIRE_ELASTIC_RUN={marker}", f"GRADWIRE_RANK={rank}", "GRADWIRE_ROLE=worker"}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0"))
        except OSError:
            continue
        if wanted <= environ:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                return False
            return True
    return False


def _accuracy(output: str) -> float | None:
    found = re.search(r'^\[worker 0\] (\{"accuracy".*\})$', output, re.M)
    return float(json.loads(found.group(1))["accuracy"]) if found else None


def _logged_after(output: str, since: float, text: str) -> float | None:
    """Seconds from `since` (wall clock) to the first scheduler log line after it saying "job re-formed ... {text}"."""
    for line in output.splitlines():
        found = _LOGGED.match(line)
        if found and "job re-formed" in found.group(2) and text in found.group(2):
            at = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at >= since - 0.001:
                return at - since
    return None


def run_elastic(args: argparse.Namespace) -> int:
    """`python -m benchmarks --elastic`: a failure-free run, then `--runs` runs each killed at a random moment."""
    rng = random.Random(args.seed)
    reference = run_once("none", args.epochs, args.timeout)
    print(
        f"failure-free run: exit {reference.code}, accuracy {reference.accuracy}, {reference.seconds:.1f} s", flush=True
    )
    runs = []
    for i in range(args.runs):
        moment = rng.choice(MOMENTS)
        run = run_once(moment, args.epochs, args.timeout, seed=rng.randrange(1 << 30))
        runs.append(run)
        print(_line(i + 1, run), flush=True)
        if not run.completed:
            print(run.output[-4000:], file=sys.stderr, flush=True)
    print("\n" + summary(reference, runs))
    return 0 if all(r.completed for r in runs) else 1


def _line(i: int, run: ElasticRun) -> str:
    after = "" if run.killed_at is None else " killed;"
    for name, value in (("re-formed", run.reformed_after), ("replacement in", run.joined_after)):
        after += f" {name} {value * 1e3:.0f} ms later;" if value is not None else ""
    status = "HUNG" if run.code is None else f"exit {run.code}"
    return f"run {i} ({run.moment}):{after} {status} after {run.seconds:.1f} s, accuracy {run.accuracy}"


def summary(reference: ElasticRun, runs: list[ElasticRun]) -> str:
    """Markdown: per moment, runs completed, hangs, times from the kill, accuracy spread."""
    lines = [
        "| moment | runs | completed (exit 0) | hangs | kill -> re-formed, ms (median, max) "
        "| kill -> replacement in, s (median, max) | accuracy (min, median, max) | result -> launcher exit, s (max) "
        "| run s (median) |",
        "|---|---:|---:|---:|---|---|---|---:|---:|",
    ]
    for moment in (*MOMENTS, "all"):
        chosen = [r for r in runs if moment in ("all", r.moment)]
        if not chosen:
            continue
        reformed = [r.reformed_after * 1e3 for r in chosen if r.reformed_after is not None]
        joined = [r.joined_after for r in chosen if r.joined_after is not None]
        accuracy = [r.accuracy for r in chosen if r.accuracy is not None]
        lines.append(
            f"| {moment} | {len(chosen)} | {sum(r.completed for r in chosen)} | {sum(r.code is None for r in chosen)} "
            f"| {_spread(reformed, '.0f')} | {_spread(joined, '.1f')} | {_spread(accuracy, '.4f', low=True)} "
            f"| {max((r.exit_after for r in chosen if r.exit_after is not None), default=float('nan')):.1f} "
            f"| {statistics.median(r.seconds for r in chosen):.1f} |"
        )
    lines.append(f"\nFailure-free run: accuracy {reference.accuracy}, {reference.seconds:.1f} s.")
    return "\n".join(lines)


def _spread(values: list[float], fmt: str, low: bool = False) -> str:
    if not values:
        return "-"
    parts = ([min(values)] if low else []) + [statistics.median(values), max(values)]
    return ", ".join(format(v, fmt) for v in parts) + f" (of {len(values)})"
