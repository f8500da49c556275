import time
import tracemalloc

import numpy as np
import pytest

from gradwire.testing import LocalCluster


def test_memory_does_not_grow_with_rounds():
    with LocalCluster(num_workers=2, num_servers=1, partition_bytes=64 << 10) as c:
        grads = [np.ones(100_000, np.float32) for _ in c.workers]

        def rounds(count):
            c.run(lambda w: [w.push_pull_inplace(grads[w.rank], "g", average=True) for _ in range(count)])

        rounds(20)  # allocate the accumulators, warm every path
        tracemalloc.start()
        try:
            rounds(20)
            after_warm, _ = tracemalloc.get_traced_memory()
            rounds(300)
            after_many, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # 300 rounds move 240 MB through the server; what stays behind must be unrelated noise
        assert after_many - after_warm < 256 << 10, (after_warm, after_many)


def _copies(num_servers: int, **config) -> tuple[list[int], int]:
    """After a few push_pulls of a 400 KB tensor (7 partitions): the bytes of sums each worker keeps for a failover,
    and the rounds replica servers keep."""
    with LocalCluster(num_workers=2, num_servers=num_servers, partition_bytes=64 << 10, **config) as c:
        small = [np.ones(1000, np.float32) for _ in c.workers]  # declared first: within any budget below
        grads = [np.ones(100_000, np.float32) for _ in c.workers]

        def job(w):
            for _ in range(3):
                w.push_pull_inplace(small[w.rank], "small")
                w.push_pull_inplace(grads[w.rank], "g")

        c.run(job)
        assert all((g == 8).all() for g in grads + small)  # summed in place three times: 1, 2, 4, 8
        kept = [w.status()["failover_copy_bytes"] for w in c.workers]
        return kept, sum(s.replicated_rounds for s in c.servers)


@pytest.mark.parametrize("hold", [True, False], ids=["held", "replicas"])
def test_past_the_budget_workers_keep_no_copy_of_the_sums(hold):
    """Past the budget the sums are held in the calls' outputs until every worker has them (by default: nothing
    kept once the calls are done), or kept by replica servers (GRADWIRE_FAILOVER_HOLD=0)."""
    kept, replicated = _copies(2, failover_copy_bytes=100 << 10, failover_hold=hold)
    assert kept == [4000, 4000]  # the small tensor only
    assert replicated == (0 if hold else 3 * 7)  # 7 partitions, each round kept once on the other server


def test_workers_keep_the_copies_within_the_budget_or_with_one_server_and_no_holding():
    for num_servers, config in ((1, {"failover_copy_bytes": 0, "failover_hold": False}), (2, {})):
        kept, replicated = _copies(num_servers, **config)
        assert kept == [404000, 404000] and replicated == 0, (num_servers, config)
    kept, replicated = _copies(1, failover_copy_bytes=0)  # held needs no other server (a standby takes its keys)
    assert kept == [0, 0] and replicated == 0


def _worker_bytes(snapshot: tracemalloc.Snapshot) -> int:
    """What the workers' code holds in a snapshot (the servers run in this process too)."""
    worker = snapshot.filter_traces([tracemalloc.Filter(True, "*gradwire/worker/*")])
    return sum(stat.size for stat in worker.statistics("filename"))


@pytest.mark.parametrize("budget", [2 << 20, 1 << 30], ids=["2MiB", "1GiB"])
def test_a_workers_memory_for_failover_stays_within_the_budget_whatever_the_tensor(budget):
    """16 MiB pushed and pulled in place with a 2 MiB budget: what the worker allocates stays under the budget and one
    partition per link (a 1 MiB tensor's copies within it; the large one's sums held in place, received through a
    buffer of one partition where a shared slot was not free), not a copy of the 16 MiB; with a budget past both, the
    same measure sees the copies of both."""
    # the Python path's allocations, traced below (the native loop's copies: `failover_copy_bytes`, as checked)
    options = dict(partition_bytes=1 << 20, failover_copy_bytes=budget, datapath="python")
    with LocalCluster(num_workers=2, num_servers=2, **options) as c:
        small = [np.ones(1 << 18, np.float32) for _ in c.workers]
        large = [np.ones(1 << 22, np.float32) for _ in c.workers]

        def job(w):
            for _ in range(4):
                w.push_pull_inplace(small[w.rank], "small")
                w.push_pull_inplace(large[w.rank], "large")

        tracemalloc.start()  # from before the first call: the copies are allocated then
        try:
            c.run(job)
            held = _worker_bytes(tracemalloc.take_snapshot())
        finally:
            tracemalloc.stop()
        assert all((x == 16).all() for x in large)  # summed in place four times
        kept = [w.status()["failover_copy_bytes"] for w in c.workers]
        if budget < 16 << 20:
            assert kept == [1 << 20, 1 << 20]
            # both workers: within their budgets and a 1 MiB buffer per link, none of the 16 MiB
            assert held < 2 * (budget + 2 * (1 << 20)), held
        else:
            assert kept == [17 << 20, 17 << 20]
            assert held > 2 * (17 << 20), held


