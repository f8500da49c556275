"""A dead server loses nothing: its keys move (to a standby or the survivors) and every sum is bit-identical.

The reference for "bit-identical" is the sum in rank order computed here with numpy, which is what a server adds in
deterministic mode (the default); a failover must not change a single bit of any round, including rounds the dead
server had answered to some workers and not others.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gradwire.errors import JobAborted
from gradwire.protocol import dtypes
from gradwire.testing import FakeClock, LocalCluster

STEPS = 12
# Both data paths: the Python one, and the native loop (worker/native_path.py)
PATHS = {"python": {"datapath": "python"}, "native": {"datapath": "native"}}


@pytest.fixture(params=list(PATHS))
def path(request) -> dict:
    """The data path's settings for a LocalCluster (the native one's needs gradwire-native)."""
    if request.param == "native":
        request.getfixturevalue("gn")
    return PATHS[request.param]


def _on(cluster: LocalCluster, path: dict) -> None:
    """Every worker moves its bytes on the data path `path` asks for."""
    paths = {w.status()["data_path"]["worker"] for w in cluster.workers}  # "native", or "python (why)"
    assert {p.split()[0] for p in paths} == {path["datapath"]}, paths


SHAPES = {"w0": (3000,), "w1": (64, 40), "b": (7,), "w2": (5000,)}  # 4 KiB partitions: several per tensor


def _gradient(rank: int, step: int, name: str) -> np.ndarray:
    """A worker's gradient: magnitudes far apart, so the order of additions shows in the low bits."""
    seed = rank * 1_000_003 + step * 101 + sum(map(ord, name))
    rng = np.random.default_rng(seed)
    shape = SHAPES[name]
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-5, 6, shape)).astype(np.float32)


def _expected(num_workers: int, average: bool = False) -> dict[tuple[int, str], bytes]:
    out = {}
    for step in range(STEPS):
        for name in SHAPES:
            total = _gradient(0, step, name)
            for rank in range(1, num_workers):
                total += _gradient(rank, step, name)
            if average:
                np.divide(total, num_workers, out=total)
            out[step, name] = total.tobytes()
    return out


def _train(worker, killed: threading.Event | None = None, kill_at: int = -1, average: bool = False):
    """Every step: all tensors in flight at once (in place, as the torch integration does), then wait."""
    sums = {}
    for step in range(STEPS):
        if step == kill_at and killed is not None:
            killed.wait(30)
        arrays = {name: _gradient(worker.rank, step, name) for name in SHAPES}
        handles = [worker.push_pull_async(a, name, out=a, average=average) for name, a in arrays.items()]
        for h in handles:
            worker.synchronize(h)
        sums.update({(step, name): a.tobytes() for name, a in arrays.items()})
    return sums


def _kill_when(cluster: LocalCluster, rank: int, rounds: int, killed: threading.Event) -> threading.Thread:
    server = cluster.servers[rank]

    def kill() -> None:
        deadline = time.monotonic() + 30
        while server.rounds_completed < rounds and time.monotonic() < deadline:
            time.sleep(0.001)
        cluster.kill_server(rank)
        killed.set()

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("standby", [0, 1], ids=["onto-survivors", "to-a-standby"])
def test_a_server_killed_mid_training_changes_no_bit_of_any_sum(standby, path):
    with LocalCluster(num_workers=3, num_servers=3, num_standby=standby, partition_bytes=4096, **path) as c:
        _on(c, path)
        killed = threading.Event()
        killer = _kill_when(c, 1, rounds=20, killed=killed)
        results = c.run(lambda w: _train(w, killed, kill_at=STEPS - 2))
        killer.join()
        expected = _expected(3)
        for rank, sums in enumerate(results):
            assert sums.keys() == expected.keys()
            wrong = [k for k in expected if sums[k] != expected[k]]
            assert not wrong, f"worker {rank}: sums differ from the rank-order sum for {wrong[:5]}"
        (record,) = c.scheduler.failovers
        assert record["server"] == 1 and record["to"] == ("standby" if standby else "survivors")
        assert c.scheduler.epoch == 2
        status = c.scheduler.status()  # /status: healthy again, and the failover on record
        assert status["healthy"] and [f["server"] for f in status["failovers"]] == [1]
        for worker in c.workers:
            assert [f["server"] for f in worker.failovers] == [1]
        if standby:
            assert c.standby[0].rank == 1 and not c.standby[0].standby
        else:
            for worker in c.workers:  # nothing is placed on the dead server any more
                assert all(1 not in t.servers for t in worker.table.tensors.values())


