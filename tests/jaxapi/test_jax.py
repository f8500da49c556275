"""gradwire.jax's cases (jax_cases.py), in a pytest process of their own so that JAX never runs in this one (it starts
threads at import; a later fork here, as Ray's tests make, may deadlock)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_gradwire_jax_cases():
    if not all(importlib.util.find_spec(m) for m in ("jax", "optax")):  # found, not imported
        pytest.skip("jax and optax are not installed (the [jax] extra)")
    cases = str(Path(__file__).with_name("jax_cases.py"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", cases]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout, result.stdout[-3000:]
