"""GRADWIRE_DATAPATH: the same job on the Python and on the native data path gives the same bytes, and a path that
cannot be had is said so (an error where it was asked for, an info line where `auto` falls back)."""

import logging

import numpy as np
import pytest

from gradwire import ConfigError, native
from gradwire.testing import LocalCluster

# (wire dtype name, numpy dtype of the array pushed): every dtype a server sums
DTYPES = [
    ("float16", np.float16),
    ("bfloat16", np.uint16),
    ("float32", np.float32),
    ("float64", np.float64),
    ("int32", np.int32),
    ("int64", np.int64),
    ("uint8", np.uint8),
    ("int8", np.int8),
    ("int16", np.int16),
    ("bool", np.bool_),
]


def _contribution(rank: int, name: str, dtype: type, n: int) -> np.ndarray:
    rng = np.random.default_rng(rank)
    if name == "bfloat16":  # bfloat16 bits: the high half of ordinary float32s
        return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal(n) * 100).astype(dtype)
    if dtype is np.bool_:
        return rng.integers(0, 2, n).astype(bool)
    return rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)  # wraps


def _sums(datapath: str) -> tuple[str, dict[str, bytes]]:
    """Every dtype's sum (three workers, two servers, keys of several partitions) on one data path."""
    with LocalCluster(num_workers=3, num_servers=2, partition_bytes=4096, datapath=datapath) as c:
        sums = c.servers[0].sums.name

        def job(w):
            handles = {  # bfloat16 travels as uint16 bits named by the wire dtype
                name: w.push_pull_async(_contribution(w.rank, name, dt, 10_001), f"dp-{name}", dtype=name)
                for name, dt in DTYPES
            }
            return {name: w.synchronize(h).tobytes() for name, h in handles.items()}

        results = c.run(job)
    assert all(r == results[0] for r in results[1:])  # every worker has the same bytes
    return sums, results[0]


def test_both_data_paths_give_the_same_bytes_for_every_dtype():
    if native.load().module is None:
        pytest.skip(native.load().reason)
    python_name, python = _sums("python")
    native_name, on_native = _sums("native")
    assert (python_name, native_name) == ("python", "native")
    for name, _ in DTYPES:
        assert on_native[name] == python[name], name


def test_auto_is_native_where_it_is_installed():
    expected = "python" if native.load().module is None else "native"
    with LocalCluster(num_workers=1, num_servers=1) as c:
        assert c.config.datapath == "auto" and c.servers[0].sums.name == expected


def test_native_asked_for_and_missing_is_an_error_saying_why(monkeypatch):
    monkeypatch.setattr(native, "load", lambda: native.Native(None, "gradwire-native is not installed (a test)"))
    with pytest.raises(ConfigError, match="GRADWIRE_DATAPATH=native, but gradwire-native is not installed"):
        native.for_datapath("native")


def test_auto_without_the_extension_says_why_once(monkeypatch, caplog):
    monkeypatch.setattr(native, "load", lambda: native.Native(None, "gradwire-native 9.9 does not match (a test)"))
    native._say_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="gradwire.native"):
        assert native.for_datapath("auto") is None
        assert native.for_datapath("auto") is None
    said = [r.getMessage() for r in caplog.records if r.name == "gradwire.native"]
    assert said == ["the Python data path: gradwire-native 9.9 does not match (a test)"]
    native._say_once.cache_clear()


def test_an_unknown_data_path_is_refused():
    with pytest.raises(ConfigError, match="GRADWIRE_DATAPATH must be auto, native or python"):
        LocalCluster(num_workers=1, num_servers=1, datapath="fast")


def test_each_key_adds_with_its_dtypes_sums_chosen_once():
    """Native kernels for float16 and bfloat16 keys, numpy's loop for the rest (faster there), chosen at declaration."""
    if native.load().module is None:
        pytest.skip(native.load().reason)
    # sums not in rank order keep the servers' rounds Python's (server/native_path.py): the engines' sums are the test's
    with LocalCluster(num_workers=2, num_servers=1, datapath="native", deterministic=False) as c:
        assert c.servers[0].state.native is None
        for name, dt in DTYPES:
            pushed = lambda w, name=name, dt=dt: _contribution(w.rank, name, dt, 100)  # noqa: E731
            c.run(
                lambda w, name=name, pushed=pushed: w.synchronize(w.push_pull_async(pushed(w), f"k-{name}", dtype=name))
            )
        chosen = {s.dtype.name: s.sums.name for e in c.servers[0].engines for s in e.keys.values()}
    assert chosen == {name: "native" if name in ("float16", "bfloat16") else "python" for name, _ in DTYPES}