def test_a_hung_replica_is_reported_and_failed_over_not_waited_for():
    """Every key replicated; server 1 (server 0's replica) takes forwarded rounds but never acknowledges them: once
    GRADWIRE_HEARTBEAT_TIMEOUT passes, server 0 reports it lost, the scheduler fails it over as a dead server, and
    every sum is still the rank-order sum, long before the workers' GRADWIRE_TIMEOUT."""
    config = dict(
        partition_bytes=4096, failover_copy_bytes=0, failover_hold=False, heartbeat_interval=0.2, heartbeat_timeout=2.0
    )
    with LocalCluster(num_workers=3, num_servers=3, **config) as c:  # the workers wait 30 s at most
        hung = c.servers[1]
        for engine in hung.engines:  # takes the seed, never acknowledges it
            engine._seed = lambda state, r, slot, dtype, engine=engine: engine._take_seed(state, r, slot, dtype)
        started = time.monotonic()
        results = c.run(_train)
        took = time.monotonic() - started
        expected = _expected(3)
        for rank, sums in enumerate(results):
            wrong = [k for k in expected if sums[k] != expected[k]]
            assert not wrong, f"worker {rank}: sums differ from the rank-order sum for {wrong[:5]}"
        assert [f["server"] for f in c.scheduler.failovers] == [1]
        assert "acknowledged no forwarded round" in c.scheduler.failovers[0]["why"]
        assert took < 20, f"{took:.1f}s: the workers waited on the hung replica"


def _answer_one_then_die(
    cluster: LocalCluster, killed: threading.Event, after: int, sliced: bool = False, victim: int = 0
) -> None:
    """The trap: server `victim` (a Python engine's: the trap is set there) answers its `after`-th round (of a key each
    rank pulls only a slice of, with `sliced`) to worker 0 only, then dies (`killed` is set once it is dead); the other
    workers wait for that round."""
    victim = cluster.servers[victim]
    seen = {"rounds": 0}
    original = victim.outgoing.reply

    def queue_reply(key, rnd, dtype, payload, pulls, ranks, sent=None, flags=0):
        if sliced and not isinstance(payload, list):
            return original(key, rnd, dtype, payload, pulls, ranks, sent, flags)
        seen["rounds"] += 1
        if seen["rounds"] != after:
            return original(key, rnd, dtype, payload, pulls, ranks, sent, flags)
        original(key, rnd, dtype, payload, pulls, ranks & 0b001)  # to worker 0 only, then die
        deadline = time.monotonic() + 5
        while victim.links[0].replies.qsize() and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.05)
        threading.Thread(target=lambda: (cluster.kill_server(victim.rank), killed.set()), daemon=True).start()

    for engine in victim.engines:
        engine.outbox._reply = queue_reply


