"""Run `gradwire launch` as a real process tree, with a hard deadline and a useful failure report."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Result:
    code: int
    output: str

    def lines(self, prefix: str) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith(prefix)]


def launch(
    workers: int,
    servers: int,
    script: str,
    *args: str,
    timeout: float = 60,
    env: dict | None = None,
    options: tuple[str, ...] = (),
) -> Result:
    """Launch a job; on a hang, kill the tree and fail naming the processes that never finished."""
    cmd = [
        sys.executable,
        "-m",
        "gradwire",
        "launch",
        "-n",
        str(workers),
        "-s",
        str(servers),
        "--timeout",
        "20",
        *options,
        "--",
        sys.executable,
        script,
        *args,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | (env or {}),
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        finished = {line.split("]")[0] + "]" for line in out.splitlines() if "DONE" in line}
        expected = {f"[worker {r}]" for r in range(workers)}
        raise AssertionError(
            f"job hung past {timeout}s; workers that never printed DONE: {sorted(expected - finished)}\n{out}"
        ) from None
    return Result(proc.returncode, out)


def leftover_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (each test passes a unique one)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if marker in cmdline and "State:\tZ" not in status:
            found.append(f"{pid}: {cmdline}")
    return found
