"""The worker's native data path (worker/native_path.py): where it applies (server failover off, gradwire-native
built) a worker's links are the native loop's for their life, sockets and shared memory alike, and every kind of call
gives the Python path's bytes: sums and averages of every dtype, the other reductions, in place, reduce-scatter,
gather and broadcast, compressed sums (a Python step per partition), a server-side optimizer's updates (a trailer per
push). A server's refusal, a lost server and a shutdown fail calls as the Python path fails them; nothing hangs."""

from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np
import pytest

import gradwire
from gradwire import compression
from gradwire.errors import JobAborted, TensorError
from gradwire.testing import LocalCluster
from gradwire.worker import native_path

PATHS = ["python", "native"]


def _cluster(path: str, **kw) -> LocalCluster:
    """A job whose workers' links are sockets and whose failover is off: the native path applies unless `path` is
    python (GRADWIRE_DATAPATH=python)."""
    options = dict(num_workers=3, num_servers=2, partition_bytes=4096, transport="tcp", server_failover=False)
    options.update(kw)
    return LocalCluster(datapath="python" if path == "python" else "auto", **options)


@pytest.fixture(scope="module", params=["tcp", "auto"])
def clusters(gn, request):
    """Both paths, over sockets (tcp) and through shared memory (auto: every node on this host)."""
    transport = request.param
    with (
        _cluster("python", transport=transport) as python,
        _cluster("native", transport=transport, window=2, unanswered=1) as native,
    ):
        shared = [link.arena is not None for c in (python, native) for w in c.workers for link in w.links]
        assert all(shared) if transport == "auto" else not any(shared)
        assert all(w.state.native is None for w in python.workers)
        assert all(w.state.native is not None for w in native.workers)
        yield {"python": python, "native": native}


def _both(clusters, job) -> tuple[list, list]:
    return clusters["python"].run(job), clusters["native"].run(job)


def _data(rank: int, n: int, dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed * 100 + rank)
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal(n) * 10).astype(dtype)
    return rng.integers(-50 if np.dtype(dtype).kind == "i" else 0, 50, n).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int32, np.int64, np.uint8])
@pytest.mark.parametrize("average", [False, True])
def test_sums_and_averages_are_the_python_paths_bytes(clusters, dtype, average):
    name = f"nw-{np.dtype(dtype).name}-{average}"

    def job(w):
        return [w.push_pull(_data(w.rank, n, dtype, n), f"{name}-{n}", average=average) for n in (1, 1023, 20_001)]

    python, native = _both(clusters, job)
    for a, b in zip(python, native, strict=True):
        assert [x.tobytes() for x in a] == [x.tobytes() for x in b]


def test_bfloat16_other_reductions_and_in_place_are_the_python_paths_bytes(clusters):
    def job(w):
        bits = (_data(w.rank, 5000, np.float32, 3).view(np.uint32) >> 16).astype(np.uint16)
        out = [w.synchronize(w.push_pull_async(bits, "nw-bf16", dtype="bfloat16", average=True))]
        out += [w.push_pull(_data(w.rank, 3000, np.float32, 4), f"nw-{op}", op=op) for op in ("min", "max", "product")]
        inplace = _data(w.rank, 9000, np.float64, 5)
        w.push_pull_inplace(inplace, "nw-inplace", average=True)
        return [*out, inplace]

    python, native = _both(clusters, job)
    for a, b in zip(python, native, strict=True):
        assert [x.tobytes() for x in a] == [x.tobytes() for x in b]


def test_reduce_scatter_gather_and_broadcast_are_the_python_paths_bytes(clusters):
    def job(w):
        n = 10_000
        slices = [(0, 3000), (3000, 4000), (7000, 3000)]
        scattered = np.empty(slices[w.rank][1], np.float32)
        w.synchronize(w.reduce_scatter_async(_data(w.rank, n, np.float32, 6), "nw-rs", slices, scattered))
        counts = [1000 * (r + 1) for r in range(3)]
        gathered = np.empty(sum(counts), np.int32)
        mine = np.full(counts[w.rank], w.rank + 1, np.int32)
        w.synchronize(w.gather_async(mine, "nw-gather", counts, gathered))
        with gradwire.use_worker(w):
            root = _data(0, 7000, np.float32, 7) if w.rank == 0 else np.zeros(7000, np.float32)
            broadcast = gradwire.broadcast(root, 0, "nw-broadcast")
        return scattered, gathered, broadcast

    python, native = _both(clusters, job)
    for a, b in zip(python, native, strict=True):
        assert [x.tobytes() for x in a] == [x.tobytes() for x in b]
    assert np.array_equal(native[2][1], np.repeat(np.arange(1, 4, dtype=np.int32), [1000, 2000, 3000]))


