"""`python -m benchmarks --failover`: how fast a dead process is detected and the job recovers, with real SIGKILLs.

Each trial launches a job (`gradwire launch`), SIGKILLs one process in the middle of the run (server 1, with or
without a standby, or worker n-1), and reads every worker's report (benchmarks/failover_worker.py). Printed per trial:
- detection: from the SIGKILL to the moment each worker saw it (its connection closed, or WorkerLost raised);
- failover: from the SIGKILL to the scheduler's REPLACE reaching each worker, and the worker's own resend time;
- recovery: the step that took the failure, against the median step (the cost of the failure in step time);
- sums: whether every sum of every step on every worker was exact.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading

TRIALS = {
    "server, keys onto the survivors": ("server 1", 0),
    "server, keys to a standby": ("server 1", 1),
    "worker (default: the job stops)": ("worker", 0),
    "scheduler, restarted by the launcher": ("scheduler", 0),
    "scheduler, its standby takes over": ("scheduler", 1),  # a standby scheduler (standby servers: the others)
}
MEET_AFTER = 5  # steps after a scheduler's kill, the workers meet at a barrier and declare a tensor


def run_trial(kill: str, standby: int, workers: int, servers: int, env: dict[str, str], timeout: float = 300) -> dict:
    cmd = [sys.executable, "-m", "gradwire", "launch", "-n", str(workers), "-s", str(servers)]
    cmd += ["--standby-schedulers" if kill == "scheduler" else "--standby-servers", str(standby)]
    cmd += ["--", sys.executable, "-m", "benchmarks.failover_worker"]
    proc = subprocess.Popen(
        cmd, env=os.environ | env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    pids: dict[str, int] = {}
    results: list[dict] = []
    killed: list[float] = []
    tail: list[str] = []
    victim = kill if kill in ("server 1", "scheduler") else f"worker {workers - 1}"

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            del tail[:-40]
            found = re.search(r"^\[(\w+(?: \d+)?)\] (?:gradwire .*\(pid (\d+)\)|PID (\d+))", line)
            if found:
                pids[found.group(1)] = int(found.group(2) or found.group(3))
            elif "] KILL " in line and not killed:
                import time

                os.kill(pids[victim], signal.SIGKILL)
                killed.append(time.time())
            elif "] RESULT " in line:
                results.append(json.loads(line.split("] RESULT ", 1)[1]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise SystemExit("python -m benchmarks --failover: the job hung:\n" + "".join(tail)) from None
    reader.join(10)
    if proc.stdout is not None:
        proc.stdout.close()
    if not killed or not results:
        raise SystemExit("python -m benchmarks --failover: the job ended before the kill:\n" + "".join(tail))
    return {"killed_at": killed[0], "results": sorted(results, key=lambda r: r["rank"]), "code": proc.returncode}


def summarize(name: str, trial: dict) -> dict:
    t0 = trial["killed_at"]
    ms = lambda xs: [round((x - t0) * 1e3, 1) for x in xs if x is not None]  # noqa: E731
    results = trial["results"]
    out: dict = {"trial": name, "launcher_exit": trial["code"], "sums_exact": all(r["correct"] for r in results)}
    if any("barrier_at" in r for r in results):
        return out | _resumed(trial, ms)
    if any(r["lost"] for r in results):
        out["detected_ms"] = ms([r["lost"]["at"] for r in results if r["lost"]])
        return out
    records = [r["failovers"][0] for r in results if r["failovers"]]
    out["workers_failed_over"] = f"{len(records)}/{len(results)}"
    out["detected_ms"] = ms([f["lost_at"] for f in records])
    out["replaced_ms"] = ms([f["told_at"] for f in records])
    out["resend_ms"] = [round(f["seconds"] * 1e3, 1) for f in records]
    steps = [r["steps"] for r in results]
    median = statistics.median(d for s in steps for d in s)
    worst = max(max(s) for s in steps)
    out["median_step_ms"] = round(median * 1e3, 1)
    out["failure_step_ms"] = round(worst * 1e3, 1)
    out["failure_step_over_median"] = round(worst / median, 2)
    return out


def _resumed(trial: dict, ms) -> dict:  # noqa: ANN001
    """A scheduler's kill: the steps during the outage (the data path's, from the kill to the barrier that waits for
    the restarted scheduler) against the steps before, and from the kill to the barrier passed and to a new tensor's
    declaration answered on each worker."""
    results, kill_at = trial["results"], int(trial["kill_at"])
    before = statistics.median(d for r in results for d in r["steps"][5:kill_at])
    outage = statistics.median(d for r in results for d in r["steps"][kill_at : kill_at + MEET_AFTER])
    return {
        "workers_resumed": f"{sum(bool(r['resumes']) for r in results)}/{len(results)}",
        "resumed_ms": [round(r["resumes"][0]["seconds"] * 1e3, 1) for r in results if r["resumes"]],
        "barrier_passed_ms": ms([r["barrier_at"] for r in results]),
        "declaration_answered_ms": ms([r["declared_at"] for r in results]),
        "median_step_ms": round(before * 1e3, 1),
        "outage_step_ms": round(outage * 1e3, 1),
        "outage_step_over_median": round(outage / before, 2),
    }


def bench_env(args) -> dict[str, str]:  # noqa: ANN001 - argparse namespace
    """The failover worker's settings (benchmarks/failover_worker.py)."""
    return {
        "BENCH_TENSORS": "8",
        "BENCH_MIB": str(args.failover_mib),
        "BENCH_STEPS": "60",
        "BENCH_KILL_AT": "30",
        "GRADWIRE_PARTITION_BYTES": str(args.partition_bytes or 1 << 20),
    }


def run_failover(args) -> int:  # noqa: ANN001 - argparse namespace
    env = bench_env(args)
    kinds = (args.kill,) if args.kill else ("server", "worker")
    trials = {name: t for name, t in TRIALS.items() if t[0].split()[0] in kinds}

    def rows():
        for name, (kill, standby) in trials.items():
            meet = {"BENCH_MEET_AFTER": str(MEET_AFTER)} if kill == "scheduler" else {}
            for _ in range(args.rounds):
                trial = run_trial(kill, standby, args.num_workers, args.num_servers, env | meet) | {"kill_at": 30}
                yield summarize(name, trial)

    return print_rows(rows(), args.json)


def print_rows(rows, as_json: bool) -> int:  # noqa: ANN001 - an iterable of summaries
    """Print each trial's summary as it ends; 0 if every sum was exact."""
    done = []
    for row in rows:
        done.append(row)
        print(json.dumps(row) if as_json else _line(row), flush=True)
    return 0 if all(r["sums_exact"] for r in done) else 1


def _line(row: dict) -> str:
    return "; ".join(f"{k}={v}" for k, v in row.items())
