"""The scheduler's death does not end the job (scheduler/recovery.py, docs/faults.md): the data path goes on without it,
a scheduler started at its address rebuilds the job from the nodes' reports, and the results are bit-identical to a
run without the failure. In-process clusters; tests/faults/test_killed_processes.py SIGKILLs a real one."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gradwire.config import Config
from gradwire.errors import GradwireTimeout, JobAborted
from gradwire.protocol import messages
from gradwire.scheduler import client
from gradwire.testing import LocalCluster
from gradwire.transport import endpoints, tcp
from tests.faults.test_elastic import _sum_until_reset
from tests.faults.test_failover import STEPS, _answer_one_then_die, _expected, _train

SIZES = {"embedding": 70_000, "layer.weight": 20_000, "layer.bias": 300, "head": 9}  # floats: several partitions
SETTINGS = {"partition_bytes": 64 * 1024, "heartbeat_interval": 0.2, "scheduler_timeout": 20.0}


def gradients(rank: int, step: int, name: str) -> np.ndarray:
    """A worker's gradient of `name` at `step`: float32 values whose sum depends on the order it is taken in."""
    rng = np.random.default_rng([rank, step, len(name)])
    return (rng.standard_normal(SIZES.get(name, 1000)) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)


def step(worker, n: int, names=tuple(SIZES)) -> dict[str, np.ndarray]:
    """One training step's push_pulls, in backward order (the last layer first)."""
    handles = {name: worker.push_pull_async(gradients(worker.rank, n, name), name) for name in reversed(names)}
    return {name: worker.synchronize(h) for name, h in handles.items()}


def reference(steps: int, extra: tuple[str, ...] = ()) -> list[list[dict[str, np.ndarray]]]:
    """The sums of a run without any failure: per step, per rank."""
    with LocalCluster(num_workers=2, num_servers=2, **SETTINGS) as c:
        return [c.run(lambda w, n=n: step(w, n, tuple(SIZES) + (extra if n >= 3 else ()))) for n in range(steps)]


def same(got, want) -> None:
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        for rank, (gr, wr) in enumerate(zip(g, w, strict=True)):
            for name in wr:
                assert gr[name].tobytes() == wr[name].tobytes(), f"step {n}, worker {rank}, {name!r} differs"


def test_training_goes_on_without_the_scheduler_and_a_restarted_one_resumes_the_job_bit_identical():
    want = reference(6, extra=("late",))
    got = []
    with LocalCluster(num_workers=2, num_servers=2, **SETTINGS) as c:
        got += [c.run(lambda w, n=n: step(w, n)) for n in range(2)]
        c.kill_scheduler()
        got.append(c.run(lambda w: step(w, 2)))  # no scheduler: the data path needs none
        scheduler = c.restart_scheduler()
        names = (*SIZES, "late")  # a tensor declared after the restart: the new scheduler places it
        got += [c.run(lambda w, n=n: step(w, n, names)) for n in range(3, 6)]
        c.run(lambda w: w.barrier())
        recovered = scheduler.status()["recovered"]
        assert recovered["term"] == 2 and recovered["tensors"] == len(SIZES)
        assert recovered["reported"] == ["server 0", "server 1", "worker 0", "worker 1"]
        assert all(w.state.term == 2 for w in c.workers) and all(s.state.term == 2 for s in c.servers)
        status = c.workers[0].status()
        assert status["term"] == 2 and [r["term"] for r in status["scheduler_resumes"]] == [2]
    same(got, want)


def test_a_declaration_made_while_no_scheduler_runs_is_answered_by_the_next_and_twice_in_one_job():
    want = reference(6, extra=("late",))
    got = []
    with LocalCluster(num_workers=2, num_servers=2, **SETTINGS) as c:
        got += [c.run(lambda w, n=n: step(w, n)) for n in range(3)]
        c.kill_scheduler()
        names = (*SIZES, "late")
        results: list = []
        steps = threading.Thread(target=lambda: results.append(c.run(lambda w: step(w, 3, names))))
        steps.start()  # "late" waits for a scheduler to declare it; the other tensors go on
        time.sleep(0.5)
        assert steps.is_alive()
        c.restart_scheduler()
        steps.join(30)
        got += results
        c.kill_scheduler()  # and again
        got.append(c.run(lambda w: step(w, 4, names)))
        scheduler = c.restart_scheduler()
        got.append(c.run(lambda w: step(w, 5, names)))
        c.run(lambda w: w.barrier())
        assert scheduler.status()["recovered"]["term"] == 3
        assert [len(w.control.resumes) for w in c.workers] == [2, 2]
    same(got, want)