@pytest.mark.parametrize("method", ["onebit", "topk", "dithering"])
def test_compressed_sums_are_the_python_paths_bytes(clusters, method):
    comp = {"onebit": compression.onebit(), "topk": compression.topk(0.05), "dithering": compression.dithering()}

    def job(w):
        return [
            w.push_pull(_data(w.rank, 60_000, np.float32, step), f"nw-{method}", average=True, compression=comp[method])
            for step in range(3)
        ]

    python, native = _both(clusters, job)
    for a, b in zip(python, native, strict=True):
        assert [x.tobytes() for x in a] == [x.tobytes() for x in b]


@pytest.mark.parametrize("pacing", [0, 1])
def test_paced_links_give_the_python_paths_bytes(gn, pacing):
    """Three servers, every link paced against the others by its placement share with a lead of one partition (the
    tightest GRADWIRE_PACING): the native loop's pacing turns and give-ups end in the Python path's bytes."""
    sizes = [10, 5000, 20_000, 3, 70_000]

    def job(w):
        handles = [w.push_pull_async(_data(w.rank, n, np.float32, n), f"paced-{n}") for n in sizes]
        return [w.synchronize(h).tobytes() for h in handles]

    results = {}
    for path in PATHS:
        with _cluster(path, num_servers=3, window=2, unanswered=2, pacing=pacing) as c:
            assert all((w.state.native is not None) == (path == "native") for w in c.workers)
            if pacing:
                assert all(w.credit.share(s) > 0 for w in c.workers for s in range(3))
            results[path] = c.run(job)
    assert results["python"] == results["native"]


def test_a_server_side_optimizers_updates_are_the_python_paths_bytes(clusters):
    def job(w):
        with gradwire.use_worker(w):
            gradwire.set_optimizer("adam", lr=1e-2)
            p = gradwire.init_parameter("nw-param", _data(w.rank, 3000, np.float32, 8))
            for step in range(4):
                p = gradwire.update("nw-param", _data(w.rank, 3000, np.float32, 10 + step), out=p)
            return p

    python, native = _both(clusters, job)
    assert [p.tobytes() for p in python] == [p.tobytes() for p in native]


@pytest.mark.parametrize("path", PATHS)
def test_a_servers_refusal_is_the_python_paths_tensor_error(gn, path):
    """A round that needs a worker that left is refused by the servers: the call fails with the servers' message (the
    tensor, the worker, the round) as a TensorError, at once, on both paths."""
    with _cluster(path, num_workers=2) as c:
        a, b = c.workers
        assert (a.state.native is not None) == (path == "native")
        x = np.ones(100_000, np.float32)
        c.run(lambda w: w.push_pull(x, "g"))
        b.shutdown(final=False)
        with pytest.raises(TensorError, match=r"server \d refused 'g'.*worker 1 left the job .* round 2 of 'g'"):
            a.push_pull(x, "g")
        b.leave()


def test_where_the_native_path_applies_and_where_it_says_why_not(gn):
    with LocalCluster(num_workers=2, num_servers=1, transport="tcp") as c:  # the defaults: failover on, keys held
        assert all(w.state.native is not None for w in c.workers)
        assert c.workers[0].status()["data_path"]["worker"] == "native"
    with LocalCluster(num_workers=2, num_servers=1, server_failover=False, datapath="python") as c:
        assert all(w.state.native is None for w in c.workers)
        assert native_path.why_not(c.workers[0].state, c.workers[0].state.links) == "GRADWIRE_DATAPATH=python"
    with LocalCluster(num_workers=2, num_servers=1, server_failover=False) as c:  # one host: shared memory too
        assert all(w.state.native is not None for w in c.workers)
        assert c.workers[0].status()["data_path"]["worker"] == "native"


