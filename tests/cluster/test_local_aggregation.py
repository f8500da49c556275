"""Local aggregation (worker/aggregation.py): where several workers share each host, a host's sum crosses its link
once each way. In one process, `LocalCluster(hosts=2)` makes the workers act as two hosts (GRADWIRE_HOST_ID): a
worker reaches its own host's colocated server through shared memory and the other host's over TCP."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from gradwire.admin.top import render
from gradwire.errors import GradwireError
from gradwire.hosts import aggregation_groups
from gradwire.protocol import messages
from gradwire.testing import LocalCluster
from gradwire.worker.aggregation import CHUNK_BYTES, LOCAL_MIN_BYTES, Hierarchy

N = 300_001  # float32: 1.2 MB, not a multiple of the local workers' count


@pytest.fixture
def two_hosts():
    """Two hosts of two workers each, a colocated server on each: local aggregation's layout, a cluster per test."""
    with LocalCluster(num_workers=4, num_servers=2, colocated=2, hosts=2) as c:
        yield c


def _each(cluster, fn):
    with ThreadPoolExecutor(len(cluster.workers)) as pool:
        return list(pool.map(fn, cluster.workers))


def _value(rank: int, n: int = N) -> np.ndarray:
    return (np.arange(n, dtype=np.float32) % 97) * (rank + 1) + rank


def _network_bytes(worker) -> int:
    return int(worker.elastic.link_use()[messages.LINK_USE[1]])


def test_two_hosts_of_two_sum_every_worker_s_tensor_and_each_host_sends_its_sum_once(two_hosts):
    assert all(w.calls.aggregation is not None for w in two_hosts.workers)
    expected = sum(_value(r) for r in range(4))
    got = _each(two_hosts, lambda w: w.push_pull(_value(w.rank), "grad"))
    for g in got:
        np.testing.assert_allclose(g, expected, rtol=1e-6)
    assert all(np.array_equal(g, got[0]) for g in got)  # every worker holds the same bytes
    status = two_hosts.workers[3].status()["local_aggregation"]
    assert status["local_workers"] == [2, 3] and status["cross"] == [1, 3] and status["reductions"] == 1
    # a host's workers pushed one slice each over the network: its sum's bytes (half of them to the other host's
    # server), never a copy per worker
    job = two_hosts.scheduler.status()
    local = job["local_aggregation"]
    assert local["on"] and [h["workers"] for h in local["hosts"]] == [[0, 1], [2, 3]]
    assert sorted(s for h in local["hosts"] for s in h["colocated_servers"]) == [0, 1]
    assert "local aggregation: on (2 hosts x 2 workers" in render(job)
    per_host = [_network_bytes(two_hosts.workers[0]) + _network_bytes(two_hosts.workers[1]), 0]
    per_host[1] = _network_bytes(two_hosts.workers[2]) + _network_bytes(two_hosts.workers[3])
    assert all(0 < b <= 0.75 * N * 4 for b in per_host), per_host


# "held": every tensor past the workers' failover budget, so the stage that crosses hosts holds its sums in the
# leaders' outputs until both have them (docs/faults.md); the host's own stages keep copies (never held)
BUDGETS = pytest.mark.parametrize("budget", [{}, {"failover_copy_bytes": 0}], ids=["copies", "held"])


def _cross_stage_held(c: LocalCluster, budget: dict) -> bool:
    tensors = [t for w in c.workers for t in w.table.tensors.values()]
    return any(t.held for t in tensors) == bool(budget) and not any(t.held and "@host" in t.name for t in tensors)


@BUDGETS
def test_the_host_s_sum_is_deterministic_averages_divide_by_every_worker_and_in_place_works(budget):
    with LocalCluster(num_workers=4, num_servers=2, colocated=2, hosts=2, **budget) as c:
        rng = np.random.default_rng(7)
        values = [rng.standard_normal(N).astype(np.float32) for _ in range(4)]
        first = _each(c, lambda w: w.push_pull(values[w.rank], "g", average=True))
        again = _each(c, lambda w: w.push_pull(values[w.rank], "g", average=True))
        assert all(np.array_equal(a, first[0]) for a in first + again)  # bit-identical, run after run
        np.testing.assert_allclose(first[0], sum(values) / 4, rtol=1e-5, atol=1e-6)
        inputs = [v.copy() for v in values]
        _each(c, lambda w: w.push_pull_inplace(inputs[w.rank], "h"))
        for x in inputs:
            np.testing.assert_allclose(x, sum(values), rtol=1e-5, atol=1e-5)
        assert _cross_stage_held(c, budget)


def test_small_tensors_process_sets_and_other_reductions_keep_their_way(two_hosts):
    small = LOCAL_MIN_BYTES // 4 - 1
    got = _each(two_hosts, lambda w: w.push_pull(_value(w.rank, small), "small"))
    np.testing.assert_allclose(got[0], sum(_value(r, small) for r in range(4)), rtol=1e-6)
    assert all(w.calls.aggregation.count == 0 for w in two_hosts.workers)  # direct: too small to pay for three stages
    got = _each(two_hosts, lambda w: w.push_pull(_value(w.rank), "most", op="max"))
    np.testing.assert_array_equal(got[0], _value(3))
    pairs = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}
    got = _each(
        two_hosts,
        lambda w: w.synchronize(w.push_pull_async(_value(w.rank), f"set{pairs[w.rank]}", members=pairs[w.rank])),
    )
    np.testing.assert_allclose(got[0], _value(0) + _value(2), rtol=1e-6)


