"""Following the links while the job runs (scheduler/adapt.py, tuning.Drift): the settings derived for the links
measured at the start are derived again when the workers' links move bytes at another rate, and tensors already
declared are re-cut at the same round on every worker, without a wrong sum or a hang."""

import dataclasses
import random
import threading
import time

import numpy as np
import pytest

from gradwire.errors import GradwireTimeout
from gradwire.protocol import messages
from gradwire.testing import LocalCluster

pytestmark = pytest.mark.timeout(120)
SHAPES = {"conv": (64, 3, 3, 3), "fc": (300_000,), "bias": (10,), "big": (700_001,)}


class _Stop:
    """Stops every worker's `_train` after the same step: the most any worker had begun when stop() was called (a
    worker that checked a plain flag a moment before the others began one more step, and waited for them in vain)."""

    def __init__(self):
        self.lock, self.begun, self.after = threading.Lock(), {}, None

    def stop(self):
        with self.lock:
            self.after = max(self.begun.values(), default=0)

    def go_on(self, rank, step):
        with self.lock:
            if self.after is not None and step >= self.after:
                return False
            self.begun[rank] = step + 1
            return True


def _train(worker, steps, stop=None, seed=0):
    """Steps of a training-like loop: every tensor each step, in an order and with pauses of the worker's own (as
    backward hooks fire), each checked against the sum the workers must get."""
    rng = random.Random(seed * 100 + worker.rank)
    n = worker.size
    step = 0
    while step < steps and (stop is None or stop.go_on(worker.rank, step)):
        names = list(SHAPES)
        rng.shuffle(names)
        handles = []
        for name in names:
            x = np.full(SHAPES[name], worker.rank + 1 + step, np.float32)
            handles.append((name, worker.push_pull_async(x, name)))
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.003)
        want = n * (n + 1) / 2 + n * step
        for name, handle in handles:
            out = worker.synchronize(handle)
            assert out.shape == SHAPES[name] and np.all(out == want), f"worker {worker.rank} step {step}: {name}"
        step += 1
    return step


def _recut_rounds_done(worker, name):
    """Rounds of `name` summed on its latest re-cut's partitions (0 before any re-cut)."""
    tensor = worker.table.tensors.get(name)
    chain = tensor.chain() if tensor is not None else []
    return 0 if len(chain) < 2 else chain[-1].round - chain[-2].successor[0] + 1


