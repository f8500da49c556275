"""Elastic mode in one process: a worker is lost and the others go on with fewer; a new one joins at a reset."""

from __future__ import annotations

import time

import numpy as np
import pytest

from gradwire.errors import JobAborted, MembershipChanged
from gradwire.testing import LocalCluster


def _sum_until_reset(worker, value: float) -> np.ndarray:
    """push_pull until the membership change reaches this worker, then re-form and sum once more."""
    for _ in range(200):
        try:
            worker.push_pull(np.full(5000, value, np.float32), "g")
        except MembershipChanged:
            worker.reset()
            return worker.push_pull(np.full(5000, value, np.float32), "g")
    raise AssertionError("no membership change reached this worker")


def test_survivors_go_on_with_fewer_workers_and_a_new_one_joins_at_a_reset():
    with LocalCluster(num_workers=3, num_servers=2, min_workers=2, max_workers=3, partition_bytes=4096) as c:
        assert c.run(lambda w: w.push_pull(np.full(5000, w.rank + 1.0, np.float32), "g")[0]) == [6.0] * 3
        dead = c.kill_worker(1)
        out = c.run(lambda w: _sum_until_reset(w, {0: 1.0, 2: 3.0}[w.rank if w.size == 3 else 2 * w.rank]))
        assert [w.size for w in c.workers] == [2, 2] and sorted(w.rank for w in c.workers) == [0, 1]
        assert [a[0] for a in out] == [4.0, 4.0]  # the survivors' sums, without the lost worker
        assert all(w.resets and w.epoch == c.scheduler.epoch for w in c.workers)
        assert dead not in c.workers

        joiner = c.add_worker()
        deadline = time.monotonic() + 10
        while not all(w.joining for w in c.workers[:2]) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert [w.joining for w in c.workers[:2]] == [1, 1]  # told, so state.commit() can re-form the job
        survivors = list(c.workers[:2])
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda w: w.reset(), survivors))
        joiner.join(10)
        assert sorted(w.rank for w in c.workers) == [0, 1, 2] and {w.size for w in c.workers} == {3}
        assert c.run(lambda w: w.push_pull(np.full(5000, w.rank + 1.0, np.float32), "g")[0]) == [6.0] * 3


def test_below_min_workers_the_job_aborts_naming_the_lost_worker():
    with LocalCluster(num_workers=2, num_servers=1, min_workers=2) as c:
        c.run(lambda w: w.push_pull(np.ones(10, np.float32), "g"))
        c.kill_worker(1)
        with pytest.raises(JobAborted, match="lost worker 1.*fewer than GRADWIRE_MIN_WORKERS=2"):
            for _ in range(200):
                c.workers[0].push_pull(np.ones(10, np.float32), "g")


def test_an_elastic_reset_after_a_server_failover_skips_the_dead_server():
    with LocalCluster(num_workers=3, num_servers=2, min_workers=2, partition_bytes=4096) as c:
        assert c.run(lambda w: w.push_pull(np.full(5000, 1.0, np.float32), "g")[0]) == [3.0] * 3
        c.kill_server(1)  # its keys move onto server 0
        assert c.run(lambda w: w.push_pull(np.full(5000, 1.0, np.float32), "g")[0]) == [3.0] * 3
        # the workers' calls may complete before the scheduler has every worker's report and records the failover
        deadline = time.monotonic() + 10
        while not c.scheduler.failovers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(c.scheduler.failovers) == 1
        c.kill_worker(2)
        out = c.run(lambda w: _sum_until_reset(w, 1.0))
        assert [a[0] for a in out] == [2.0, 2.0]
        assert all(link.transport == "lost" for w in c.workers for link in w.links if link.server == 1)