@pytest.mark.parametrize(
    "hosts, servers, why",
    [
        (["a", "a", "b", "b"], [], "have no colocated server"),
        (["a", "a", "a", "b"], ["a", "b"], "different numbers of workers"),
        (["a", "b", "c", "d"], ["a", "b", "c", "d"], "one worker per host"),
        (["a", "a", "a", "a"], ["a"], "share one host"),
    ],
)
def test_the_hierarchy_is_off_where_it_cannot_pay_and_says_why(hosts, servers, why):
    entries = [{"host_id": h, "colocated": True} for h in servers]
    assert Hierarchy.of(0, hosts, entries, enabled=True) is None
    groups, reason = aggregation_groups(hosts, set(servers))
    assert groups == [] and why in reason


def test_the_hierarchy_groups_hosts_in_rank_order_and_can_be_turned_off():
    hosts, servers = ["a", "b", "a", "b"], [{"host_id": "a", "colocated": True}, {"host_id": "b", "colocated": True}]
    h = Hierarchy.of(3, hosts, servers, enabled=True)
    assert h is not None and (h.local, h.index, h.cross) == ([1, 3], 1, [2, 3])
    assert Hierarchy.of(3, hosts, servers, enabled=False) is None
    with LocalCluster(num_workers=4, num_servers=2, colocated=2, hosts=2, local_aggregation=False) as c:
        assert all(w.calls.aggregation is None for w in c.workers)
        assert c.scheduler.status()["local_aggregation"]["why"] == "GRADWIRE_LOCAL_AGGREGATION=0"


def test_a_large_tensor_goes_in_chunks_whose_stages_pipeline(two_hosts):
    n = 3 * CHUNK_BYTES // 4 + 5  # three chunks, not a multiple of anything
    got = _each(two_hosts, lambda w: w.push_pull(_value(w.rank, n), "big", average=True))
    np.testing.assert_allclose(got[0], sum(_value(r, n) for r in range(4)) / 4, rtol=1e-6)
    assert all(np.array_equal(g, got[0]) for g in got)
    names = set(two_hosts.workers[0].table.tensors)
    assert {"big@0@host", "big@2@gather"} <= {n.split("@ranks")[0] for n in names}


@BUDGETS
def test_a_dead_colocated_server_fails_over_and_the_sums_go_on_exact(budget):
    """Host 0's colocated server dies between two steps: its keys (host 0's local stages, a share of the cross
    stage's) move to the survivor, and every sum after it is still the sum."""
    with LocalCluster(num_workers=4, num_servers=2, colocated=2, hosts=2, **budget) as c:
        expected = sum(_value(r) for r in range(4))
        np.testing.assert_allclose(_each(c, lambda w: w.push_pull(_value(w.rank), "g"))[0], expected, rtol=1e-6)
        c.kill_server(c.scheduler.status()["local_aggregation"]["hosts"][0]["colocated_servers"][0])
        for _ in range(2):
            got = _each(c, lambda w: w.push_pull(_value(w.rank), "g"))
            for g in got:
                np.testing.assert_allclose(g, expected, rtol=1e-6)
        assert _cross_stage_held(c, budget)


def test_a_dead_worker_ends_the_job_with_an_error_not_a_hang(two_hosts):
    _each(two_hosts, lambda w: w.push_pull(_value(w.rank), "g"))
    two_hosts.kill_worker(1)
    with pytest.raises(GradwireError, match="worker 1"):  # named, at once (not after a timeout)
        _each(two_hosts, lambda w: w.push_pull(_value(w.rank), "g"))


def test_a_compressed_sum_encodes_each_hosts_sum_once_and_its_running_mean_converges():
    """onebit with two workers per host: the host's stages carry the gradients as they are and only the cross stage
    is compressed, so a host's network bytes are its sum's blocks (about 1/32 of the sum); every worker holds the same
    bytes, and with error feedback (one residual per host share) the mean of the results approaches the exact
    average."""
    from gradwire import compression

    steps, n = 24, 1 << 20  # 4 MiB of float32: chunks whose cross slices each span several partitions
    values = [np.random.default_rng(r).standard_normal(n).astype(np.float32) * (r + 1) for r in range(4)]
    with LocalCluster(num_workers=4, num_servers=2, colocated=2, hosts=2) as c:
        before = [_network_bytes(w) for w in c.workers]

        def job(w):
            return [
                w.push_pull(values[w.rank], "g", average=True, compression=compression.onebit()) for _ in range(steps)
            ]

        results = _each(c, job)
        sent = [_network_bytes(w) - b for w, b in zip(c.workers, before, strict=True)]
        assert all(w.status()["local_aggregation"]["reductions"] == steps for w in c.workers)
    for step in range(steps):
        assert all(r[step].tobytes() == results[0][step].tobytes() for r in results)
    host_bytes = [sent[0] + sent[1], sent[2] + sent[3]]
    assert all(0 < b < steps * n * 4 / 16 for b in host_bytes), host_bytes  # pushes and pulls: 1/32 each way
    exact = np.mean(values, axis=0)
    running = np.cumsum(results[0], axis=0) / np.arange(1, steps + 1)[:, None]
    error = np.linalg.norm(running - exact, axis=1) / np.linalg.norm(exact)
    assert error[-1] < 0.5 * error[0], error
