"""A script run with plain `python`, no launcher and no scheduler given (as Horovod's scripts run as one process):
init() makes a job of one worker in the process, every collective answers with the worker's own input without a
frame to the server, training matches a model trained alone, and the process ends cleanly. Several workers expected
with no scheduler is an error that says so, not a wait."""

import os
import subprocess
import sys

import pytest

from tests.multiprocess.harness import ROOT

pytestmark = pytest.mark.multiprocess
JOB = str(ROOT / "tests" / "multiprocess" / "standalone_job.py")


def _env(**more):
    # as a user's shell would have it: nothing of gradwire's, BytePS's or torchrun's
    prefixes = ("GRADWIRE_", "DMLC_", "BYTEPS_", "TORCHELASTIC_")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        clean.pop(name, None)
    return clean | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)} | more


def _run(env, timeout=90):
    try:
        done = subprocess.run(
            [sys.executable, JOB], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the one-process job hung past {timeout}s: {e.stdout} {e.stderr}") from None
    return done.returncode, done.stdout + done.stderr


def test_plain_python_runs_a_job_of_one_worker():
    code, output = _run(_env())
    assert "SIZE 1 RANK 0 LOCAL 0 1" in output, output
    assert "ALL OK" in output and code == 0, output
    assert "no job secret" not in output, output  # the job made its own


def test_several_workers_without_a_scheduler_is_an_error_not_a_wait():
    code, output = _run(_env(WORLD_SIZE="4"), timeout=60)
    assert code != 0
    assert "4 workers expected" in output and "GRADWIRE_SCHEDULER" in output, output


def test_the_bench_baseline_of_one_process_trains_without_gradwire():
    # `python -m gradwire.bench.train plain`: the figure beside the no-launcher job's (docs/migrating.md)
    import json

    done = subprocess.run(
        [sys.executable, "-m", "gradwire.bench.train", "plain", "2", "1"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["way"] == "plain" and len(row["times"]) == 2 and row["samples_per_step"] == 32, row
    assert "pushed_bytes_per_step" not in row, row