def test_a_barrier_answered_to_some_workers_only_when_the_scheduler_died_is_passed_by_the_rest():
    with LocalCluster(num_workers=2, num_servers=1, **SETTINGS) as c:
        scheduler = c.scheduler
        node = scheduler.roster.workers[1]
        send = node.conn.send_message

        def lose_the_answer(message):  # worker 1's answer goes down with the scheduler; worker 0 has its own
            if isinstance(message, messages.Reply):
                threading.Timer(0.3, scheduler.stop).start()
                return
            send(message)

        node.conn.send_message = lose_the_answer
        passed = []
        waiter = threading.Thread(target=lambda: (c.workers[1].barrier(), passed.append(1)))
        waiter.start()
        c.workers[0].barrier()
        time.sleep(0.6)
        assert not passed and scheduler.roster.done.is_set()
        c.restart_scheduler()
        waiter.join(20)
        assert passed, "worker 1 never passed the barrier worker 0 had passed"
        c.run(lambda w: w.barrier())  # the next one is a new barrier for both
        assert c.scheduler.roster.barriers_passed == 3


def test_a_server_that_dies_with_the_scheduler_is_failed_over_by_the_next_one_bit_identical():
    want = reference(5)
    got = []
    with LocalCluster(num_workers=2, num_servers=3, **SETTINGS) as c:
        got += [c.run(lambda w, n=n: step(w, n)) for n in range(2)]
        c.kill_scheduler()
        c.kill_server(1)
        results: list = []
        steps = threading.Thread(target=lambda: results.append(c.run(lambda w: step(w, 2))))
        steps.start()  # server 1's partitions wait: nobody can fail it over yet
        time.sleep(0.5)
        scheduler = c.restart_scheduler()
        steps.join(30)
        got += results
        got += [c.run(lambda w, n=n: step(w, n)) for n in range(3, 5)]
        assert scheduler.status()["recovered"]["servers_lost"] == [1]
        assert [f["server"] for f in scheduler.failovers] == [1]
    same(got, want)


def test_with_no_scheduler_back_in_time_every_call_fails_naming_it():
    with LocalCluster(num_workers=2, num_servers=1, **(SETTINGS | {"scheduler_timeout": 1.0})) as c:
        c.run(lambda w: step(w, 0))
        address = c.kill_scheduler()
        started = time.monotonic()
        with pytest.raises(JobAborted, match=f"no scheduler resumed the job at {address}.*SCHEDULER_TIMEOUT=1s"):
            c.run(lambda w: (time.sleep(2), w.barrier()))
        assert time.monotonic() - started < 10
        assert "no scheduler resumed the job" in c.servers[0].wait(10)


def test_a_node_follows_no_scheduler_of_an_older_term_nor_one_without_the_secret():
    """Fencing: a scheduler answering with a term no newer than the node's own is refused, as is one that fails the
    job secret's handshake; the node gives up at GRADWIRE_SCHEDULER_TIMEOUT."""
    listener = endpoints.listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    secret = "s" * 64
    stale = {"term": 2}

    def old_scheduler() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            conn = tcp.Connection(sock, max_payload=0)
            try:
                conn.handshake(secret.encode() if stale["term"] else b"other", "scheduler", 0, initiator=False)
                conn.recv_json()
                conn.send_message(messages.Resumed(stale["term"], 1))
            except Exception:
                pass
            finally:
                conn.close()

    threading.Thread(target=old_scheduler, daemon=True).start()
    config = Config(role="worker", scheduler=f"127.0.0.1:{port}", secret=secret, scheduler_timeout=1.0)
    report = lambda: messages.Resume(role="worker", rank=0, term=2, epoch=1)  # noqa: E731
    try:
        with pytest.raises(GradwireTimeout, match="term 2 .*knows term 2"):
            client.resume(config, report, term=2)
        stale["term"] = 0  # now: the wrong secret
        with pytest.raises(GradwireTimeout, match="no scheduler resumed"):
            client.resume(config, report, term=2)
    finally:
        listener.close()


def test_a_worker_that_died_with_the_scheduler_is_named_when_the_next_one_gives_up_waiting_for_its_report():
    with LocalCluster(num_workers=3, num_servers=1, **(SETTINGS | {"heartbeat_timeout": 1.5})) as c:
        c.run(lambda w: step(w, 0))
        c.kill_scheduler()
        c.kill_worker(2)
        c.restart_scheduler()
        started = time.monotonic()
        with pytest.raises(JobAborted, match=r"worker\(s\) \[2\] did not report within 1.5s"):
            c.run(lambda w: w.barrier())
        assert time.monotonic() - started < 10


