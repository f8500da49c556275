"""Behaviour of a whole job, with every role as threads of this process over real loopback TCP."""

import socket
import threading
import time

import numpy as np
import pytest

import gradwire
from gradwire import TensorError, TensorMismatch
from gradwire.protocol import frames
from gradwire.protocol.frames import FrameType
from gradwire.scheduler.departures import DEPARTED_GRACE_SECONDS
from gradwire.testing import LocalCluster

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]


def _data(rank, n, dtype, seed=0):
    rng = np.random.default_rng(seed * 1000 + rank)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


def _expected(size, n, dtype, seed=0):
    acc = np.float64 if np.dtype(dtype).kind == "f" else dtype
    return sum(_data(r, n, dtype, seed).astype(acc) for r in range(size))


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_workers=3, num_servers=2, partition_bytes=4096, ring_slots=4) as c:
        yield c


@pytest.fixture
def pair():
    """Two workers and one server of the test's own: the tests that end a worker, fail a declaration or hold a barrier
    leave a cluster no other test may share."""
    with LocalCluster(num_workers=2, num_servers=1) as c:
        yield c


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1023, 1024, 1025, 50_001])
def test_sums_of_every_dtype_and_odd_sizes(cluster, dtype, n):
    name = f"t-{np.dtype(dtype).name}-{n}"
    results = cluster.run(lambda w: w.push_pull(_data(w.rank, n, dtype), name))
    expected = _expected(3, n, dtype)
    for r in results:
        assert r.dtype == dtype and r.shape == (n,)
        if np.dtype(dtype).kind == "f":
            rtol = 2e-3 if dtype == np.float16 else 1e-5
            np.testing.assert_allclose(r.astype(np.float64), expected, rtol=rtol, atol=rtol)
        else:
            np.testing.assert_array_equal(r, expected)
    for r in results[1:]:  # every worker receives the same bytes
        assert r.tobytes() == results[0].tobytes()


def test_float16_is_summed_in_float32(cluster):
    # in float16, 2048 + 1 rounds back to 2048, so summing in half precision would lose every 1
    base = lambda w: np.array([2048.0 if w.rank == 0 else 1.0] * 5, np.float16)  # noqa: E731
    results = cluster.run(lambda w: w.push_pull(base(w), "f16-precision"))
    assert results[0][0] == np.float16(2050.0)  # 2050 exactly: 2048 + 1 + 1


def test_average_and_in_place(cluster):
    def job(w):
        a = np.full((4, 5), float(w.rank), np.float32)
        out = w.push_pull_inplace(a, "avg", average=True)
        assert out is a
        return a

    for r in cluster.run(job):
        np.testing.assert_allclose(r, np.full((4, 5), 1.0))  # mean of 0, 1, 2


def test_many_tensors_in_flight_through_async_handles(cluster):
    shapes = [(i * 97 + 1,) for i in range(40)]

    def job(w):
        handles = [
            w.push_pull_async(np.full(s, w.rank + i, np.float64), f"many-{i}", priority=i % 3)
            for i, s in enumerate(shapes)
        ]
        return [w.synchronize(h) for h in handles]

    for results in cluster.run(job):
        for i, r in enumerate(results):
            assert np.all(r == sum(rank + i for rank in range(3)))


def test_hundreds_of_rounds_stay_correct_and_bit_identical(cluster):
    def job(w):
        out = []
        for step in range(300):
            g = _data(w.rank, 3000, np.float32, seed=step)
            out.append(w.push_pull(g, "rounds").tobytes())
        return out

    results = cluster.run(job)
    assert results[0] == results[1] == results[2]
    last = np.frombuffer(results[0][-1], np.float32)
    np.testing.assert_allclose(last, _expected(3, 3000, np.float32, seed=299), rtol=1e-5, atol=1e-5)


def test_poll_does_not_block_and_turns_true(cluster):
    started = threading.Barrier(3)

    def job(w):
        started.wait()
        h = w.push_pull_async(np.ones(100, np.float32), "poll")
        w.synchronize(h)
        return h.done()

    assert cluster.run(job) == [True, True, True]


