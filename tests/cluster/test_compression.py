"""Compressed sums through the servers (docs/compression.md): every worker receives the same bytes, error feedback on
both sides makes the running sum converge to the exact one, small and non-float32 tensors travel as they are, the
bytes on the wire shrink as the method says, a failover keeps the workers identical, and EF-sign SGD trains a convex
problem as far as plain SGD."""

import threading

import numpy as np
import pytest

from gradwire import compression
from gradwire.errors import TensorMismatch
from gradwire.testing import LocalCluster

METHODS = {
    "onebit": compression.onebit(),
    "topk": compression.topk(0.05),
    "randomk": compression.randomk(0.1),
    "dithering": compression.dithering(),
}


def _gradient(rank: int, step: int, n: int = 50_000) -> np.ndarray:
    rng = np.random.default_rng(rank * 7919 + step)
    return (rng.standard_normal(n) * (1 + rank)).astype(np.float32)


@pytest.mark.parametrize("method", METHODS)
def test_every_worker_receives_the_same_sum_and_its_running_mean_converges(method):
    """A constant gradient per worker, T rounds: with error feedback what is dropped is sent later, so the mean of the
    results approaches the exact average (the error shrinks with T); dithering is unbiased instead."""
    steps = 30
    with LocalCluster(num_workers=3, num_servers=2, partition_bytes=64 << 10) as c:

        def job(w):
            g = _gradient(w.rank, 0)
            return [w.push_pull(g, "g", average=True, compression=METHODS[method]) for _ in range(steps)]

        results = c.run(job)
    for step in range(steps):
        assert results[0][step].tobytes() == results[1][step].tobytes() == results[2][step].tobytes()
    exact = np.mean([_gradient(r, 0) for r in range(3)], axis=0)
    running = np.cumsum(results[0], axis=0) / np.arange(1, steps + 1)[:, None]
    error = np.linalg.norm(running - exact, axis=1) / np.linalg.norm(exact)
    assert error[-1] < 0.5 * error[0] and error[-1] < 0.8 * error[steps // 2], error


def test_small_and_non_float32_tensors_travel_as_they_are():
    with LocalCluster(num_workers=2, num_servers=1) as c:

        def job(w):
            small = np.full(1000, w.rank + 0.5, np.float32)  # 4 KB, under GRADWIRE_COMPRESSION_MIN_BYTES
            wide = np.full(40_000, w.rank + 0.25, np.float64)
            ints = np.full(40_000, w.rank + 1, np.int32)
            return [
                w.push_pull(a, n, compression=METHODS["onebit"].args)
                for n, a in (("s", small), ("d", wide), ("i", ints))
            ]

        for small, wide, ints in c.run(job):
            assert np.all(small == 2.0) and np.all(wide == 1.5) and np.all(ints == 3)


def test_the_wire_carries_a_32nd_with_onebit():
    with LocalCluster(num_workers=2, num_servers=2, partition_bytes=256 << 10) as c:

        def job(w, comp):
            before = w.state.metrics.bytes_pushed
            w.push_pull(_gradient(w.rank, 0, 1 << 20), f"g{comp is None}", compression=comp)
            return w.state.metrics.bytes_pushed - before

        plain = c.run(lambda w: job(w, None))
        packed = c.run(lambda w: job(w, METHODS["onebit"].args))
    assert plain[0] == 4 << 20
    assert 30 < plain[0] / packed[0] < 32  # a scale per partition, and padding to whole words


def test_workers_that_disagree_on_the_compressor_are_told_before_anything_moves():
    with LocalCluster(num_workers=2, num_servers=1) as c:

        def job(w):
            comp = METHODS["onebit"] if w.rank == 0 else METHODS["topk"]
            with pytest.raises(TensorMismatch, match="worker 0.*worker 1"):
                w.push_pull(_gradient(w.rank, 0), "g", compression=comp.args)

        c.run(job)


def test_a_failover_keeps_every_worker_identical():
    # equal placement: every server holds keys whatever the links measure (on a loaded machine the measured placement
    # can leave server 1 none, and then it is never killed)
    with LocalCluster(num_workers=3, num_servers=3, partition_bytes=16 << 10, placement="equal") as c:
        killed = threading.Event()

        def kill():
            while c.servers[1].rounds_completed < 10:
                killed.wait(0.001)
            c.kill_server(1)
            killed.set()

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()

        def job(w):
            out = []
            for step in range(12):
                if step == 10:
                    killed.wait(30)
                out.append(w.push_pull(_gradient(w.rank, step), "g", average=True, compression=METHODS["onebit"].args))
            return out

        results = c.run(job)
        killer.join(30)
        moved = c.servers[1].status()["compression"]["keys"]
        restarted = [s.status()["compression"]["residual_restarts"] for i, s in enumerate(c.servers) if i != 1]
    assert killed.is_set()
    # the dead server's keys continue on the others, each residual from zero, and counted so
    assert moved > 0 and sum(restarted) == moved
    for step in range(12):
        assert results[0][step].tobytes() == results[1][step].tobytes() == results[2][step].tobytes()


def test_ef_sign_sgd_reaches_the_loss_of_plain_sgd_on_a_convex_problem():
    """Least squares split across 2 workers: SGD on the averaged gradient, plain and onebit with error feedback."""
    rng = np.random.default_rng(0)
    n, d = 400, 20_000
    a = rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d)
    b = a @ rng.standard_normal(d).astype(np.float32)

    def loss(x):
        return float(0.5 * np.sum((a @ x - b) ** 2))

    def train(w, comp, steps=80, lr=1.0):
        rows = slice(w.rank * n // 2, (w.rank + 1) * n // 2)
        x = np.zeros(d, np.float32)
        for _ in range(steps):
            grad = (a[rows].T @ (a[rows] @ x - b[rows])).astype(np.float32)
            x -= lr * w.push_pull(grad, f"x{comp is None}", average=True, compression=comp)
        return x

    with LocalCluster(num_workers=2, num_servers=1, partition_bytes=64 << 10) as c:
        plain = c.run(lambda w: train(w, None))
        signs = c.run(lambda w: train(w, METHODS["onebit"].args))
    start = loss(np.zeros(d, np.float32))
    assert np.array_equal(signs[0], signs[1])
    print(f"loss from {start:.3g}: plain SGD {loss(plain[0]):.3g}, onebit with error feedback {loss(signs[0]):.3g}")
    assert loss(plain[0]) < 1e-3 * start
    assert loss(signs[0]) < 1e-2 * start
