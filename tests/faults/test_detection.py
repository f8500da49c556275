"""What gradwire detects and reports today: lost workers, silent nodes (fake clock), stalls, a lost scheduler."""

import time

import numpy as np
import pytest

from gradwire import JobAborted, WorkerLost
from gradwire.testing import FakeClock, LocalCluster


def test_a_worker_that_drops_out_is_named_by_every_survivor():
    c = LocalCluster(num_workers=3, num_servers=2)
    try:
        survivors = c.workers[:2]
        handles = [w.push_pull_async(np.ones(1000, np.float32), "g") for w in survivors]
        c.kill_worker(2)  # dies without a bye: its sockets just close
        for w, h in zip(survivors, handles, strict=True):
            with pytest.raises(WorkerLost, match="lost worker 2") as e:
                w.synchronize(h)
            assert e.value.lost_rank == 2
        with pytest.raises(WorkerLost):
            survivors[0].push_pull(np.ones(3, np.float32), "after")
    finally:
        c.close()


def test_a_silent_node_is_declared_lost_after_the_heartbeat_timeout():
    clock = FakeClock()
    c = LocalCluster(num_workers=2, num_servers=1, clock=clock, heartbeat_interval=0.02, heartbeat_timeout=30)
    try:
        c.workers[1].admin._stop.set()  # worker 1 hangs: it stops talking, its sockets stay open
        for _ in range(40):  # 40 fake seconds in 1 s steps; the live nodes heartbeat within every step
            clock.advance(1)
            time.sleep(0.1)
            if c.scheduler.abort_reason:
                break
        assert "lost worker 1" in c.scheduler.abort_reason and "silent for 3" in c.scheduler.abort_reason
        assert [(n.role, n.rank) for n in c.scheduler.roster.nodes if n.lost] == [("worker", 1)]
        with pytest.raises(WorkerLost, match=r"worker 1 .*silent") as e:
            c.workers[0].push_pull(np.ones(3, np.float32), "g")
        assert e.value.lost_rank == 1
    finally:
        c.close()


def test_a_stalled_round_is_reported_with_the_missing_ranks_and_the_tensor():
    with LocalCluster(num_workers=3, num_servers=1, stall_seconds=60) as c:
        server = c.servers[0]
        handles = [w.push_pull_async(np.ones(10, np.float32), "layer1.weight") for w in c.workers[:2]]
        # its first round: the declaration waits for worker 2's (the scheduler reports that)
        deadline = time.monotonic() + 10
        while "called by [0, 1]" not in "".join(c.scheduler.stall_report(time.monotonic() + 61)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (line,) = c.scheduler.stall_report(time.monotonic() + 61)
        assert "'layer1.weight'" in line and "worker(s) [2] to call it; called by [0, 1]" in line
        assert c.scheduler.stall_report(time.monotonic()) == []  # not stalled yet by the real clock
        c.workers[2].push_pull(np.ones(10, np.float32), "layer1.weight")
        for w, h in zip(c.workers, handles, strict=False):
            assert np.all(w.synchronize(h) == 3)
        assert c.scheduler.stall_report(time.monotonic() + 61) == []
        # a later round: the server reports which ranks have not pushed it
        handles = [w.push_pull_async(np.ones(10, np.float32), "layer1.weight") for w in c.workers[:2]]
        deadline = time.monotonic() + 10
        while "pushed by [0, 1]" not in "".join(server.stall_report(time.monotonic() + 61)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (line,) = server.stall_report(time.monotonic() + 61)
        assert "'layer1.weight'" in line and "worker(s) [2]" in line and "pushed by [0, 1]" in line
        assert server.stall_report(time.monotonic()) == []  # not stalled yet by the real clock
        c.workers[2].push_pull(np.ones(10, np.float32), "layer1.weight")  # the straggler arrives
        for w, h in zip(c.workers, handles, strict=False):
            assert np.all(w.synchronize(h) == 3)
        assert server.stall_report(time.monotonic() + 61) == []


def test_losing_the_scheduler_with_resuming_off_fails_every_blocked_call_with_a_clear_error():
    c = LocalCluster(num_workers=2, num_servers=1, scheduler_timeout=0)
    try:
        h = c.workers[0].push_pull_async(np.ones(10, np.float32), "g")
        c.scheduler.stop()
        with pytest.raises(JobAborted, match="scheduler"):
            c.workers[0].synchronize(h)
        assert c.servers[0].wait(10) is not None and "scheduler" in c.servers[0].wait(0)
    finally:
        c.close()
