"""The examples the docs quote, run as users run them, so they never rot."""

import json
import os
import subprocess
import sys
import uuid

import pytest
from benchmarks.elastic import MOMENTS, run_once

from gradwire.config import Config
from gradwire.scheduler import Scheduler
from tests.multiprocess.harness import ROOT, launch, leftover_processes

pytestmark = pytest.mark.multiprocess


def test_sum_numpy_example():
    result = launch(4, 2, str(ROOT / "examples" / "sum_numpy.py"))
    assert result.code == 0, result.output
    assert len(result.lines("[worker")) == 4 and "sum 10 (expected 10), mean 2.50" in result.output


def test_sum_numpy_example_with_colocated_servers_only():
    result = launch(3, 0, str(ROOT / "examples" / "sum_numpy.py"), options=("--colocate",))
    assert result.code == 0, result.output
    assert "starting 0 servers + 3 colocated and 3 workers" in result.output
    assert len(result.lines("[worker")) == 3 and "sum 6 (expected 6), mean 2.00" in result.output


def test_elastic_example_trains():
    options = ("--min-workers", "1", "--max-workers", "2")
    script = str(ROOT / "examples" / "elastic_train.py")
    result = launch(2, 1, script, "--epochs", "3", "--step-seconds", "0", timeout=180, options=options)
    assert result.code == 0, result.output
    summary = result.lines("[worker 0] {")
    assert summary and json.loads(summary[0].split("] ", 1)[1])["accuracy"] > 0.8, result.output


def test_digits_training_example_learns():
    result = launch(2, 1, str(ROOT / "examples" / "digits_train.py"), "--epochs", "3", timeout=180)
    assert result.code == 0, result.output
    line = result.lines("[worker 0] [gradwire] test accuracy")
    assert line and float(line[0].split()[-1]) > 0.5, result.output


def test_workers_started_with_torchrun_variables():
    """torchrun gives RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; the scheduler comes from GRADWIRE_*."""
    marker = uuid.uuid4().hex
    scheduler = Scheduler(Config(role="scheduler", num_workers=2, num_servers=1, timeout=30, secret=marker)).start()
    common = {"GRADWIRE_SCHEDULER": scheduler.address, "GRADWIRE_NUM_SERVERS": "1", "GRADWIRE_SECRET": marker}
    for key in [k for k in os.environ if k.startswith(("GRADWIRE_", "DMLC_"))]:
        common[key] = ""
    env = {k: v for k, v in (os.environ | common).items() if v != ""}
    server = subprocess.Popen([sys.executable, "-m", "gradwire", "server"], env=env | {"WORLD_SIZE": "2"}, cwd=ROOT)
    workers = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "multiprocess" / "job.py"), "ok", marker],
            env=env | {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for r in range(2)
    ]
    try:
        outputs = [w.communicate(timeout=60)[0] for w in workers]
        assert [w.returncode for w in workers] == [0, 0], outputs
        assert "DONE rank 0 of 2" in outputs[0] and "DONE rank 1 of 2" in outputs[1]
        assert server.wait(10) == 0
    finally:
        for proc in [server, *workers]:
            if proc.poll() is None:
                proc.kill()
        scheduler.stop()
    assert not leftover_processes(marker)


@pytest.mark.parametrize("api", ["optimizer", "ddp-hook", "byteps-ddp", "cross-barrier"])
def test_resnet_example_keeps_workers_identical_through_every_api(api):
    script = str(ROOT / "examples" / "resnet_train.py")
    result = launch(2, 2, script, "--api", api, "--epochs", "1", "--samples", "96", timeout=180)
    assert result.code == 0, result.output
    summary = json.loads(result.lines("[worker 0] {")[0].split("] ", 1)[1])
    assert summary["api"] == api and summary["steps"] == summary["identical_after_steps"] == 3, result.output


@pytest.mark.parametrize("moment", ["mid-training", "epoch-end", "shutdown"])
def test_the_elastic_example_survives_a_sigkilled_worker_at_any_moment(moment):
    """The documented scenario (docs/faults.md): worker 2 SIGKILLed mid-training (inside a step, at a commit or
    between), at an epoch's end, or while the job shuts down. The job trains to the failure-free accuracy and the
    launcher exits 0 within seconds of the result; a kill before the end re-forms the job at once and takes in a
    replacement, and no rank crashes after a join (a crash there would leave the job waiting on it)."""
    run = run_once(moment, epochs=16, timeout=150, seed=list(MOMENTS).index(moment))
    assert run.code is not None, f"the job hung (killed after 150 s):\n{run.output}"
    assert run.code == 0 and run.killed_at is not None, run.output
    assert run.accuracy is not None and run.accuracy > 0.9, run.output
    assert run.exit_after is not None and run.exit_after < 10, run.output
    if moment != "shutdown":
        assert run.reformed_after is not None and run.reformed_after < 5, run.output
        assert "starting worker 3 to join the job" in run.output, run.output
    else:
        assert "re-formed" not in run.output, run.output


def _installed(*modules: str) -> None:
    """Skip unless these are installed; found, not imported (JAX starts threads: this process forks later)."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")


def test_jax_digits_example_learns():
    _installed("jax", "optax")
    result = launch(2, 1, str(ROOT / "examples" / "jax_digits_train.py"), "--epochs", "3", timeout=180)
    assert result.code == 0, result.output
    summary = result.lines("[worker 0] {")
    assert summary and json.loads(summary[0].split("] ", 1)[1])["accuracy"] > 0.8, result.output


def test_flax_digits_example_learns():
    _installed("jax", "optax", "flax")
    result = launch(2, 1, str(ROOT / "examples" / "flax_digits_train.py"), "--epochs", "3", timeout=180)
    assert result.code == 0, result.output
    summary = result.lines("[worker 0] {")
    assert summary and json.loads(summary[0].split("] ", 1)[1])["accuracy"] > 0.8, result.output


def test_keras_digits_example_learns_with_every_worker_ending_alike():
    _installed("keras", "tensorflow")
    env = {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = launch(2, 1, str(ROOT / "examples" / "keras_digits_train.py"), "--epochs", "4", timeout=180, env=env)
    assert result.code == 0, result.output
    summary = result.lines("[worker 0] {")
    assert summary and json.loads(summary[0].split("] ", 1)[1])["accuracy"] > 0.8, result.output
    digests = {line.split("weights ")[1] for line in result.output.splitlines() if "] weights " in line}
    assert len(result.lines("[worker 1] weights")) == 1 and len(digests) == 1, result.output