def test_a_second_push_pull_of_a_busy_name_is_refused(cluster):
    w = cluster.workers[0]
    w.push_pull_async(np.ones(10, np.float32), "busy")
    with pytest.raises(TensorError, match="already in flight"):
        w.push_pull_async(np.ones(10, np.float32), "busy")
    # let the others complete the round so the module's cluster stays usable
    cluster.run(lambda x: x.push_pull(np.ones(10, np.float32), "busy") if x.rank else None)


def test_a_name_used_again_with_another_shape_is_a_new_tensor(cluster):
    def job(w):
        first = w.push_pull(np.full(3, w.rank + 1.0, np.float32), "reshaped")
        second = w.push_pull(np.full(4, w.rank + 1.0, np.float64), "reshaped")
        again = w.push_pull(np.full(3, 2.0 * (w.rank + 1), np.float32), "reshaped")  # the first one, round 2
        return first.tolist(), second.tolist(), again.tolist(), sorted(n for n in w.table.tensors if "reshaped" in n)

    for first, second, again, names in cluster.run(job):
        assert first == [6.0] * 3 and second == [6.0] * 4 and again == [12.0] * 3
        assert names == ["reshaped", "reshaped#1"]


def test_a_malformed_frame_closes_only_that_connection(cluster):
    server = cluster.servers[0]
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as rogue:
        rogue.sendall(b"\x00" * frames.HEADER_SIZE)  # bad magic, before any handshake
        assert rogue.recv(1 << 16)  # the server's HELLO ...
        rogue.settimeout(5)
        while rogue.recv(1 << 16):  # ... then it closes on us
            pass
    results = cluster.run(lambda w: w.push_pull(np.full(5000, 1.0, np.float32), "after-rogue"))
    assert all(np.all(r == 3.0) for r in results)


def test_a_worker_pushing_the_wrong_size_gets_an_error_for_that_tensor(pair):
    good, bad = pair.workers
    pair.run(lambda w: w.declare("t", (8,), np.float32))  # a declaration completes once every worker made it
    key = bad.table.tensors["t"].keys[0]
    good_handle = good.push_pull_async(np.ones(8, np.float32), "t")
    # below the worker API's checks: round 1 well-formed, round 2 with 16 bytes for an 8-element key.
    # One send, because the bad worker's own link rightly drops the connection on replies it never asked for.
    fields = dict(dtype=2, epoch=bad.epoch, sender=bad.rank, key=key)
    bad.links[0].conn.send(
        [
            frames.encode_header(FrameType.PUSHPULL, 32, round=1, **fields),
            np.ones(8, np.float32),
            frames.encode_header(FrameType.PUSHPULL, 16, round=2, **fields),
            np.ones(4, np.float32),
        ]
    )
    # the well-formed round completes; the wrong-sized one is refused; the server lives on
    assert np.all(good.synchronize(good_handle) == 2.0)
    assert pair.servers[0].rounds_completed == 1
    server = pair.servers[0]
    assert server.wait(0.2) is None  # still serving: not stopped, no error
    python = server.state.loop.alive and all(e.inline for e in server.engines)  # the loop runs the engine
    assert server.state.native.alive if server.state.native else python


def test_conflicting_declarations_fail_the_tensor_on_every_worker_and_the_job_goes_on(pair):
    a, b = pair.workers
    ha = a.push_pull_async(np.ones(10, np.float32), "w")
    hb = b.push_pull_async(np.ones(11, np.float32), "w")  # no byte has moved: a's push waits for b's declaration
    for worker, handle in ((a, ha), (b, hb)):
        with pytest.raises(
            TensorMismatch, match=r"'w'.*worker 0: sum of float32\[10\]; worker 1: sum of float32\[11\]"
        ):
            worker.synchronize(handle)
    # the name is free again, and the job goes on
    out = pair.run(lambda w: w.push_pull(np.full(10, w.rank + 1, np.float32), "w"))
    assert all(np.all(o == 3) for o in out)
    assert pair.scheduler.wait(0.1) is None


