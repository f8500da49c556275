"""`python -m benchmarks --failover --kill scheduler --netem`: the scheduler SIGKILLed on the emulated network (its own
host, every host on a shaped link), restarted on its host at its address, or taken over by a standby on a server's host.

The same worker and summary as on loopback (benchmarks/failover.py): per worker, from the SIGKILL to the job resumed, to
the barrier passed and to a new tensor's declaration answered, and the steps during the outage against the median
before."""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from benchmarks.failover import MEET_AFTER, bench_env, print_rows, summarize

if TYPE_CHECKING:
    from gradwire.netem import EmulatedCluster
    from gradwire.netem.jobs import Job

TRIALS = {"scheduler, restarted on its host": False, "scheduler, a standby on a server's host takes over": True}


def run_trial(standby: bool, workers: int, servers: int, rate: str, env: dict[str, str]) -> dict:
    from gradwire.netem import EmulatedCluster, Topology
    from gradwire.netem.jobs import start_gradwire

    topo = Topology(workers=workers, servers=servers, worker_rate=rate, server_rate=rate)
    argv = [sys.executable, "-m", "benchmarks.failover_worker"]
    with tempfile.TemporaryDirectory(prefix="gradwire-failover-") as tmp, EmulatedCluster(topo) as cluster:
        marker = os.path.join(tmp, "kill")
        job = start_gradwire(cluster, argv, os.environ | env | {"BENCH_KILL_FILE": marker}, standby_scheduler=standby)
        with job:
            return _kill_the_scheduler(cluster, job, marker, standby)


def _kill_the_scheduler(cluster: EmulatedCluster, job: Job, marker: str, standby: bool) -> dict:
    """Once the job's marker says it reached the step: SIGKILL its scheduler (restarted at once unless `standby`)."""
    from gradwire.netem.jobs import restart_scheduler

    deadline = time.monotonic() + 300
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.001)
    if not os.path.exists(marker):
        raise SystemExit("python -m benchmarks --failover --netem: the job never reached the kill's step")
    job.services[0].send_signal(signal.SIGKILL)  # `ip netns exec` execs: this is the scheduler's own process
    killed_at = time.time()
    if not standby:
        restart_scheduler(cluster, job)
    outputs = job.wait(timeout=600)
    results = [_result(out) for out in outputs]
    return {"killed_at": killed_at, "results": sorted(results, key=lambda r: r["rank"]), "code": 0}


def _result(output: str) -> dict:
    import json

    found = re.search(r"^RESULT (.*)$", output, re.M)
    if found is None:
        raise SystemExit(f"python -m benchmarks --failover --netem: a worker printed no result:\n{output[-2000:]}")
    return json.loads(found.group(1))


def run_failover_netem(args) -> int:  # noqa: ANN001 - argparse namespace
    """Restarted, then a standby, `args.rounds` times each; the partition size gradwire derives for the links unless
    --partition-bytes is given."""
    if args.kill != "scheduler":
        raise SystemExit("python -m benchmarks --failover --netem: only with --kill scheduler")
    env = bench_env(args) | {"BENCH_MEET_AFTER": str(MEET_AFTER)}
    if not args.partition_bytes:
        del env["GRADWIRE_PARTITION_BYTES"]
    rate = args.failover_rate

    def rows():
        for name, standby in TRIALS.items():
            for _ in range(args.rounds):
                trial = run_trial(standby, args.num_workers, args.num_servers, rate, env) | {"kill_at": 30}
                yield summarize(f"{name} ({rate} links)", trial)

    return print_rows(rows(), args.json)
