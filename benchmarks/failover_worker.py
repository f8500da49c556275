"""The worker of `python -m benchmarks --failover`: push_pull steps with exact sums, timed, until told to stop.

Every step sums TENSORS tensors of MIB MiB each (in place, all in flight at once) and checks the sums exactly
(small integers in float32). At step KILL_AT worker 0 prints `KILL`, and the bench SIGKILLs a process. Each
worker prints one `RESULT {json}` line: its step durations, whether every sum was right, its failover records,
and, if a worker was lost, when and how it learnt. BENCH_MEET_AFTER=m: m steps after the kill every worker meets at a
barrier and declares a new tensor (what needs the scheduler: `--kill scheduler`), and records when each was done.
BENCH_KILL_FILE: worker 0 also creates this file at the kill's step.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

import gradwire as gw


def main() -> None:
    tensors, mib = int(os.environ["BENCH_TENSORS"]), float(os.environ["BENCH_MIB"])
    steps, kill_at = int(os.environ["BENCH_STEPS"]), int(os.environ["BENCH_KILL_AT"])
    meet_at = kill_at + int(os.environ.get("BENCH_MEET_AFTER", "-1"))
    gw.init()
    print(f"PID {os.getpid()}", flush=True)
    n, rank = gw.size(), gw.rank()
    count = int(mib * (1 << 20)) // 4
    arrays = [np.empty(count, np.float32) for _ in range(tensors)]
    durations, correct, lost, met = [], True, None, {}
    try:
        for step in range(steps):
            if step == kill_at and rank == 0:
                print(f"KILL {time.time():.6f}", flush=True)
                if os.environ.get("BENCH_KILL_FILE"):  # on the emulated network the bench reads no output live
                    open(os.environ["BENCH_KILL_FILE"], "w").close()
            if step == meet_at > kill_at:
                gw.barrier()
                met["barrier_at"] = time.time()
                gw.push_pull(np.ones(4, np.float32), f"new.{step}")
                met["declared_at"] = time.time()
            started = time.perf_counter()
            for t, a in enumerate(arrays):
                a.fill(rank + step + t)
            handles = [gw.push_pull_async(a, f"t{t}", out=a) for t, a in enumerate(arrays)]
            for h in handles:
                gw.synchronize(h)
            durations.append(time.perf_counter() - started)
            for t, a in enumerate(arrays):
                expected = n * (n - 1) / 2 + n * (step + t)
                correct &= bool(a[0] == expected and a[-1] == expected and a[count // 2] == expected)
    except gw.WorkerLost as e:
        lost = {"rank": e.lost_rank, "at": time.time(), "message": str(e)}
    worker = gw.current_worker()
    record = {"rank": rank, "steps": durations, "correct": correct, "failovers": worker.failovers, "lost": lost}
    record |= met | {"resumes": worker.control.resumes}
    print("RESULT " + json.dumps(record), flush=True)
    if lost is None:
        gw.shutdown()


if __name__ == "__main__":
    main()