def test_a_declaration_waiting_for_a_worker_that_shut_down_fails_at_once(pair):
    a, b = pair.workers
    handle = a.push_pull_async(np.ones(4, np.float32), "never")
    b.shutdown(final=False)
    started = time.monotonic()
    with pytest.raises(TensorError, match=r"'never'.*worker 1 left the job"):
        a.synchronize(handle)
    assert time.monotonic() - started < 2
    b.leave()


def test_a_round_that_needs_a_worker_that_shut_down_fails_at_once_and_one_it_pushed_completes():
    """A worker that left (shutdown()) while the others go on: the rounds it had pushed complete for the others (a job
    whose workers end at different moments), a round it never pushes fails at once on the servers, naming it, the
    tensor and the round (not at the timeout), whether begun before it left or after."""
    with LocalCluster(num_workers=2, num_servers=2, partition_bytes=64 << 10) as c:
        a, b = c.workers
        x = np.ones(100_000, np.float32)
        c.run(lambda w: w.push_pull(x, "g"))  # declared; round 1
        pushed = b.push_pull_async(x, "g")  # round 2: b pushes it and leaves before a has pushed it
        waiter = threading.Thread(target=b.synchronize, args=(pushed,))
        waiter.start()
        assert np.all(a.push_pull(x, "g") == 2)
        waiter.join(10)
        begun = a.push_pull_async(x, "g")  # round 3, which b will never push: begun before b leaves ...
        deadline = time.monotonic() + 10
        while not all(s.stall_report(time.monotonic() + 1e6) for s in c.servers):  # round 3 begun, b missing
            assert time.monotonic() < deadline, "a's pushes of round 3 never reached both servers"
            time.sleep(0.005)
        b.shutdown(final=False)
        started = time.monotonic()
        with pytest.raises(TensorError, match=r"server \d refused 'g'.*worker 1 left the job .* round 3 of 'g'"):
            a.synchronize(begun)
        with pytest.raises(TensorError, match=r"worker 1 left the job .* round 4 of 'g'"):
            a.push_pull(x, "g")  # ... and one begun after
        assert time.monotonic() - started < 5
        b.leave()


def test_a_worker_whose_process_ends_mid_job_fails_the_rounds_it_owes_after_a_moment(pair):
    """At process exit (a script that raised, or sys.exit) the bye is final: the rounds it owes fail after
    DEPARTED_GRACE_SECONDS, so a launcher sees that worker's exit before the others' and names it."""
    a, b = pair.workers
    x = np.ones(1000, np.float32)
    pair.run(lambda w: w.push_pull(x, "g"))
    b.shutdown(final=True)
    started = time.monotonic()
    with pytest.raises(TensorError, match=r"worker 1 left the job .* round 2 of 'g'"):
        a.push_pull(x, "g")
    assert DEPARTED_GRACE_SECONDS - 0.5 < time.monotonic() - started < DEPARTED_GRACE_SECONDS + 5


def test_a_collective_one_worker_skipped_for_a_barrier_fails_at_once(pair):
    a, b = pair.workers
    handle = a.push_pull_async(np.ones(4, np.float32), "skipped")
    entered = threading.Thread(target=b.barrier)
    entered.start()
    started = time.monotonic()
    with pytest.raises(TensorError, match=r"'skipped'.*worker 1 entered a barrier without calling it"):
        a.synchronize(handle)
    assert time.monotonic() - started < 2
    a.barrier()  # the two meet in the barrier, and the job goes on
    entered.join(5)
    out = pair.run(lambda w: w.push_pull(np.ones(4, np.float32), "skipped"))
    assert all(np.all(o == 2) for o in out)


