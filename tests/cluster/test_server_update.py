"""Parameter-server mode on the numpy API: servers hold the parameters and optimizer state and apply the
update; synchronous and bounded-staleness asynchronous; reads, writes, errors, failover. In-process clusters with
small partitions, so every parameter spans several keys and servers."""

import threading
import time

import numpy as np
import pytest

import gradwire
from gradwire.errors import TensorError, TensorMismatch
from gradwire.protocol import update
from gradwire.testing import LocalCluster

N = 1000  # elements: several partitions of 1 KiB


def _grad(rank, step, n=N):
    return np.random.default_rng(100 * step + rank).standard_normal(n).astype(np.float32)


def _start(rank):
    return np.random.default_rng(7 + rank).standard_normal(N).astype(np.float32)  # differs by rank


def _train(worker, optimizer, steps, **hyper):
    with gradwire.use_worker(worker):
        gradwire.set_optimizer(optimizer, **hyper)
        w = gradwire.init_parameter(f"w.{optimizer}", _start(worker.rank))
        for step in range(steps):
            w = gradwire.update(f"w.{optimizer}", _grad(worker.rank, step), out=w)
        return w


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_workers=3, num_servers=2, partition_bytes=1024) as c:
        yield c


@pytest.mark.parametrize(
    "optimizer, hyper",
    [
        ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
        ("adam", {"lr": 1e-2, "weight_decay": 1e-2, "amsgrad": True}),
        ("adamw", {"lr": 1e-2}),
        ("adagrad", {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
    ],
)
def test_server_side_update_follows_torch_optimizer_on_the_averaged_gradient(cluster, optimizer, hyper):
    torch = pytest.importorskip("torch")
    results = cluster.run(lambda w: _train(w, optimizer, 8, **hyper))
    for w in results[1:]:
        assert np.array_equal(w, results[0])  # one buffer answers every worker: bit-identical everywhere
    param = torch.nn.Parameter(torch.from_numpy(_start(0)))  # worker 0's start wins
    kwargs = dict(hyper)
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "adagrad": torch.optim.Adagrad}
    reference = cls[optimizer]([param], **kwargs)
    for step in range(8):
        param.grad = torch.from_numpy(sum(_grad(r, step) for r in range(3)) / np.float32(3))
        reference.step()
    # numpy's formulas without torch's fused multiply-adds: the last bits may differ (docs/ps-mode.md)
    np.testing.assert_allclose(results[0], param.detach().numpy(), rtol=2e-5, atol=2e-6)


def test_hyper_parameters_change_at_the_next_update_and_state_reads_back(cluster):
    def job(worker):
        with gradwire.use_worker(worker):
            gradwire.set_optimizer("sgd", lr=0.5, momentum=0.5)
            w = gradwire.init_parameter("sched", np.ones(N, np.float32))
            w = gradwire.update("sched", np.ones(N, np.float32), out=w)  # 1 - 0.5
            gradwire.set_optimizer("sgd", lr=0.0, momentum=0.5)  # a schedule that stops the update
            w = gradwire.update("sched", np.ones(N, np.float32), out=w)
            return w.copy(), gradwire.optimizer_state("sched", w)

    for w, state in cluster.run(job):
        assert np.all(w == 0.5)
        assert state["count"] == 2 and np.all(state["params"] == 0.5)
        assert np.all(state["momentum_buffer"] == 1.5)  # 1, then 0.5 * 1 + 1


def test_init_takes_worker_zeros_parameters(cluster):
    def job(worker):
        with gradwire.use_worker(worker):
            gradwire.set_optimizer("adam")
            return gradwire.init_parameter("init", np.full(10, worker.rank + 1.0, np.float64))

    for w in cluster.run(job):
        assert w.dtype == np.float64 and np.all(w == 1.0)


def test_errors_are_clear(cluster):
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        with gradwire.use_worker(cluster.workers[0]):
            gradwire.set_optimizer("lamb")
    with pytest.raises(ValueError, match="no hyper-parameter momentum"):
        with gradwire.use_worker(cluster.workers[0]):
            gradwire.set_optimizer("adam", momentum=0.9)
    worker = cluster.workers[0]
    with pytest.raises(TensorError, match="float32 or float64"):
        worker.update_async(None, "half", np.zeros(4, np.float16), {"algorithm": "sgd"}, update.READ)

    def disagree(worker):
        with gradwire.use_worker(worker):
            gradwire.set_optimizer("sgd" if worker.rank else "adam")
            try:
                gradwire.init_parameter("disagree", np.zeros(4, np.float32))
            except TensorMismatch as e:
                return str(e)
            return "no error"

    for message in cluster.run(disagree):
        assert "declared differently" in message, message


def test_asynchronous_a_slow_worker_holds_the_others_within_the_staleness_bound():
    bound, steps, slow = 2, 12, 2
    applied = [0, 0, 0]  # pushes each worker has made
    violations = []
    lock = threading.Lock()

    def job(worker):
        with gradwire.use_worker(worker):
            gradwire.set_optimizer("sgd", lr=0.01, staleness=bound)
            w = gradwire.init_parameter("async", np.zeros(N, np.float32))
            for step in range(steps):
                if worker.rank == slow:
                    time.sleep(0.03)
                with lock:
                    applied[worker.rank] += 1
                w = gradwire.update("async", _grad(worker.rank, step), out=w)
                with lock:  # answered: the slowest worker must have pushed at least step + 1 - bound times
                    if min(applied) < step + 1 - bound:
                        violations.append((worker.rank, step, list(applied)))
            return w

    def final(worker):
        with gradwire.use_worker(worker):
            return gradwire.optimizer_state("async", np.zeros(N, np.float32))["params"]

    with LocalCluster(num_workers=3, num_servers=2, partition_bytes=1024) as c:
        c.run(job)
        stats = [s.status()["optimizer"] for s in c.servers]
        results = c.run(final)
    assert not violations, violations
    keys = sum(len(e.keys) for s in c.servers for e in s.engines)
    assert sum(s["updates"] for s in stats) == 3 * steps * keys
    assert max(s["staleness_max"] for s in stats) <= 2 * bound + 2  # updates between a worker's pull and its push
    expected = -0.01 * sum(_grad(r, s) for r in range(3) for s in range(steps)) / np.float32(3)
    # every push applied once, scaled by 1/n: SGD's result is the same sum, in another order
    np.testing.assert_allclose(results[0], expected, rtol=1e-4, atol=1e-5)


def test_a_server_killed_mid_training_goes_on_on_the_replicas():
    """A dead server's partitions go on on their replicas, which applied every update it answered; the job completes,
    every worker with the same parameters, which are those of a failure-free run."""
    steps = 30
    killed = threading.Event()

    def job(worker):
        with gradwire.use_worker(worker):
            gradwire.set_optimizer("sgd", lr=0.05)
            w = gradwire.init_parameter("ft", np.zeros(N, np.float32))
            for step in range(steps):
                if step == steps // 2 and worker.rank == 0:
                    c.kill_server(1)  # the others wait for this worker's push meanwhile
                    killed.set()
                w = gradwire.update("ft", _grad(worker.rank, step), out=w)
            return w

    with LocalCluster(num_workers=3, num_servers=3, partition_bytes=1024) as c:
        results = c.run(job)
        assert killed.is_set() and c.scheduler.failovers
        assert all(w.failovers[-1]["seeds"] > 0 for w in c.workers)  # each resent the parameters it held
        stats = [s.status()["optimizer"] for s in c.servers]
        assert sum(s["restarts"] for s in stats) == 0 and sum(s["replicated"] for s in stats) > 0
    for w in results[1:]:
        assert np.array_equal(w, results[0])
    # plain SGD has no state to lose: the parameters are what a failure-free run gives, to rounding
    expected = -0.05 * sum(sum(_grad(r, s) for r in range(3)) / np.float32(3) for s in range(steps))
    np.testing.assert_allclose(results[0], expected, rtol=1e-4, atol=1e-5)


def _alternating(lam: float, rounds: int, a: np.ndarray, target: np.ndarray, start: np.ndarray, lr: float):
    """Two workers take turns (forced, so the order is deterministic): each pushes the gradient of 0.5 * a * (w -
    target)^2 at the parameters it was last answered with, which the other worker's push has moved since: every
    gradient is one update stale. Returns the final parameters and the servers' optimizer stats."""
    turn = [0]
    cond = threading.Condition()
    # both initialised before the first gradient: a late init is answered with the parameters as they are by then
    # (an asynchronous key's parameters do not wait for anyone), and its worker's first gradient would not be stale
    initialised = threading.Barrier(2, timeout=30)

    def job(worker):
        with gradwire.use_worker(worker):
            gradwire.set_optimizer("sgd", lr=lr, staleness=2, delay_compensation=lam)
            mine = gradwire.init_parameter(f"dc.{lam}", start)
            initialised.wait()
            for _ in range(rounds):
                with cond:
                    assert cond.wait_for(lambda: turn[0] % 2 == worker.rank, 30), f"worker {worker.rank}: no turn"
                mine = gradwire.update(f"dc.{lam}", a * (mine - target))
                with cond:
                    turn[0] += 1
                    cond.notify_all()
            return mine

    with LocalCluster(num_workers=2, num_servers=2, partition_bytes=1024) as c:
        results = c.run(job)
        stats = [s.status()["optimizer"] for s in c.servers]
    return results[1], stats  # worker 1 pushed last: its answer is the final parameters


def test_delay_compensation_corrects_each_stale_gradient_and_brings_async_closer_to_synchronous():
    """DC-ASGD on the servers (server/optimizer_op.py): each stale gradient g, computed at w_old and applied at w_now,
    is applied as g + lambda * g * g * (w_now - w_old) (checked against that formula step by step), and on a convex
    problem whose curvature that term estimates, asynchronous training with it ends closer to synchronous training
    (every gradient fresh) than without it. lambda = 0 declares and runs exactly the asynchronous mode without it."""
    rng = np.random.default_rng(0)
    a = rng.uniform(0.5, 1.0, N).astype(np.float32)  # the curvature; lambda * g^2 <= a keeps the correction short
    target = rng.standard_normal(N).astype(np.float32)
    start = target + np.float32(1.0)
    lr, rounds, lam = 0.5, 3, 1.0

    def simulated(lam):
        w, answered = start.copy(), [start.copy(), start.copy()]
        for _ in range(rounds):
            for k in (0, 1):
                g = a * (answered[k] - target)
                w = w - np.float32(lr) * ((g + np.float32(lam) * g * g * (w - answered[k])) / np.float32(2))
                answered[k] = w.copy()
        return w

    synchronous = start.copy()
    for _ in range(2 * rounds):
        synchronous = synchronous - np.float32(lr) * (a * (synchronous - target)) / np.float32(2)
    plain, plain_stats = _alternating(0.0, rounds, a, target, start, lr)
    compensated, dc_stats = _alternating(lam, rounds, a, target, start, lr)
    np.testing.assert_allclose(plain, simulated(0.0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(compensated, simulated(lam), rtol=1e-5, atol=1e-6)
    error_plain = np.linalg.norm(plain - synchronous)
    error_dc = np.linalg.norm(compensated - synchronous)
    assert error_dc < 0.75 * error_plain, (error_dc, error_plain)
    keys = sum(s["keys"] for s in dc_stats)  # the parameter's partitions (each with its trailer, in 1 KiB)
    assert keys > 1
    assert sum(s["delay_compensated"] for s in dc_stats) == 2 * rounds * keys
    assert sum(s["delay_compensated"] for s in plain_stats) == 0
    # the parameters each of the 2 workers was last answered with, and a scratch: 3 copies of the parameters
    assert sum(s["delay_compensation_bytes"] for s in dc_stats) == 3 * N * 4
    assert sum(s["delay_compensation_bytes"] for s in plain_stats) == 0


def test_delay_compensation_needs_asynchronous_mode():
    with pytest.raises(ValueError, match="staleness > 0"):
        update.check_args({"algorithm": "sgd", "delay_compensation": 0.5})
    with pytest.raises(ValueError, match="number >= 0"):
        update.check_args({"algorithm": "sgd", "staleness": 1, "delay_compensation": -1})
    assert "delay_compensation" not in update.check_args({"algorithm": "sgd", "staleness": 1, "delay_compensation": 0})


def test_delay_compensations_state_restarts_with_the_parameters_after_a_failover():
    """A key's copies of what each worker was answered with start afresh when its parameters are installed anew (a
    replacement server seeded by a worker): that worker's next push goes uncorrected until it is answered again."""
    from gradwire.server.held import Held
    from gradwire.server.optimizer_op import ServerUpdate

    op = ServerUpdate({"algorithm": "sgd", "staleness": 1, "delay_compensation": 0.5, "impl": "numpy"})
    held = Held(op.args, 4, np.dtype(np.float32), num_workers=2)
    held.install(np.zeros(4, np.float32))
    held.remember(0)
    held.params += np.float32(2.0)  # two updates by others since worker 0's answer
    g = np.full(4, 3.0, np.float32)
    np.testing.assert_array_equal(held.compensate(0, g), g + 0.5 * g * g * 2.0)
    assert held.compensate(1, g) is g  # worker 1 was never answered: nothing to correct by
    assert held.dc_bytes == 3 * 4 * 4  # two workers' copies and a scratch
    held.install(np.ones(4, np.float32))  # seeded after a failover
    assert held.compensate(0, g) is g and held.compensated == 1