@pytest.mark.parametrize("copies", ["replica", "worker", "held", "held-averaged"])
def test_a_round_answered_to_some_workers_only_is_completed_from_a_copy(copies, path):
    """The trap: the server dies after sending a round's sum to worker 0 and before the others got it. Worker 0's
    input is gone (summed in place) and it has moved on; the others resend theirs. The round's sum comes from the
    replica server, which had it before anyone was answered (tensors past GRADWIRE_FAILOVER_COPY_BYTES with
    GRADWIRE_FAILOVER_HOLD=0), or from worker 0's copy, which it seeds (those within it), or from worker 0's output,
    which holds the sum, its call unfinished, until every worker has it (past the budget, by default); averaged there,
    it seeds the round averaged, and the others take it as it is: the same bits."""
    budget = 1 << 30 if copies == "worker" else 0
    held, average = copies.startswith("held"), copies.endswith("averaged")
    options = path | {"failover_hold": held}
    # the trap is set in a Python engine (`_answer_one_then_die`): one server's; the other, which completes the round
    # from the copy, runs the job's data path
    with LocalCluster(
        num_workers=3,
        num_servers=2,
        partition_bytes=4096,
        failover_copy_bytes=budget,
        placement="equal",
        server_config={0: {"datapath": "python"}},
        **options,
    ) as c:
        _on(c, path)
        killed = threading.Event()
        victim = next(i for i, s in enumerate(c.servers) if s.state.native is None)
        _answer_one_then_die(c, killed, after=15, victim=victim)
        results = c.run(lambda w: _train(w, killed, kill_at=STEPS - 2, average=average))
        expected = _expected(3, average)
        for rank, sums in enumerate(results):
            wrong = [k for k in expected if sums[k] != expected[k]]
            assert not wrong, f"worker {rank}: sums differ for {wrong[:5]}"
        assert c.servers[1 - victim].seeded_answers >= 2  # workers 1 and 2 got that round's sum from a copy
        seeded = c.scheduler.failovers[0]["seeds"]
        assert (seeded == 0) if copies == "replica" else (seeded >= 1)  # which copy: worker 0 seeded, or none had to
        tensors = [t for w in c.workers for t in w.table.tensors.values()]
        assert all(t.held == held for t in tensors)


def test_with_failover_off_a_dead_server_aborts_the_job_naming_it():
    with LocalCluster(num_workers=2, num_servers=2, server_failover=False, partition_bytes=4096) as c:
        c.run(lambda w: w.push_pull(np.ones(4000, np.float32), "t"))
        c.kill_server(1)
        with pytest.raises(JobAborted, match="server 1"):
            c.run(lambda w: [w.push_pull(np.ones(4000, np.float32), "t") for _ in range(50)])


def test_with_no_server_left_the_job_aborts_naming_the_last_one():
    with LocalCluster(num_workers=2, num_servers=1) as c:
        c.run(lambda w: w.push_pull(np.ones(10, np.float32), "t"))
        c.kill_server(0)
        with pytest.raises(JobAborted, match="server 0"):
            c.run(lambda w: [w.push_pull(np.ones(10, np.float32), "t") for _ in range(50)])


def test_a_silent_server_is_failed_over_after_the_heartbeat_timeout():
    """A hung server (alive, sockets open, silent) is detected by heartbeats (fake clock) and failed over; the job's
    sums go on, exact."""
    clock = FakeClock()
    config = {"heartbeat_interval": 0.02, "heartbeat_timeout": 30, "partition_bytes": 4096}
    with LocalCluster(num_workers=2, num_servers=2, clock=clock, **config) as c:
        first = c.run(lambda w: w.push_pull(np.full(3000, w.rank + 1.0, np.float32), "g")[0])
        c.servers[1].admin._stop.set()  # server 1 hangs: it stops talking, its sockets stay open
        for _ in range(40):
            clock.advance(1)
            time.sleep(0.1)
            if c.scheduler.failovers:
                break
        (record,) = c.scheduler.failovers
        assert record["server"] == 1 and "silent for 3" in record["why"] and not c.scheduler.abort_reason
        after = c.run(lambda w: w.push_pull(np.full(3000, w.rank + 1.0, np.float32), "g")[0])
        assert first == after == [3.0, 3.0]


