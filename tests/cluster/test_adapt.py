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


def _train(worker, steps, stop=None, seed=0):
    """Steps of a training-like loop: every tensor each step, in an order and with pauses of the worker's own (as
    backward hooks fire), each checked against the sum the workers must get."""
    rng = random.Random(seed * 100 + worker.rank)
    n = worker.size
    step = 0
    while step < steps and not (stop is not None and stop.is_set()):
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


def _wait_for(predicate, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_links_faster_than_measured_get_larger_partitions_mid_job():
    """The settings were derived for 1 Mbit/s (GRADWIRE_LINK_RATE): the smallest partitions. Loopback moves far more:
    after three intervals the scheduler derives them again for the measured rate, and the tensors in use are re-cut
    (new keys) at one round on every worker while they train; every sum stays right."""
    with LocalCluster(num_workers=3, num_servers=2, link_rate="1mbit", transport="tcp", heartbeat_interval=0.1) as c:
        first = dict(c.scheduler.tuning)
        assert first["partition_bytes"] == 16 << 10
        stop = threading.Event()
        results: list = []

        def train():
            try:
                results.append(c.run(lambda w: _train(w, 10_000, stop)))
            except BaseException as e:  # noqa: BLE001 - reported below
                results.append(e)

        runner = threading.Thread(target=train)
        runner.start()
        try:
            _wait_for(lambda: all(w.recuts for w in c.workers) or not runner.is_alive())
            time.sleep(0.3)  # train on the new partitions a while
        finally:
            stop.set()
            runner.join(60)
        assert not runner.is_alive() and results, "training did not finish"
        assert not isinstance(results[0], BaseException), results[0]
        assert min(results[0]) > 0
        now = c.scheduler.tuning
        assert now["partition_bytes"] > first["partition_bytes"]
        assert "measured over 3 intervals" in now["derived_for"]
        history = c.scheduler.adaptation.history
        assert max(h["recut_tensors"] for h in history) >= 2  # fc and big (conv and bias fit one partition)
        for w in c.workers:
            tensor = w._tensors["fc"]
            assert tensor.successor is not None  # re-cut, at one round on every worker
            assert [t.successor[0] for t in w._chain(tensor)[:-1]] == [
                t.successor[0] for t in c.workers[0]._chain(c.workers[0]._tensors["fc"])[:-1]
            ]
            assert len(w._chain(tensor)[-1].parts) < len(tensor.parts)
            assert w.status()["data_path"]["partition_bytes"] == now["partition_bytes"]
        status = c.scheduler.adaptation.status()
        assert status["rederived"] and status["last_interval"]["measured_bytes_per_s"] > 0


def test_an_explicit_partition_size_is_never_re_cut():
    with LocalCluster(
        num_workers=2,
        num_servers=1,
        link_rate="1mbit",
        transport="tcp",
        heartbeat_interval=0.1,
        partition_bytes=16 << 10,
    ) as c:
        stop = threading.Event()
        runner = threading.Thread(target=lambda: c.run(lambda w: _train(w, 10_000, stop)))
        runner.start()
        try:
            history = c.scheduler.adaptation.history
            _wait_for(lambda: any(h["partition_bytes"] > 16 << 10 for h in history) or not runner.is_alive())
            _wait_for(lambda: c.scheduler.adaptation.pending is None)
            time.sleep(0.2)
        finally:
            stop.set()
            runner.join(60)
        assert all(h["recut_tensors"] == 0 for h in history)
        for w in c.workers:
            assert w._tensors["fc"].successor is None and not w.recuts
            assert w.status()["data_path"]["partition_bytes"] == 16 << 10


def test_off_with_gradwire_adapt_0():
    with LocalCluster(
        num_workers=2, num_servers=1, link_rate="1mbit", transport="tcp", heartbeat_interval=0.1, adapt=False
    ) as c:
        c.run(lambda w: _train(w, 15))
        time.sleep(0.5)
        assert not c.scheduler.adaptation.history and c.scheduler.tuning["partition_bytes"] == 16 << 10


def test_a_held_round_waits_for_the_scheduler_and_no_longer():
    """Step 1 of a re-cut holds a tensor's calls two rounds past the round reported; the RETUNE releases them, and
    a scheduler that never sends it fails the call after the timeout instead of hanging."""
    with LocalCluster(num_workers=1, num_servers=1, transport="tcp", adapt=False) as c:
        (w,) = c.workers
        w.config = dataclasses.replace(w.config, timeout=1.0)
        x = np.ones(100_000, np.float32)
        w.push_pull(x, "g")
        sent = []
        w._scheduler.send_json = lambda kind, body: sent.append(body)  # keep the answer from the scheduler
        w._recut_rounds({"op": messages.RECUT, "generation": 7})
        assert [b["rounds"] for b in sent if b["op"] == messages.RECUT_ROUNDS] == [{"g": 1}]
        w.push_pull(x, "g")  # round 2: not held
        with pytest.raises(GradwireTimeout, match="re-cut 7"):
            w.push_pull(x, "g")  # round 3: held, and nobody answers
        w._on_retune({"op": messages.RETUNE, "tuning": w.tuning, "switch": {}, "generation": 7})
        assert w.push_pull(x, "g")[0] == 1.0