def _partitions(path) -> dict[str, set]:
    """A timeline file's partition events: per stage, (tensor, key, round, bytes, track) of each."""
    events = json.loads(path.read_text())["traceEvents"]
    stages: dict[str, set] = {}
    for e in events:
        if e["ph"] == "X":
            a = e["args"]
            stages.setdefault(e["name"], set()).add((a["tensor"], a["key"], a["round"], a["bytes"], e["tid"]))
            assert e["dur"] >= 0 and abs(e["ts"] / 1e6 - time.time()) < 60
    assert any(e["ph"] == "C" and e["name"] == "bytes in flight" for e in events)
    return stages


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_timeline_has_the_same_partition_events_on_both_paths(gn, tmp_path, transport):
    """GRADWIRE_TIMELINE at the start: the native loop keeps each answered partition's four stages, and the timeline
    gets the events the Python path writes for the same calls (every partition, stage and round, each on its
    server's track)."""
    found = {}
    for path in PATHS:
        template = str(tmp_path / f"{path}-{{rank}}.json")
        with _cluster(path, num_workers=2, transport=transport, timeline=template) as c:
            assert all((w.state.native is None) == (path == "python") for w in c.workers)
            for _ in range(2):  # two rounds of each key
                c.run(lambda w: [w.push_pull(np.ones(10_000 + 3000 * i, np.float32), f"tl{i}") for i in range(3)])
            found[path] = []
            for w in c.workers:
                w.stop_timeline()
                stages = _partitions(tmp_path / f"{path}-{w.rank}.json")
                for events in stages.values():  # each on its key's server's track (placement differs by job)
                    assert {(key, tid) for _, key, _, _, tid in events} <= {
                        (f"{key:016x}", server) for key, server in w.table.owner.items()
                    }
                found[path].append({name: {e[:4] for e in events} for name, events in stages.items()})
    assert found["native"] == found["python"]
    stages = found["native"][0]
    assert set(stages) == {"queued", "push", "wait", "pull"} and {p[2] for p in stages["push"]} == {1, 2}
    assert len(stages["push"]) == sum(2 * -(-(10_000 + 3000 * i) * 4 // 4096) for i in range(3))


def test_a_timeline_started_on_a_native_worker_gets_its_partitions_until_stopped(gn, tmp_path):
    with _cluster("native", num_workers=2) as c:
        c.run(lambda w: w.push_pull(np.ones(10_000, np.float32), "tl-before"))
        for w in c.workers:
            w.start_timeline(str(tmp_path / "later-{rank}.json"))
        c.run(lambda w: w.push_pull(np.ones(10_000, np.float32), "tl-during"))
        for w in c.workers:
            w.stop_timeline()
        c.run(lambda w: w.push_pull(np.ones(10_000, np.float32), "tl-after"))
        assert all(w.state.native is not None for w in c.workers)
        for rank in range(2):
            stages = _partitions(tmp_path / f"later-{rank}.json")
            assert {p[0] for events in stages.values() for p in events} == {"tl-during"}
            assert len(stages["pull"]) == -(-10_000 * 4 // 4096)


def test_a_lost_server_fails_the_calls_in_flight_naming_it_and_nothing_hangs(gn):
    with _cluster("native", num_workers=2) as c:
        c.run(lambda w: w.push_pull(np.ones(100_000, np.float32), "nw-warm"))
        started = threading.Barrier(2)

        def job(w):
            handle = w.push_pull_async(np.ones(100_000, np.float32), "nw-lost") if w.rank == 0 else None
            started.wait()
            if w.rank == 1:
                c.servers[1].stop()
                return None
            with pytest.raises(JobAborted) as lost:
                w.synchronize(handle)
            return str(lost.value)

        messages = c.run(job)
        assert "lost server 1" in messages[0]


@pytest.mark.parametrize("path", PATHS)
def test_a_shutdown_fails_calls_in_flight(gn, path, caplog):
    caplog.set_level(logging.INFO, logger="gradwire.worker")
    with _cluster(path, num_workers=2) as c:
        assert ("the native data path" in caplog.text) == (path == "native")
        c.run(lambda w: w.push_pull(np.ones(50_000, np.float32), "nw-cut"))
        worker = c.workers[0]
        handle = worker.push_pull_async(np.ones(50_000, np.float32), "nw-cut")  # worker 1 never pushes round 2
        worker.shutdown()
        with pytest.raises(JobAborted, match="shut down"):
            handle.wait(10)


@pytest.mark.parametrize("path", PATHS)
def test_the_metrics_count_every_partition_and_byte_alike(gn, path):
    """/metrics on both paths: the bytes pushed and pulled, the rounds, and every partition in each stage of the stage
    histogram (the native loop times them and the worker adds them in)."""
    pytest.importorskip("prometheus_client")
    with _cluster(path, num_workers=2) as c:
        c.run(lambda w: [w.push_pull(np.ones(10_000, np.float32), f"m{i}") for i in range(3)])
        worker = c.workers[0]
        parts = sum(len(worker.table.tensors[f"m{i}"].parts) for i in range(3))
        snapshot = worker.state.metrics.snapshot()
        assert snapshot["bytes_pushed"] == snapshot["bytes_pulled"] == 3 * 40_000
        assert snapshot["rounds"] == 3
        _, _, text = worker.state.metrics.exposition()
        for stage in ("queued", "push", "wait", "pull"):
            line = f'gradwire_partition_stage_seconds_count{{stage="{stage}"}} {float(parts)}'
            assert line in text.decode(), (stage, text.decode())