def test_horovods_collectives_survive_a_server_killed_mid_job(path):
    """allgather (variable rows), broadcast, min and max keep their exact results across a failover: their results
    are whole on every worker, so a round the dead server answered to some workers only is seeded from their copy."""
    from gradwire import collectives

    steps = 10

    def job(worker, killed):
        out = []
        for step in range(steps):
            if step == steps // 2:
                killed.wait(30)
            rows = np.full((worker.rank + 1 + step % 3, 50), worker.rank + step, np.float32)
            gathered = worker.synchronize(collectives.allgather_async(worker, rows, "ag"))
            root = np.arange(900, dtype=np.float64) * (worker.rank + 1) + step
            broadcast = worker.synchronize(collectives.broadcast_async(worker, root, step % 3, "bc"))
            low = worker.synchronize(
                worker.push_pull_async(np.arange(1200, dtype=np.int32) - worker.rank * step, "min", op="min")
            )
            high = worker.synchronize(
                worker.push_pull_async(np.arange(1200, dtype=np.int32) + worker.rank * step, "max", op="max")
            )
            out.append((gathered.copy(), broadcast.copy(), low.copy(), high.copy()))
        return out

    with LocalCluster(num_workers=3, num_servers=3, partition_bytes=1024, **path) as c:
        _on(c, path)
        killed = threading.Event()
        threading.Thread(target=lambda: (time.sleep(0.3), c.kill_server(1), killed.set()), daemon=True).start()
        results = c.run(lambda w: job(w, killed))
        assert c.scheduler.failovers, "the server was not killed during the job"
    for step in range(steps):
        want_rows = np.concatenate([np.full((r + 1 + step % 3, 50), r + step, np.float32) for r in range(3)])
        want_root = np.arange(900, dtype=np.float64) * (step % 3 + 1) + step
        for per_rank in results:
            gathered, broadcast, low, high = per_rank[step]
            assert np.array_equal(gathered, want_rows) and np.array_equal(broadcast, want_root)
            assert np.array_equal(low, np.arange(1200, dtype=np.int32) - 2 * step)
            assert np.array_equal(high, np.arange(1200, dtype=np.int32) + 2 * step)


@pytest.mark.parametrize("copies", ["replica", "worker"])
@pytest.mark.parametrize("collective", ["reducescatter", "alltoall"])
def test_a_sliced_round_answered_to_some_workers_only_is_completed_exactly(collective, copies, path):
    """The trap of the test above, for keys whose ranks each pull only a slice: the replica server holds the whole
    result and answers each rank its slice; with workers' copies, no worker holds the round's sum to seed, so the
    workers the dead server answered replay their contributions, and the others get exact results."""
    from gradwire import collectives

    steps, n = 8, 3

    def data(rank: int, step: int) -> np.ndarray:
        rng = np.random.default_rng(rank * 7919 + step)
        return (rng.standard_normal((3 * n + 1, 40)) * 10.0 ** rng.integers(-4, 5, (3 * n + 1, 40))).astype(np.float32)

    def splits(rank: int, step: int) -> list[int]:
        return [(rank + step + d) % 3 + d for d in range(n)] if collective == "alltoall" else []

    def job(worker):
        out = []
        for step in range(steps):
            x = data(worker.rank, step)
            if collective == "reducescatter":
                got = worker.synchronize(collectives.reducescatter_async(worker, x, "rs"))
            else:
                mine = splits(worker.rank, step)
                handle, _ = collectives.alltoall_async(worker, x[: sum(mine)], mine, "a2a")
                got = worker.synchronize(handle)
            out.append(got.copy())
        return out

    budget = 0 if copies == "replica" else 1 << 30
    # equal placement: server 0 holds its share of the keys whatever the links measure (on a loaded machine the measured
    # placement can leave it too few sliced rounds for the trap to fire)
    with LocalCluster(
        num_workers=n, num_servers=2, partition_bytes=1024, failover_copy_bytes=budget, placement="equal", **path
    ) as c:
        _on(c, path)
        killed = threading.Event()
        _answer_one_then_die(c, killed, after=5, sliced=True)
        results = c.run(job)
        assert killed.is_set() and c.scheduler.failovers, "the trap never fired"
    for step in range(steps):
        for rank, per_rank in enumerate(results):
            if collective == "reducescatter":
                total = (data(0, step) + data(1, step)) + data(2, step)  # the servers' rank order
                rows = collectives.row_split(total.shape[0], n)
                want = total[sum(rows[:rank]) : sum(rows[: rank + 1])]
            else:  # rows each sender sent to `rank`, in sender order
                parts = []
                for sender in range(n):
                    cut = np.cumsum([0] + splits(sender, step))
                    parts.append(data(sender, step)[cut[rank] : cut[rank + 1]])
                want = np.concatenate(parts)
            assert per_rank[step].tobytes() == want.tobytes(), f"worker {rank}, step {step}: wrong {collective}"


