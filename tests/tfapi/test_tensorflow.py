"""gradwire.tensorflow's and gradwire.keras's cases, each in a pytest process of its own: TensorFlow and JAX start
threads at import (a later fork here, as Ray's tests make, may deadlock), and Keras reads its backend once, at import:
tf_cases.py on TensorFlow, keras_cases.py on JAX and on PyTorch."""

import importlib.util
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