def _wait_for(predicate, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class _Training:
    """`_train` on every worker of `cluster` in the background until stopped; `result()` stops it and returns each
    worker's step count (or raises what failed)."""

    def __init__(self, cluster):
        self.stop, self.results = _Stop(), []
        self.runner = threading.Thread(target=self._run, args=(cluster,))
        self.runner.start()

    def _run(self, cluster):
        try:
            self.results.append(cluster.run(lambda w: _train(w, 10_000, self.stop)))
        except BaseException as e:  # noqa: BLE001 - raised by result()
            self.results.append(e)

    def alive(self):
        return self.runner.is_alive()

    def result(self):
        self.stop.stop()
        self.runner.join(60)
        assert not self.runner.is_alive() and self.results, "training did not finish"
        if isinstance(self.results[0], BaseException):
            raise self.results[0]
        assert min(self.results[0]) > 0
        return self.results[0]


def _force_drift(cluster, rate_bytes_per_s, after=3):
    """The drift check's verdict, forced once after `after` intervals with traffic: the re-cut itself is under test
    here, on any machine (how fast this one's loopback is does not decide whether it happens)."""
    drift, calls = cluster.scheduler.adaptation.drift, []
    observe = drift.observe

    def forced(now, samples, tuning, host_busy=None):
        observe(now, samples, tuning, host_busy)
        calls.append(now) if samples else None
        return rate_bytes_per_s if len(calls) == after else None

    drift.observe = forced


def test_links_faster_than_measured_are_measured_and_the_settings_derived_again():
    """The settings were derived for 1 Mbit/s (GRADWIRE_LINK_RATE). Loopback moves far more: after three intervals
    the scheduler derives them again for the rate the workers' links measured."""
    with LocalCluster(num_workers=3, num_servers=2, link_rate="1mbit", transport="tcp", heartbeat_interval=0.1) as c:
        first = c.scheduler.tuning
        training = _Training(c)
        try:
            _wait_for(lambda: c.scheduler.adaptation.history or not training.alive())
        finally:
            training.result()
        now = c.scheduler.tuning
        assert "measured over 3 intervals" in now.derived_for
        assert now.rate_bytes_per_s > 2 * first.rate_bytes_per_s
        status = c.scheduler.adaptation.status()
        assert status["rederived"] and status["last_interval"]["measured_bytes_per_s"] > 0


def test_tensors_in_use_are_re_cut_at_one_round_on_every_worker():
    """A re-derivation for 1 Gbit/s links (256 KiB partitions) while every worker trains, in its own order and with
    pauses: the tensors in use get new keys at one round on every worker, and every sum stays right."""
    with LocalCluster(num_workers=3, num_servers=2, link_rate="1mbit", transport="tcp", heartbeat_interval=0.1) as c:
        assert c.scheduler.tuning.partition_bytes == 16 << 10
        _force_drift(c, 125e6)
        training = _Training(c)
        try:
            _wait_for(lambda: all(_recut_rounds_done(w, "fc") >= 3 for w in c.workers) or not training.alive())
        finally:
            training.result()
        now = c.scheduler.tuning
        assert now.partition_bytes == 256 << 10
        history = c.scheduler.adaptation.history
        assert [h["recut_tensors"] for h in history] == [4]  # every tensor is given the round to switch at ...
        for w in c.workers:
            tensor = w.table.tensors["fc"]
            assert tensor.successor is not None  # re-cut, at one round on every worker
            assert tensor.successor[0] == c.workers[0].table.tensors["fc"].successor[0]
            assert len(tensor.chain()[-1].parts) < len(tensor.parts)
            assert w.status()["data_path"]["partition_bytes"] == now.partition_bytes
            assert w.status()["data_path"]["recuts"][0]["tensors"] == 2  # ... fc and big: conv and bias fit one
            assert w.credit.lead == w.config.pacing * (256 << 10)  # pacing's lead, counted in partitions


def test_a_re_cut_stays_within_what_every_worker_s_links_carry():
    """A worker's shared-memory slots were made for the partitions of the start: a re-cut to larger ones is capped
    at the largest that every worker reports it carries, and the sums stay right on the capped partitions."""
    with LocalCluster(num_workers=2, num_servers=2, link_rate="1mbit", transport="tcp", heartbeat_interval=0.1) as c:
        c.workers[1].state.carry_limit = lambda: 32 << 10  # as if its arenas had 32 KiB slots
        _force_drift(c, 125e6)  # 256 KiB partitions
        training = _Training(c)
        try:
            _wait_for(lambda: all(_recut_rounds_done(w, "fc") >= 2 for w in c.workers) or not training.alive())
        finally:
            training.result()
        assert c.scheduler.tuning.partition_bytes == 32 << 10
        assert "largest the workers' links carry" in c.scheduler.tuning.reason
        for w in c.workers:
            fc = w.table.tensors["fc"].chain()[-1]
            assert len(fc.parts) == -(-SHAPES["fc"][0] * 4 // (32 << 10))  # float32, in 32 KiB partitions


def test_a_worker_with_an_explicit_partition_size_vetoes_the_re_cut():
    """GRADWIRE_PARTITION_BYTES set on one worker: the window and cap still follow the links, the tensors keep their
    partitions on every worker (a re-cut must be the same everywhere)."""
    with LocalCluster(num_workers=2, num_servers=1, link_rate="1mbit", transport="tcp", heartbeat_interval=0.1) as c:
        fixed = c.workers[1]
        fixed.state.config = dataclasses.replace(fixed.config, explicit=fixed.config.explicit | {"partition_bytes"})
        _force_drift(c, 125e6)
        training = _Training(c)
        try:
            history = c.scheduler.adaptation.history
            _wait_for(lambda: (history and c.scheduler.adaptation.pending is None) or not training.alive())
            time.sleep(0.2)
        finally:
            training.result()
        assert [(h["partition_bytes"], h["recut_tensors"]) for h in history] == [(256 << 10, 0)]
        for w in c.workers:
            assert w.table.tensors["fc"].successor is None and not w.recut.history
        assert fixed.status()["data_path"]["partition_bytes"] == 16 << 10


def test_off_with_gradwire_adapt_0():
    with LocalCluster(
        num_workers=2, num_servers=1, link_rate="1mbit", transport="tcp", heartbeat_interval=0.1, adapt=False
    ) as c:
        c.run(lambda w: _train(w, 15))
        time.sleep(0.5)
        assert not c.scheduler.adaptation.history and c.scheduler.tuning.partition_bytes == 16 << 10


def test_a_held_round_waits_for_the_scheduler_and_no_longer():
    """Step 1 of a re-cut holds a tensor's calls two rounds past the round reported; the RETUNE releases them, and
    a scheduler that never sends it fails the call after the timeout instead of hanging."""
    with LocalCluster(num_workers=1, num_servers=1, transport="tcp", adapt=False) as c:
        (w,) = c.workers
        w.state.config = dataclasses.replace(w.config, timeout=1.0)
        x = np.ones(100_000, np.float32)
        w.push_pull(x, "g")
        sent = []
        w.control.conn.send_message = sent.append  # keep the answer from the scheduler
        w.retuning.on_recut(messages.Recut(7))
        assert [m.rounds for m in sent if isinstance(m, messages.RecutRounds)] == [{"g": 1}]
        w.push_pull(x, "g")  # round 2: not held
        with pytest.raises(GradwireTimeout, match="re-cut 7"):
            w.push_pull(x, "g")  # round 3: held, and nobody answers
        w.retuning.on_retune(messages.Retune(w.tuning.as_dict(), {}, 7))
        assert w.push_pull(x, "g")[0] == 1.0


def test_a_raised_window_keeps_within_a_shared_memory_link_s_slots():
    """A RETUNE that raises the window (what a re-derivation for slower links does: 8 workers on 2 hosts went from
    window 4 to 8) must not let a shared-memory link push more partitions than its arena has slots: its sender took a
    slot from an empty list, died, and every push_pull on it waited for the timeout."""
    with LocalCluster(num_workers=2, num_servers=1, link_rate="1mbit", adapt=False) as c:
        links = [w.links[0] for w in c.workers]
        assert all(link.transport == "shm" for link in links)
        slots = links[0].arena.push
        raised = c.workers[0].tuning.as_dict() | {"window": 4 * slots}
        for w in c.workers:
            w.state.config = dataclasses.replace(w.config, timeout=10.0)
            w.retuning.on_retune(messages.Retune(raised, {}, 0))
        assert [link.window for link in links] == [slots, slots]
        x = np.ones(1_000_000, np.float32)  # 245 partitions of 16 KiB, far more than the window
        for out in c.run(lambda w: w.push_pull(x, "g")):
            assert np.all(out == 2.0)


def test_a_link_whose_sender_fails_fails_its_calls_at_once():
    """A bug in a link's sender ends that link with the cause, in every call waiting on it, instead of a hang."""
    with LocalCluster(
        num_workers=1, num_servers=1, transport="tcp", adapt=False, datapath="python"
    ) as c:  # a Python link's sender
        (w,) = c.workers
        link = w.links[0]

        def broken(*args):
            raise IndexError("a bug")

        link._pack_push = broken
        t0 = time.monotonic()
        with pytest.raises(Exception, match="the sender to server 0 failed: IndexError"):
            w.push_pull(np.ones(1000, np.float32), "g")
        assert time.monotonic() - t0 < 5


def test_the_settings_are_derived_for_a_worker_s_share_of_its_host_s_link():
    """Workers on one host share its link where the job's traffic crosses it: the four workers on a host whose server
    runs on another get a quarter of the host's 100 Mbit/s each; on two hosts of two, a half. A job all on one host
    (here, as it starts) crosses no link: the rate is not divided."""
    with LocalCluster(num_workers=4, num_servers=1, link_rate="100mbit", adapt=False) as c:
        assert c.scheduler.tuning.workers_per_host == (1,)
        assert c.scheduler.tuning.rate_bytes_per_s == pytest.approx(100e6 / 8)
        c.scheduler.roster.servers[0].host_id = "server-host"
        for hosts, share in (([0, 0, 0, 0], 4), ([0, 0, 1, 1], 2)):
            for node, host in zip(c.scheduler.roster.workers, hosts, strict=True):
                node.host_id = f"host{host}"
            with c.scheduler.roster.lock:
                c.scheduler.adaptation.retune_locked(f"hosts of {share}")
                assert c.scheduler.tuning.workers_per_host == (share,) * (4 // share)
                assert c.scheduler.tuning.rate_bytes_per_s == pytest.approx(100e6 / 8 / share)
                assert f"shared by {share} workers" in c.scheduler.tuning.reason


@pytest.mark.parametrize("told", ["none", "worker 0"])
def test_a_re_cut_under_way_when_the_scheduler_dies_is_ended_by_the_next_one(told):
    """The scheduler dies in step 2 of a re-cut: its RETUNE (where each tensor is cut anew) reached no worker, or
    worker 0 only. A restarted scheduler learns it from the reports and ends it as it ended for the workers told: a
    cancel when none was (their held calls go on, on the old cut), else the same RETUNE to the others (every worker
    re-cuts at one round). Training goes on with every sum right, and later re-cuts are numbered after it."""
    config = {"link_rate": "1mbit", "transport": "tcp", "heartbeat_interval": 0.1, "scheduler_timeout": 20.0}
    with LocalCluster(num_workers=3, num_servers=2, **config) as c:
        _force_drift(c, 125e6)
        interrupted, go = threading.Event(), threading.Event()
        tell = c.scheduler.roster.tell

        def partial_tell(nodes, message):
            if isinstance(message, messages.Retune) and message.recut and not interrupted.is_set():
                tell([n for n in nodes if n.rank == 0] if told == "worker 0" else [], message)
                interrupted.set()
                go.wait(30)  # the scheduler dies meanwhile
                return
            tell(nodes, message)

        c.scheduler.roster.tell = partial_tell
        training = _Training(c)
        try:
            _wait_for(lambda: interrupted.is_set() or not training.alive())
            c.kill_scheduler()
            go.set()
            new = c.restart_scheduler()
            _wait_for(lambda: new.recovery.done.is_set() or not training.alive())
            if told == "worker 0":
                _wait_for(lambda: all(_recut_rounds_done(w, "fc") >= 3 for w in c.workers) or not training.alive())
            else:
                begun = dict(training.stop.begun)
                _wait_for(lambda: all(training.stop.begun.get(r, 0) >= n + 3 for r, n in begun.items()))
        finally:
            training.result()
        assert new.status()["recovered"]["recut_under_way"] == 1
        assert new.adaptation.recuts >= 1  # the next re-cut's successors are named ~2
        successors = [w.table.tensors["fc"].successor for w in c.workers]
        if told == "worker 0":
            assert all(s is not None and s[0] == successors[0][0] for s in successors), successors
        else:
            assert all(s is None or s[1].name.endswith("~2") for s in successors), successors
