"""gradwire.keras on the backend KERAS_BACKEND names (run by test_tensorflow.py once for JAX and once for PyTorch, each
in a process of its own: Keras reads its backend once, at import), on an in-process cluster of 2 workers: training
through DistributedOptimizer equals one process training on the whole batch, and every worker ends with the same
bits."""

import os

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import gradwire  # noqa: E402
import gradwire.keras as gwk  # noqa: E402
from gradwire.testing import LocalCluster  # noqa: E402

N = 2
# Keras's own get_weights/set_weights pass its tensors to numpy through an `__array__` without numpy 2's `copy`
# keyword (on JAX and PyTorch); gradwire's own code takes values out its own way (gradwire/keras/exchange.py)
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_workers=N, num_servers=2, partition_bytes=16 << 10) as c:
        yield c


def run(cluster, fn):
    def wrapped(worker):
        with gradwire.use_worker(worker):
            return fn(worker.rank)

    return cluster.run(wrapped)


def test_the_backend_is_the_one_asked_for():
    assert keras.backend.backend() == os.environ["KERAS_BACKEND"]


def _model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])


def test_fit_through_distributed_optimizer_equals_one_process_on_the_whole_batch(cluster):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    reference = _model(0)
    weights0 = reference.get_weights()

    def fit(model, xs, ys, optimizer, callbacks=()):
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(xs, ys, batch_size=len(xs), epochs=5, shuffle=False, verbose=0, callbacks=list(callbacks))
        return model.get_weights()

    def worker(rank):
        model = _model(rank + 10)  # different weights: the broadcast makes them rank 0's
        if rank == 0:
            model.set_weights(weights0)
        opt = gwk.DistributedOptimizer(keras.optimizers.Adam(0.01))
        return fit(model, x[rank::N], y[rank::N], opt, [gwk.callbacks.BroadcastGlobalVariablesCallback(0)])

    results = run(cluster, worker)
    alone = fit(
        reference, np.concatenate([x[0::2], x[1::2]]), np.concatenate([y[0::2], y[1::2]]), keras.optimizers.Adam(0.01)
    )
    for a, b, c in zip(results[0], results[1], alone, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=2e-4, atol=2e-5)  # float32: the two sums round differently
    assert not np.allclose(results[0][0], weights0[0])  # it trained


def test_allreduce_broadcast_and_allgather_of_backend_values(cluster):
    def worker(rank):
        value = keras.ops.convert_to_tensor(np.full(3, rank + 1.0, "float32"))
        return (
            gwk.allreduce(value, name="k.avg"),
            gwk.allreduce(value, average=False, name="k.sum"),
            gwk.broadcast(value, root_rank=1, name="k.bcast"),
            gwk.allgather(keras.ops.convert_to_tensor(np.full((rank + 1, 2), rank, "int32")), name="k.gather"),
        )

    for avg, total, bcast, gathered in run(cluster, worker):
        np.testing.assert_array_equal(avg, np.full(3, 1.5))
        np.testing.assert_array_equal(total, np.full(3, 3.0))
        np.testing.assert_array_equal(bcast, np.full(3, 2.0))
        np.testing.assert_array_equal(gathered, [[0, 0], [1, 1], [1, 1]])
