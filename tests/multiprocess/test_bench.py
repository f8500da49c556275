import json
import subprocess
import sys

import pytest

from tests.multiprocess.harness import ROOT

pytestmark = pytest.mark.multiprocess


def _bench(*extra: str) -> list[dict]:
    argv = [sys.executable, "-m", "gradwire", "bench", "-n", "2", "-s", "1", "--sizes", "0.25", "--rounds", "1"]
    argv += ["--repeats", "2", "--warmup", "1", "--json", *extra]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_bench_json_has_both_systems_and_the_documented_fields():
    records = _bench()
    assert {r["system"] for r in records} == {"gradwire", "gradwire-tcp", "gloo"}
    for r in records:
        assert {"system", "workers", "servers", "bytes", "seconds_median"} <= r.keys()
        assert r["workers"] == 2 and r["bytes"] == 1 << 18 and r["seconds_median"] > 0


def test_bench_times_a_compressed_allreduce_against_gloos_plain_one():
    records = _bench("--collective", "allreduce-onebit")
    assert {r["system"] for r in records} == {"gradwire", "gradwire-tcp", "gloo"}
    assert all(r["seconds_median"] > 0 for r in records)


def test_the_cross_barrier_training_way_runs_under_the_launcher():
    # `gradwire bench --netem --train --ways crossbarrier`'s workers: the step returns at once, the last one applies
    # every update, and the job ends cleanly
    argv = [sys.executable, "-m", "gradwire", "launch", "-n", "2", "-s", "1", "--"]
    argv += [sys.executable, "-m", "gradwire.bench.train", "crossbarrier", "3", "1"]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    line = next(line for line in out.stdout.splitlines() if '"way": "crossbarrier"' in line)
    row = json.loads(line[line.index("{") :])
    assert row["optimizer"] == "CrossBarrier" and len(row["times"]) == 3 and row["pushed_bytes_per_step"] > 0, row
