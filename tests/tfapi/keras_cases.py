"""gradwire.keras on the backend KERAS_BACKEND names (run by test_tensorflow.py once for JAX and once for PyTorch, each
in a process of its own: Keras reads its backend once, at import), on an in-process cluster of 2 workers: training
through DistributedOptimizer equals one process training on the whole batch, and every worker ends with the same
bits."""

import os

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import gradwire.keras as gwk  # noqa: E402
from gradwire.testing import LocalCluster  # noqa: E402
from tests.tfapi.keras_fit import N, fit_in_parallel_and_alone  # noqa: E402

# Keras's own get_weights/set_weights pass its tensors to numpy through an `__array__` without numpy 2's `copy`
# keyword (on JAX and PyTorch); gradwire's own code takes values out its own way (gradwire/keras/exchange.py)
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_workers=N, num_servers=2, partition_bytes=16 << 10) as c:
        yield c


def test_the_backend_is_the_one_asked_for():
    assert keras.backend.backend() == os.environ["KERAS_BACKEND"]


def test_fit_through_distributed_optimizer_equals_one_process_on_the_whole_batch(cluster):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    results, alone, weights0 = fit_in_parallel_and_alone(cluster, x, y)
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

    for avg, total, bcast, gathered in cluster.run_ranks(worker):
        np.testing.assert_array_equal(avg, np.full(3, 1.5))
        np.testing.assert_array_equal(total, np.full(3, 3.0))
        np.testing.assert_array_equal(bcast, np.full(3, 2.0))
        np.testing.assert_array_equal(gathered, [[0, 0], [1, 1], [1, 1]])
