"""The server's native data path (server/native_path.py, native/cpp/server.hpp): where it applies (gradwire-native
built, deterministic sums, failover by the workers' copies: the defaults) the native loop owns every worker link and
sums the plain keys' rounds; every other key's pushes go to the Python engines through it. Both give the Python path's
bytes, refusals and reports; a job mixing both kinds of keys gives the same bytes as a job on the Python path alone.
(Failover, held keys, joined and departed workers on both paths: tests/faults/test_failover.py, tests/torch's
Horovod suite, test_native_worker.py, which run on the defaults.)"""

from __future__ import annotations

import time

import numpy as np
import pytest

from gradwire.errors import TensorError
from gradwire.protocol import dtypes
from gradwire.server import native_path
from gradwire.testing import LocalCluster


def _data(rank: int, n: int, dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed * 100 + rank)
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal(n) * 10).astype(dtype)
    return rng.integers(-50 if np.dtype(dtype).kind == "i" else 0, 50, n).astype(dtype)


@pytest.fixture(scope="module", params=["tcp", "auto"])
def clusters(gn, request):
    """The Python path's servers and the native path's, over sockets (tcp) and shared memory (auto)."""
    kw = dict(num_workers=3, num_servers=2, partition_bytes=8192, transport=request.param)
    with LocalCluster(datapath="python", **kw) as python, LocalCluster(datapath="auto", **kw) as native:
        assert all(s.state.native is None for s in python.servers)
        assert all(s.state.native is not None for s in native.servers)
        yield python, native


def _both(clusters, job) -> tuple[list, list]:
    python, native = clusters
    return python.run(job), native.run(job)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int32, np.int64, np.int8, np.bool_])
def test_plain_sums_are_the_native_loops_and_give_the_python_paths_bytes(clusters, dtype):
    def job(w):
        return [w.push_pull(_data(w.rank, 7001, dtype, step), f"ns-{np.dtype(dtype).name}") for step in range(3)]

    python, native = _both(clusters, job)
    for a, b in zip(python, native, strict=True):
        assert [x.tobytes() for x in a] == [x.tobytes() for x in b]
    names = {name for s in clusters[1].servers for name in s.state.native.names.values()}
    assert f"ns-{np.dtype(dtype).name}" in names


def test_other_keys_go_to_the_engines_through_the_loop_with_the_python_paths_bytes(clusters):
    """Other reductions, sliced results (reduce-scatter) and a gather are the engines' keys: their pushes come
    through the native loop, their answers go back through it, in order with its own."""

    def job(w):
        out = [w.push_pull(_data(w.rank, 5000, np.float32, 1), "ns-max", op="max")]
        slices = [(0, 3000), (3000, 4000), (7000, 3000)]
        scattered = np.empty(slices[w.rank][1], np.float32)
        w.synchronize(w.reduce_scatter_async(_data(w.rank, 10_000, np.float32, 2), "ns-rs", slices, scattered))
        counts = [1000 * (r + 1) for r in range(3)]
        gathered = np.empty(sum(counts), np.int32)
        w.synchronize(w.gather_async(np.full(counts[w.rank], w.rank, np.int32), "ns-gather", counts, gathered))
        out.append(w.push_pull(_data(w.rank, 5000, np.float32, 3), "ns-plain"))  # and a plain sum between them
        return [*out, scattered, gathered]

    python, native = _both(clusters, job)
    for a, b in zip(python, native, strict=True):
        assert [x.tobytes() for x in a] == [x.tobytes() for x in b]
    servers = clusters[1].servers
    native_names = {name for s in servers for name in s.state.native.names.values()}
    engine_names = {k.name for s in servers for e in s.engines for k in e.keys.values()}
    assert "ns-plain" in native_names and not {"ns-max", "ns-rs", "ns-gather"} & native_names
    assert {"ns-max", "ns-rs", "ns-gather"} <= engine_names and "ns-plain" not in engine_names


def test_the_counters_count_the_loops_rounds_and_bytes(clusters):
    _, native = clusters
    before = [s.metrics.snapshot() for s in native.servers]
    native.run(lambda w: w.push_pull(np.ones(4096, np.float32), "ns-count"))  # 16 KiB: two partitions of 8 KiB
    after = [s.metrics.snapshot() for s in native.servers]
    assert sum(a["rounds"] - b["rounds"] for a, b in zip(after, before, strict=True)) == 2
    assert sum(a["bytes_pushed"] - b["bytes_pushed"] for a, b in zip(after, before, strict=True)) == 3 * 16384
    assert sum(a["bytes_pulled"] - b["bytes_pulled"] for a, b in zip(after, before, strict=True)) == 3 * 16384
    assert all(s.status()["datapath"] == "native" for s in native.servers)


@pytest.mark.parametrize("datapath", ["python", "auto"])
def test_a_round_missing_a_worker_is_reported_by_name_and_rank(gn, datapath):
    with LocalCluster(num_workers=2, num_servers=1, datapath=datapath) as c:
        a, _ = c.workers
        c.run(lambda w: w.declare("ns-stalled", (100,), np.float32))  # every worker declares; one pushes
        handle = a.push_pull_async(np.ones(100, np.float32), "ns-stalled")
        server = c.servers[0]
        deadline = time.monotonic() + 5
        while not (lines := server.stall_report(time.monotonic() + 1000)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(lines) == 1 and "tensor 'ns-stalled'" in lines[0] and "for worker(s) [1]; pushed by [0]" in lines[0]
        c.workers[1].push_pull(np.ones(100, np.float32), "ns-stalled")
        a.synchronize(handle)


@pytest.mark.parametrize("datapath", ["python", "auto"])
def test_a_push_that_does_not_fit_its_key_is_refused_with_the_same_message(gn, datapath):
    """A push claiming another dtype than its key's: the server refuses it (the stream kept in sync), the call fails
    with its message naming the tensor, and the next call goes on."""
    with LocalCluster(num_workers=1, num_servers=1, datapath=datapath, transport="tcp") as c:
        (w,) = c.workers
        data = np.ones(2000, np.float32)
        w.push_pull(data, "ns-fit")
        w.table.tensors["ns-fit"].dtype = dtypes.from_numpy(np.int32)  # what its pushes claim; the server: float32
        with pytest.raises(TensorError, match="8000 bytes of int32 pushed, but the key is 8000 bytes of float32"):
            w.push_pull(data, "ns-fit")
        assert np.array_equal(w.push_pull(data, "ns-after"), data)


def test_where_the_native_server_applies_and_where_it_says_why_not(gn):
    with LocalCluster(num_workers=1, num_servers=1) as c:
        assert c.servers[0].state.native is not None and native_path.why_not(c.servers[0].config) == ""
    with LocalCluster(num_workers=1, num_servers=1, deterministic=False) as c:
        assert c.servers[0].state.native is None
        assert "GRADWIRE_DETERMINISTIC" in native_path.why_not(c.servers[0].config)
    with LocalCluster(num_workers=1, num_servers=1, datapath="python") as c:
        assert native_path.why_not(c.servers[0].config) == "GRADWIRE_DATAPATH=python"