def test_an_out_of_place_result_is_referenced_by_its_caller_only():
    """Nothing of gradwire's keeps the last call's output alive (a sender thread did: every out-of-place call then
    held two outputs)."""
    import sys

    with LocalCluster(num_workers=2, num_servers=2, partition_bytes=64 << 10) as c:
        src = [np.ones(100_000, np.float32) for _ in c.workers]
        outs = c.run(lambda w: w.push_pull(src[w.rank], "g"))
        time.sleep(0.05)  # the links' threads back to waiting
        assert [sys.getrefcount(o) for o in outs] == [3, 3]  # the list, `o`, getrefcount's argument


def _server_buffers(server) -> int:
    """The bytes of a server's payload buffers: what its engines' pools made, and the round buffers keys own."""
    own = {}
    for engine in server.state.engines:
        for state in list(engine.keys.values()):
            for r in state.rounds:
                if not state.lent and r.acc is not None:
                    own[id(r.acc)] = r.acc.nbytes
    native = server.state.native.loop.sizes()[1] if server.state.native else 0  # the native loop's pool
    return sum(engine.pool.allocated for engine in server.state.engines) + sum(own.values()) + native


@pytest.mark.parametrize("hold", [True, False], ids=["held", "replicas"])
def test_servers_hold_buffers_for_rounds_in_flight_and_one_per_replicated_key(hold):
    """A 16 MiB tensor past the workers' budget, 3 workers, 2 servers: a round's buffer goes back to the pool once its
    replies are sent, so between calls the servers hold no round buffers, only (with replicas) their replicas' one per
    partition, and the pool what rounds and early contributions were in flight at once; not two round buffers, two
    staging buffers per rank above 0 and a replica's two per partition (8 x 16 MiB, before the pool)."""
    size = 16 << 20
    config = dict(partition_bytes=1 << 20, failover_copy_bytes=0, failover_hold=hold)
    with LocalCluster(num_workers=3, num_servers=2, **config) as c:
        grads = [np.ones(size // 4, np.float32) for _ in c.workers]
        c.run(lambda w: [w.push_pull_inplace(grads[w.rank], "g") for _ in range(4)])
        assert all((g == 81).all() for g in grads)  # 1 -> 3 -> 9 -> 27 -> 81
        assert sum(s.replicated_rounds for s in c.servers) == (0 if hold else 4 * 16)
        # held (the defaults): the native server loop sums the 16 partitions (its pool lends their buffers likewise);
        # with replicas the Python engines do, and keep the replicas
        assert all((s.state.native is not None) == hold for s in c.servers)
        states = [st for s in c.servers for e in s.state.engines for st in e.keys.values()]
        assert sorted(st.kept for st in states) == [False] * 16 * (not hold) + [True] * 16 * (not hold)
        assert sum(len(s.state.native.names) for s in c.servers if s.state.native) == 16 * hold
        deadline = time.monotonic() + 5  # the repliers give the last buffers back just after their sends
        while any(r.acc is not None for st in states if not st.kept for r in st.rounds):
            assert time.monotonic() < deadline, "round buffers still held after their replies were sent"
            time.sleep(0.01)
        held = sum(_server_buffers(s) for s in c.servers)
        # 2.4x here with replicas: the replicas' 1x, the rest what was in flight at once (at most a round's buffer, the
        # next round's and two early contributions per partition: 4x); held, the replicas' 1x less
        assert (0 if hold else size) <= held <= (4 if hold else 5) * size, held / size
