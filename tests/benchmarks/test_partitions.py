"""`python -m benchmarks`, the lab's command: its harnesses beside `gradwire bench`'s options, started from the
repository's root as the docs' commands are."""

import json
import subprocess
import sys

import pytest

from tests.multiprocess.harness import ROOT

pytestmark = pytest.mark.multiprocess


def _lab(*extra: str) -> list[dict]:
    argv = [sys.executable, "-m", "benchmarks", "-n", "2", "-s", "1", "--sizes", "0.25", "--rounds", "1"]
    argv += ["--repeats", "2", "--warmup", "1", "--json", *extra]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_partitions_runs_the_job_with_the_python_and_the_native_worker():
    """`--partitions` runs the job once per worker kind (the native one where gradwire-native is installed: `make test`
    requires it) and reports both roles' CPU; the native worker's job checks every sum (bench/workers.py)."""
    from gradwire import native

    records = [r for r in _lab("--partitions", "64") if "worker" in r]
    kinds = {r["worker"] for r in records}
    assert kinds == ({"python", "native"} if native.load().module is not None else {"python"})
    for r in records:
        assert r["partition_bytes"] == 64 << 10 and r["worker_cpu_seconds_per_gb"] > 0 and r["seconds_median"] > 0


def test_without_a_lab_option_it_runs_gradwire_bench():
    assert {r["system"] for r in _lab()} == {"gradwire", "gradwire-tcp", "gloo"}