WIRE = {"bfloat16": np.uint16}  # carried as its bits
OPS = ["sum", "min", "max", "product", "allgather", "broadcast", "reducescatter", "alltoall"]


def _contribution(name: str, rank: int, step: int, rows: int, cols: int) -> np.ndarray:
    rng = np.random.default_rng(hash((name, rank, step)) % 2**32)
    if name == "bool":
        return rng.integers(0, 2, (rows, cols)).astype(bool)
    if name == "bfloat16":  # the high halves of float32s: exact bfloat16 values
        values = (rng.standard_normal((rows, cols)) * 10.0 ** rng.integers(-3, 4, (rows, cols))).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    dtype = np.dtype(name)
    if dtype.kind == "f":
        return (rng.standard_normal((rows, cols)) * 10.0 ** rng.integers(-3, 4, (rows, cols))).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), (rows, cols)).astype(dtype)


def _widen(name: str, x: np.ndarray) -> np.ndarray:
    if name == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32) if name == "float16" else x.copy()


def _narrow(name: str, acc: np.ndarray) -> np.ndarray:
    if name == "bfloat16":  # round to nearest even
        bits = acc.view(np.uint32)
        return ((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16).astype(np.uint16)
    with np.errstate(over="ignore"):  # a float16 product may overflow to inf, as the servers' narrowing does
        return acc.astype(np.float16) if name == "float16" else acc


@pytest.mark.parametrize(
    "n, copy_bytes, hold",
    [(1, None, True), (2, None, True), (3, None, True), (4, None, True), (3, 0, True), (3, 0, False), (3, None, False)],
    ids=["1", "2", "3", "4", "3-held", "3-replicas", "3-native"],
)
def test_every_op_of_every_dtype_is_exact_across_a_server_failover(n, copy_bytes, hold, request):
    """Each per-key operation (the four reductions, allgather with rows differing by rank, broadcast, reducescatter,
    alltoall with uneven splits) of each dtype gradwire carries, at odd sizes, all in flight at once, step after step,
    while a server is killed: every result is the exact one (reductions in rank order, in the accumulator's
    precision, as the servers add)."""
    from gradwire import collectives

    steps, names = 4, list(dtypes.BY_NAME)

    def shape(k: int, rank: int = 0, step: int = 0) -> tuple[int, int]:
        return (2 * n + 1 + (k + rank + step) % 3, 3 + 2 * (k % 2))

    def alltoall_splits(rank: int, step: int, rows: int) -> list[int]:
        cut = [(rank + step + d) % 2 for d in range(n)]
        cut[-1] += rows - sum(cut)
        return cut

    def job(worker, killed):
        out = {}
        for step in range(steps):
            if step == steps // 2:
                killed.wait(30)
            handles = {}
            for k, name in enumerate(names):
                wire = None if name not in WIRE else name
                for op in OPS:
                    tag = f"{op}.{name}"
                    rows, cols = shape(k, worker.rank if op == "allgather" else 0, step)
                    x = _contribution(name, worker.rank, step, rows, cols)
                    if op in ("sum", "min", "max", "product"):
                        handles[tag] = worker.push_pull_async(x, tag, op=op, dtype=wire)
                    elif op == "allgather":
                        handles[tag] = collectives.allgather_async(worker, x, tag, dtype=wire)
                    elif op == "broadcast":
                        handles[tag] = collectives.broadcast_async(worker, x, (step + k) % n, tag, dtype=wire)
                    elif op == "reducescatter":
                        handles[tag] = collectives.reducescatter_async(worker, x, tag, dtype=wire)
                    else:
                        cut = alltoall_splits(worker.rank, step, rows)
                        handles[tag], _ = collectives.alltoall_async(worker, x, cut, tag, dtype=wire)
            for tag, handle in handles.items():
                out[step, tag] = worker.synchronize(handle).copy()
        return out

    # 0: every sum held in the workers' outputs (or kept by a replica: hold off; sliced and compressed keys always)
    budget = {} if copy_bytes is None else {"failover_copy_bytes": copy_bytes, "failover_hold": hold}
    if copy_bytes is None and not hold:  # the native data path (held keys and copies, kept in its loop)
        request.getfixturevalue("gn")
        budget = PATHS["native"]
    with LocalCluster(num_workers=n, num_servers=3, partition_bytes=256, **budget) as c:
        if "datapath" in budget:
            _on(c, budget)
        killed = threading.Event()
        killer = _kill_when(c, 1, rounds=25, killed=killed)
        results = c.run(lambda w: job(w, killed))
        killer.join()
        assert c.scheduler.failovers, "the server was not killed during the job"
    for step in range(steps):
        for k, name in enumerate(names):
            rows, cols = shape(k, 0, step)
            xs = [_contribution(name, r, step, rows, cols) for r in range(n)]
            reduced = {}
            for op, ufunc in (("sum", np.add), ("min", np.minimum), ("max", np.maximum), ("product", np.multiply)):
                acc = _widen(name, xs[0])
                for x in xs[1:]:
                    ufunc(acc, _widen(name, x), out=acc, casting="unsafe")
                reduced[op] = _narrow(name, acc)
            gathered = np.concatenate([_contribution(name, r, step, *shape(k, r, step)) for r in range(n)])
            split = np.cumsum([0] + collectives.row_split(rows, n))
            for rank in range(n):
                cuts = [np.cumsum([0] + alltoall_splits(r, step, rows)) for r in range(n)]
                want = dict(reduced)
                want["allgather"] = gathered
                want["broadcast"] = xs[(step + k) % n]
                want["reducescatter"] = reduced["sum"][split[rank] : split[rank + 1]]
                want["alltoall"] = np.concatenate([xs[r][cuts[r][rank] : cuts[r][rank + 1]] for r in range(n)])
                for op in OPS:
                    got = results[rank][step, f"{op}.{name}"]
                    assert got.dtype == want[op].dtype and got.shape == want[op].shape, (op, name, step, rank)
                    assert got.tobytes() == want[op].tobytes(), f"worker {rank}, step {step}: {op} of {name} differs"


def test_the_data_path_settings_are_re_derived_after_a_failover():
    """Two workers and two servers on equal 100 Mbit/s links: the servers keep up, so no cap on unanswered
    partitions. Once one server is gone, the servers' links together are slower than the workers' (fan-in): the
    scheduler re-derives the settings, and every worker's links take the cap (gradwire/tuning.py)."""
    with LocalCluster(num_workers=2, num_servers=2, link_rate="100mbit") as c:
        for i, node in enumerate(c.scheduler.roster.workers):  # as if each worker had its own host (they share one)
            node.host_id = f"host{i}"
        c.run(lambda w: w.push_pull(np.ones(3000, np.float32), "g"))
        assert all(w.tuning.unanswered == 0 for w in c.workers)
        c.kill_server(1)
        sums = c.run(lambda w: [w.push_pull(np.ones(3000, np.float32), "g")[0] for _ in range(3)])
        assert sums == [[2.0] * 3] * 2
        assert c.scheduler.tuning.unanswered == 4 and "server 1 lost" in c.scheduler.tuning.derived_for
        for worker in c.workers:
            assert worker.tuning.unanswered == 4
            assert worker.status()["data_path"]["derived_again"] == "server 1 lost"  # /status says why
            assert all(link.unanswered_cap == 4 for link in worker.links if hasattr(link, "unanswered_cap"))