def test_the_data_path_settings_are_re_derived_when_the_job_re_forms():
    """Three workers (each as if on its own 100 Mbit/s host) and two servers: the servers' links together are slower
    than the workers' (fan-in), so a cap on unanswered partitions. With one worker gone they keep up: the reset
    re-derives the settings without the cap, and the survivors' new links take them."""
    with LocalCluster(num_workers=3, num_servers=2, min_workers=2, max_workers=3, link_rate="100mbit") as c:
        for i, node in enumerate(c.scheduler.roster.workers):  # here they share one host
            node.host_id = f"host{i}"
        with c.scheduler.roster.lock:
            c.scheduler.adaptation.retune_locked("three hosts")
        assert c.scheduler.tuning.unanswered == 4
        c.kill_worker(1)
        c.run(lambda w: _sum_until_reset(w, 1.0))
        assert c.scheduler.tuning.unanswered == 0 and "2 workers" in c.scheduler.tuning.derived_for
        for worker in c.workers:
            assert worker.tuning.unanswered == 0
            assert all(link.unanswered_cap == 0 for link in worker.links if hasattr(link, "unanswered_cap"))


@pytest.mark.parametrize("new_host", [False, True], ids=["on-a-measured-host", "on-a-new-host"])
def test_a_joiner_keeps_the_measured_placement(new_host, caplog):
    """GRADWIRE_PLACEMENT=auto: a worker that joins at a reset gets a link rate as the workers of the start did,
    its host's measured one or, on a host never measured, a probe of its own while it waits for its address book.
    Without one, the scheduler placed as if every link were equal ("some nodes gave GRADWIRE_LINK_RATE...")."""
    with LocalCluster(num_workers=2, num_servers=1, min_workers=1, max_workers=3, placement="auto") as c:
        rates = [w.link_rate for w in c.scheduler.roster.workers]
        assert all(r > 0 for r in rates)
        if new_host:  # the workers of the start as if on other hosts: the joiner's is new
            for i, node in enumerate(c.scheduler.roster.workers):
                node.host_id = f"elsewhere{i}"
        joiner = c.add_worker()
        deadline = time.monotonic() + 10
        while not all(w.joining for w in c.workers) and time.monotonic() < deadline:
            time.sleep(0.005)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda w: w.reset(), list(c.workers)))
        joiner.join(10)
        assert sorted(w.rank for w in c.workers) == [0, 1, 2]
        newcomer = c.scheduler.roster.workers[2]
        assert newcomer.link_rate > 0 and (newcomer.rtt > 0) == new_host
        if not new_host:
            assert newcomer.link_rate == rates[0]  # the host's rate, measured at the start
        assert c.scheduler.tuning.rate_bytes_per_s > 0
        assert "placing as if every link were equal" not in caplog.text
        assert c.run(lambda w: w.push_pull(np.full(5000, w.rank + 1.0, np.float32), "g")[0]) == [6.0] * 3


def test_a_worker_whose_script_raised_ends_the_elastic_job_naming_the_error():
    """Its process's last bye carries the exception: the job ends (a replacement would raise it too) instead of
    re-forming, or the survivors waiting in rounds it never pushes."""
    with LocalCluster(num_workers=3, num_servers=1, min_workers=2, max_workers=3) as c:
        failing = c.workers[0]
        failing.shutdown(final=True, error="RuntimeError: a bug (train.py, line 40, in train)")
        with pytest.raises(JobAborted, match=r"worker 0 at .* failed: RuntimeError: a bug \(train.py, line 40"):
            c.run(lambda w: w.push_pull(np.ones(5000, np.float32), "g") if w is not failing else None)
        assert c.scheduler.membership.resets == 0
        states = {n["rank"]: n["state"] for n in c.scheduler.status()["nodes"] if n["role"] == "worker"}
        assert states == {0: "lost", 1: "alive", 2: "alive"}  # what the launcher's progress line counts


def test_a_worker_lost_after_another_has_finished_is_a_departure_not_a_reset():
    """Once a worker has said bye (its work is done), a worker that dies is not re-formed around: the survivors
    would roll back and train again. The job ends cleanly when the last one is done."""
    with LocalCluster(num_workers=3, num_servers=1, min_workers=2, max_workers=3) as c:
        assert c.run(lambda w: w.push_pull(np.ones(5000, np.float32), "g")[0]) == [3.0] * 3
        c.workers[0].shutdown(final=True)
        c.kill_worker(1)
        last = c.workers[-1]
        deadline = time.monotonic() + 10
        while not c.scheduler.roster.workers[1].said_bye and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.scheduler.membership.resets == 0 and not c.scheduler.membership.resetting
        assert last.state.membership_error is None
        last.shutdown(final=True)
        assert c.scheduler.wait(10) is None  # a clean end
