"""gradwire.tensorflow's and gradwire.keras's cases, each in a pytest process of its own: TensorFlow and JAX start
threads at import (a later fork here, as Ray's tests make, may deadlock), and Keras reads its backend once, at import:
tf_cases.py on TensorFlow, keras_cases.py on JAX and on PyTorch."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cases(file: str, env: dict[str, str]) -> None:
    cases = str(Path(__file__).with_name(file))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", cases]
    result = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, env=os.environ | env | {"TF_CPP_MIN_LOG_LEVEL": "2"}
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout, result.stdout[-3000:]


def _needs(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]  # found, not imported
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (the [tensorflow] or [keras] extra)")


@pytest.mark.timeout(300)
def test_gradwire_tensorflow_and_keras_on_tensorflow():
    _needs("tensorflow", "keras")
    _cases("tf_cases.py", {"KERAS_BACKEND": "tensorflow"})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_gradwire_keras_on_another_backend(backend):
    _needs("keras", backend)
    _cases("keras_cases.py", {"KERAS_BACKEND": backend})


@pytest.mark.timeout(200)
def test_the_keras_training_benchmark_runs_through_gradwire():
    """bench/train_keras.py's gradwire way (`gradwire bench --netem --train --keras` times it against MWMS): rank 0
    prints its step times, and the job ends cleanly."""
    _needs("tensorflow", "keras")
    cmd = [sys.executable, "-m", "gradwire", "launch", "-n", "2", "-s", "1", "--timeout", "30", "--"]
    cmd += [sys.executable, "-m", "gradwire.bench.train_keras", "keras", "2", "1"]
    env = os.environ | {"TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    rows = [line.split("] ", 1)[1] for line in result.stdout.splitlines() if line.startswith("[worker 0] {")]
    assert len(rows) == 1, result.stdout[-4000:]
    row = json.loads(rows[0])
    assert row["way"] == "keras" and len(row["times"]) == 2 and row["samples_per_step"] == 64
    assert row["parameters"] == 3_764_362  # the model of bench/train.py, in Keras