def test_an_elastic_job_resumed_by_a_restarted_scheduler_still_reforms_without_a_lost_worker():
    settings = SETTINGS | {"min_workers": 2, "max_workers": 3, "partition_bytes": 4096}
    with LocalCluster(num_workers=3, num_servers=2, **settings) as c:
        assert c.run(lambda w: w.push_pull(np.full(5000, w.rank + 1.0, np.float32), "g")[0]) == [6.0] * 3
        c.kill_scheduler()
        c.restart_scheduler()
        c.run(lambda w: w.barrier())  # resumed
        c.kill_worker(1)
        out = c.run(lambda w: _sum_until_reset(w, {0: 1.0, 2: 3.0}[w.rank if w.size == 3 else 2 * w.rank]))
        assert [a[0] for a in out] == [4.0, 4.0] and [w.size for w in c.workers] == [2, 2]
        assert c.scheduler.status()["recovered"]["term"] == 2


def _join_with(kill: bool) -> tuple:
    """Worker 0 joins (hvd.join) and waits; worker 1 trains two more steps (zeros in worker 0's place), then joins
    too; with `kill`, the scheduler dies once it has worker 0's join and is restarted before worker 1's."""
    with LocalCluster(num_workers=2, num_servers=2, **SETTINGS) as c:
        w0, w1 = sorted(c.workers, key=lambda w: w.rank)
        c.run(lambda w: step(w, 0))
        joined: dict[int, int] = {}
        waiter = threading.Thread(target=lambda: joined.setdefault(0, w0.join()), daemon=True)
        waiter.start()
        deadline = time.monotonic() + 10
        while 0 not in c.scheduler.roster.joins and time.monotonic() < deadline:
            time.sleep(0.005)
        assert 0 in c.scheduler.roster.joins
        if kill:
            c.kill_scheduler()
        alone = [step(w1, n) for n in (1, 2)]  # the data path: the servers know worker 0 joined
        if kill:
            c.restart_scheduler()
        last = w1.join()
        waiter.join(30)
        after = c.run(lambda w: step(w, 3))
        return alone, last, joined.get(0), after


def test_a_join_under_way_when_the_scheduler_dies_completes_with_the_next_bit_identical():
    """hvd.join: worker 0 has joined when the scheduler dies; its JOIN is sent again to the restarted scheduler, worker
    1's averages go on with zeros in its place meanwhile, and once worker 1 joins both return the same last rank; the
    sums before, during and after equal a run without the failure. (Which rank is last is the order the restarted
    scheduler got the joins in: both were waiting for it, and no scheduler saw worker 1's come second.)"""
    want_alone, want_last, _, want_after = _join_with(kill=False)
    alone, last, last0, after = _join_with(kill=True)
    same([alone], [want_alone])
    same([after], [want_after])
    assert want_last == 1 and last == last0 in (0, 1)


ELASTIC = SETTINGS | {"min_workers": 2, "max_workers": 3, "partition_bytes": 4096, "heartbeat_timeout": 1.0}


def test_an_elastic_job_re_forms_without_a_worker_that_died_with_the_scheduler():
    """Worker 1 and the scheduler die together: the restarted scheduler waits GRADWIRE_HEARTBEAT_TIMEOUT for worker 1's
    report, then rebuilds the job without it and re-forms it (as for any lost worker of an elastic job)."""
    with LocalCluster(num_workers=3, num_servers=2, **ELASTIC) as c:
        assert c.run(lambda w: w.push_pull(np.full(5000, w.rank + 1.0, np.float32), "g")[0]) == [6.0] * 3
        c.kill_worker(1)
        c.kill_scheduler()
        scheduler = c.restart_scheduler()
        out = c.run(lambda w: _sum_until_reset(w, {0: 1.0, 2: 3.0}[w.rank if w.size == 3 else 2 * w.rank]))
        assert [a[0] for a in out] == [4.0, 4.0] and [w.size for w in c.workers] == [2, 2]
        assert scheduler.recovery.record["workers_lost"] == [1] and scheduler.membership.resets == 1


def test_a_re_form_under_way_when_the_scheduler_dies_completes_with_the_next():
    """Worker 1 dies; the scheduler tells the others to re-form and worker 0 asks to rejoin, then the scheduler dies
    before the re-form completes: worker 0's REJOIN goes to the restarted scheduler, which takes worker 1 (missing) as
    lost and completes the re-form with workers 0 and 2."""
    with LocalCluster(num_workers=3, num_servers=2, **ELASTIC) as c:
        assert c.run(lambda w: w.push_pull(np.full(5000, w.rank + 1.0, np.float32), "g")[0]) == [6.0] * 3
        w0, w2 = (w for w in c.workers if w.rank != 1)
        c.kill_worker(1)
        deadline = time.monotonic() + 10
        while not c.scheduler.membership.resetting and time.monotonic() < deadline:
            time.sleep(0.005)
        first = threading.Thread(target=lambda: out.setdefault(0, _sum_until_reset(w0, 1.0)), daemon=True)
        out: dict[int, np.ndarray] = {}
        first.start()
        while not c.scheduler.membership.rejoined and time.monotonic() < deadline:
            time.sleep(0.005)
        assert c.scheduler.membership.rejoined  # worker 0 waits for the re-form; worker 2 has not asked yet
        c.kill_scheduler()
        scheduler = c.restart_scheduler()
        out[2] = _sum_until_reset(w2, 3.0)
        first.join(30)
        assert out[0][0] == out[2][0] == 4.0 and w0.size == w2.size == 2
        assert scheduler.roster.term == 2 and scheduler.epoch >= 2


