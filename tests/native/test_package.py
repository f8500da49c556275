"""gradwire-native as a package: its version is gradwire's, gradwire says why it does not use it, and its wheel
installs and runs a job where no compiler is."""

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import types
from pathlib import Path

import pytest

import gradwire
from gradwire import native

ROOT = Path(__file__).resolve().parents[2]


def test_the_versions_are_one():
    gradwire_version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    native_version = tomllib.loads((ROOT / "native" / "pyproject.toml").read_text())["project"]["version"]
    init = (ROOT / "native" / "src" / "gradwire_native" / "__init__.py").read_text()
    assert gradwire.__version__ == gradwire_version == native_version
    assert f'__version__ = "{native_version}"' in init


def test_make_test_runs_with_the_extension():
    """`make test` builds and installs gradwire-native first (GRADWIRE_EXPECT_NATIVE=1): its absence is a failure
    there, not a skipped suite."""
    if os.environ.get("GRADWIRE_EXPECT_NATIVE") != "1":
        pytest.skip("not under `make test`")
    assert native.load().module is not None, native.load().reason


def test_another_version_is_not_used(monkeypatch):
    monkeypatch.setitem(sys.modules, "gradwire_native", types.SimpleNamespace(__version__="0.0.1"))
    native.load.cache_clear()
    try:
        loaded = native.load()
        assert loaded.module is None and "0.0.1 does not match gradwire" in loaded.reason
        with pytest.raises(RuntimeError, match="does not match"):
            native.require()
    finally:
        native.load.cache_clear()


def test_an_absent_extension_says_how_to_add_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "gradwire_native", None)  # an import of it raises ImportError
    native.load.cache_clear()
    try:
        loaded = native.load()
        assert loaded.module is None and "pip install 'gradwire[native]'" in loaded.reason
    finally:
        native.load.cache_clear()


def test_the_wheel_installs_and_runs_a_job_without_a_compiler(gn, tmp_path):
    """`pip wheel native/` (with the build backend make install put in .venv), then the wheel alone into a fresh
    virtual environment whose PATH has no compiler, and a job of the native floor from there."""
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)]
    subprocess.run([*build, str(ROOT / "native")], check=True, timeout=600)
    (wheel,) = wheels.glob("gradwire_native-*.whl")
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True, timeout=120)
    bare = {"PATH": str(fresh / "bin"), "HOME": str(tmp_path), "CC": "/bin/false", "CXX": "/bin/false"}
    assert shutil.which("c++", path=bare["PATH"]) is None and shutil.which("gcc", path=bare["PATH"]) is None
    fresh_python = fresh / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(fresh_python), "install", "--no-deps", "--no-index", "-q"]
    subprocess.run([*install, str(wheel)], check=True, timeout=300, env=os.environ | bare)
    # numpy from this environment, gradwire and the lab's benchmarks (the floor) from this tree; gradwire_native only
    # from the fresh one's site-packages
    (site,) = (fresh / "lib").glob("python3*/site-packages")
    numpy_dir = Path(__import__("numpy").__file__).parents[1]
    (site / "deps.pth").write_text(f"{ROOT / 'src'}\n{ROOT}\n{numpy_dir}\n")
    assert Path(sysconfig.get_paths()["purelib"]) != site
    job = (
        "import gradwire_native, sys; from gradwire import native; from benchmarks import floor;"
        f"assert gradwire_native.__file__.startswith({str(site)!r}), gradwire_native.__file__;"
        "assert native.load().module is gradwire_native, native.load().reason;"
        "row = floor.measure_job(2, 2, 32768, 1 << 20, 2, 1, 'native'); print(row['seconds_per_call'] > 0)"
    )
    done = subprocess.run(
        [str(fresh_python), "-c", job], env=bare, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def test_the_sanitized_build_is_the_one_tested(gn):
    """Under `make sanitize` (GRADWIRE_SANITIZED=1) the extension is the ASan + UBSan build, not the installed one."""
    if os.environ.get("GRADWIRE_SANITIZED") != "1":
        pytest.skip("not under `make sanitize`")
    assert "build/sanitize/pkg" in gn.__file__ and "libasan" in os.environ.get("LD_PRELOAD", "")