def test_a_collective_called_after_another_worker_entered_a_barrier_fails_at_once(pair):
    a, b = pair.workers
    entered = threading.Thread(target=b.barrier)
    entered.start()
    deadline = time.monotonic() + 5
    while not pair.scheduler.roster.barrier:  # b waits in the barrier
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(TensorError, match=r"'late'.*worker 1 entered a barrier without calling it"):
        a.push_pull(np.ones(4, np.float32), "late")
    a.barrier()
    entered.join(5)


def test_a_collective_started_before_a_barrier_and_joined_after_it_completes(pair):
    # not a skipped collective: worker 0 starts it and does not wait for it before the barrier; worker 1 calls it after
    a, b = pair.workers

    def first():
        handle = a.push_pull_async(np.ones(4, np.float32), "across")
        time.sleep(0.2)  # worker 1 is in the barrier by now
        a.barrier()
        return a.synchronize(handle)

    def second():
        b.barrier()
        return b.push_pull(np.ones(4, np.float32), "across")

    results = {}
    threads = [threading.Thread(target=lambda f=f: results.__setitem__(f.__name__, f())) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(np.all(results[k] == 2) for k in ("first", "second"))


def test_an_empty_tensor_is_a_round_and_the_servers_live_on(cluster):
    out = cluster.run(lambda w: w.push_pull(np.zeros((0, 3), np.float32), "empty"))
    assert all(o.shape == (0, 3) for o in out)
    after = cluster.run(lambda w: w.push_pull(np.ones(2, np.float32), "after.empty"))
    assert all(np.all(o == len(cluster.workers)) for o in after)


def test_the_numpy_api_carries_horovods_collectives(cluster):
    n = len(cluster.workers)

    def job(w):
        with gradwire.use_worker(w):
            r = w.rank
            return (
                gradwire.push_pull(np.array([r, -r], np.int64), "np.max", op="max"),
                gradwire.allgather(np.full((r + 1, 2), r, np.float32), "np.ag"),
                gradwire.broadcast(np.full(3, r, np.float64), n - 1, "np.bc"),
                gradwire.reducescatter(np.ones((n, 2), np.float32), "np.rs"),
                gradwire.alltoall(np.arange(n, dtype=np.int32) + 10 * r, "np.a2a"),
            )

    for r, (high, gathered, root, rows, (received, counts)) in enumerate(cluster.run(job)):
        assert high.tolist() == [n - 1, 0]
        assert gathered.tolist() == [[k, k] for k in range(n) for _ in range(k + 1)]
        assert root.tolist() == [n - 1] * 3 and rows.tolist() == [[n, n]]
        assert received.tolist() == [10 * k + r for k in range(n)] and counts.tolist() == [1] * n


def test_overflow_gives_inf_not_an_error(cluster):
    big = np.finfo(np.float32).max
    results = cluster.run(lambda w: w.push_pull(np.array([big, 1.0], np.float32), "overflow"))
    assert np.isinf(results[0][0]) and results[0][1] == 3.0


def test_colocated_servers_take_their_hosts_share_and_the_sums_are_right():
    # one host here: the model gives every byte to the colocated servers (nothing need cross a network)
    with LocalCluster(num_workers=3, num_servers=3, colocated=2, partition_bytes=4096) as c:
        info = c.scheduler.roster.placement_info  # ranks follow arrival: which one is dedicated varies
        dedicated = info["colocated"].index(False)
        assert sorted(info["colocated"]) == [False, True, True]
        assert info["weights"] == [0.0 if r == dedicated else 0.5 for r in range(3)]
        out = c.run(lambda w: w.push_pull(np.arange(30000, dtype=np.float32) * (w.rank + 1), "t"))
        for a in out:
            np.testing.assert_array_equal(a, np.arange(30000, dtype=np.float32) * 6)
        loads = c.scheduler.roster.declarations.placement.loads
        colocated = [r for r in range(3) if r != dedicated]
        assert loads[dedicated] == 0 and abs(loads[colocated[0]] - loads[colocated[1]]) <= 4096
