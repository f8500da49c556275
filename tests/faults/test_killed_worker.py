import os
import subprocess
import sys

import pytest

from gradwire.config import Config
from gradwire.scheduler import Scheduler
from tests.multiprocess.harness import ROOT

pytestmark = pytest.mark.multiprocess


def test_every_survivor_of_a_sigkilled_worker_raises_worker_lost_naming_it():
    secret = os.urandom(8).hex()
    scheduler = Scheduler(Config(role="scheduler", num_workers=3, num_servers=1, secret=secret)).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADWIRE_", "DMLC_"))} | {
        "GRADWIRE_SCHEDULER": scheduler.address,
        "GRADWIRE_NUM_WORKERS": "3",
        "GRADWIRE_NUM_SERVERS": "1",
        "GRADWIRE_SECRET": secret,
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "gradwire", "server"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    workers = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "faults" / "killed_worker_job.py")],
            env=env | {"GRADWIRE_RANK": str(r)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(3)
    ]
    try:
        outs = [w.communicate(timeout=60)[0] for w in workers]
    finally:
        for p in [server, *workers]:
            if p.poll() is None:
                p.kill()
                p.wait()
        scheduler.stop()
    assert workers[2].returncode == -9, outs[2]
    killed_at = float(outs[2].split("KILLED ")[1].split()[0])
    for rank in (0, 1):
        assert workers[rank].returncode == 0, outs[rank]
        line = next(x for x in outs[rank].splitlines() if x.startswith("LOST"))
        assert "rank=2" in line and "lost worker 2" in line
        latency = float(line.split("at=")[1].split()[0]) - killed_at
        print(f"\nworker {rank} learnt of worker 2's death after {latency * 1000:.0f} ms")
        assert latency < 5.0