def _interrupt_the_failover(cluster: LocalCluster, told: str, interrupted: threading.Event, go: threading.Event):
    """Stop the scheduler's failover where `told` says (`interrupted` is set there; it waits for `go`, by which time
    the scheduler is dead): "none", before any worker hears of it (its keys moved on the servers); "worker 0", its
    REPLACE told to worker 0 only; "all", told to every worker, before any is told it is over (SEED)."""
    scheduler = cluster.scheduler
    tell = scheduler.roster.tell

    def stop_here() -> None:
        interrupted.set()
        go.wait(30)

    if told == "none":
        scheduler.failover._complete = lambda body, workers, held: stop_here() or 0
        return

    def partial_tell(nodes, message):
        if told == "worker 0" and isinstance(message, messages.Replace):
            tell([n for n in nodes if n.rank == 0], message)
            stop_here()
        elif told == "all" and isinstance(message, messages.Reseed):
            stop_here()
        else:
            tell(nodes, message)

    scheduler.roster.tell = partial_tell


@pytest.mark.parametrize("told", ["none", "worker 0", "all"])
@pytest.mark.parametrize("standby", [0, 1], ids=["onto-survivors", "to-a-standby"])
def test_a_server_failover_under_way_when_the_scheduler_dies_is_completed_by_the_next_bit_identical(told, standby):
    """A server dies after answering a round to worker 0 only (its sum must come from worker 0's copy); the scheduler
    dies in the middle of failing it over (`told`); a restarted one completes the failover from the reports: it
    tells the workers that were not told, and asks worker 0 for the seed. Every sum is the rank-order sum."""
    _failover_interrupted(told, standby, copy_bytes=1 << 30)


@pytest.mark.parametrize("standby", [0, 1], ids=["onto-survivors", "to-a-standby"])
def test_a_failover_of_held_sums_under_way_when_the_scheduler_dies_is_completed_by_the_next(standby):
    """As above with every sum held in the workers' outputs (no copies): worker 0's output is the seed, and its call
    completes only once the next scheduler's SEED says the failover is over."""
    _failover_interrupted("worker 0", standby, copy_bytes=0)


def _failover_interrupted(told: str, standby: int, copy_bytes: int) -> None:
    config = {"partition_bytes": 4096, "failover_copy_bytes": copy_bytes, "scheduler_timeout": 20.0}
    # the trap is set in server 0's Python engine (`_answer_one_then_die`): the servers run the Python data path
    config["server_config"] = {i: {"datapath": "python"} for i in range(2 + standby)}
    with LocalCluster(num_workers=3, num_servers=2, num_standby=standby, heartbeat_interval=0.2, **config) as c:
        killed, interrupted, go = threading.Event(), threading.Event(), threading.Event()
        _answer_one_then_die(c, killed, after=15)
        _interrupt_the_failover(c, told, interrupted, go)

        def restart() -> None:
            if interrupted.wait(30):
                c.kill_scheduler()
                go.set()
                c.restart_scheduler()

        restarter = threading.Thread(target=restart, daemon=True)
        restarter.start()
        results = c.run(lambda w: _train(w, killed, kill_at=STEPS - 2))
        restarter.join(30)
        assert interrupted.is_set(), "the scheduler never began the failover"
        expected = _expected(3)
        for rank, sums in enumerate(results):
            wrong = [k for k in expected if sums[k] != expected[k]]
            assert not wrong, f"worker {rank}: sums differ for {wrong[:5]}"
        (record,) = c.scheduler.failovers
        assert record["server"] == 0 and record["to"] == ("standby" if standby else "survivors") or told == "none"
        resumed = c.scheduler.status()["recovered"]
        if told == "none":  # nobody knew of it: failed over anew (to the standby promoted before, if it reported)
            assert resumed["servers_lost"] == [0] and resumed["failover_under_way"] is None
            roster = c.scheduler.roster
            assert len(roster.standby) + (record["to"] == "standby") == standby  # not lost to the job
        else:
            assert resumed["failover_under_way"] == 0 and record["why"] == "completed after the scheduler's death"
        assert record["seeds"] >= 1  # worker 0 held the round the others waited for
        assert all(not w.failover.latest() or w.failover.latest()["over"] for w in c.workers)
        assert all(t.held == (copy_bytes == 0) for w in c.workers for t in w.table.tensors.values())
