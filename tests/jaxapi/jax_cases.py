"""gradwire.jax on an in-process cluster of 2 workers: pytrees summed and broadcast inside and outside jax.jit, and
optax training through DistributedOptimizer equal to one process training on the whole batch.

Run by test_jax.py in a pytest process of its own: JAX starts threads at import, and a process that forks after that
(Ray's tests do) may deadlock, which JAX warns of."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

import gradwire.jax as gwj  # noqa: E402
from gradwire.testing import LocalCluster  # noqa: E402

N = 2


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_workers=N, num_servers=2, partition_bytes=16 << 10) as c:
        yield c


def _tree(rank):
    return {
        "w": jnp.full((3, 4), rank + 1.0, jnp.float32),
        "b": [jnp.arange(5, dtype=jnp.int32) * (rank + 1), jnp.full((2,), rank + 1.0, jnp.bfloat16)],
        "h": jnp.full((7,), rank + 1.0, jnp.float16),
    }


def test_a_pytree_is_summed_or_averaged_outside_and_inside_jit_with_its_structure_and_dtypes(cluster):
    def worker(rank):
        tree = _tree(rank)
        outside = gwj.allreduce(tree, average=False, name="tree.sum")
        step = jax.jit(lambda t: gwj.allreduce(t, name="tree.avg"))  # one function per worker: each its own trace
        inside = [step(jax.tree_util.tree_map(lambda x, i=i: x * (i + 1), tree)) for i in range(3)]  # same keys
        return outside, inside

    total = 1 + 2
    for outside, inside in cluster.run_ranks(worker):
        assert outside["w"].dtype == jnp.float32 and outside["b"][1].dtype == jnp.bfloat16
        assert outside["h"].dtype == jnp.float16 and outside["b"][0].dtype == jnp.int32
        np.testing.assert_array_equal(outside["w"], np.full((3, 4), total, np.float32))
        np.testing.assert_array_equal(outside["b"][0], np.arange(5) * total)
        np.testing.assert_array_equal(np.asarray(outside["b"][1], np.float32), [total, total])
        np.testing.assert_array_equal(np.asarray(outside["h"], np.float32), np.full(7, total))
        for i, got in enumerate(inside):
            np.testing.assert_allclose(got["w"], np.full((3, 4), total / N * (i + 1)))


def test_broadcast_gives_every_worker_the_roots_tree(cluster):
    def worker(rank):
        return gwj.broadcast(_tree(rank), root_rank=1, name="tree.bcast")

    for got in cluster.run_ranks(worker):
        np.testing.assert_array_equal(got["w"], np.full((3, 4), 2.0))
        np.testing.assert_array_equal(got["b"][0], np.arange(5) * 2)


def _loss(params, x, y):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"] + params["b2"]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 3), axis=-1))


def _params(seed):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "w1": jax.random.normal(k1, (6, 16)) * 0.3,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 3)) * 0.3,
        "b2": jnp.zeros(3),
    }


@pytest.mark.parametrize("chain", [False, True])
def test_training_with_distributed_optimizer_equals_one_process_on_the_whole_batch(cluster, chain):
    """Each worker trains on its half of every batch; the average of the halves' gradients is the whole batch's, so
    Adam's steps (nonlinear in the gradient) match a single process's, and so do the parameters."""
    rng = np.random.default_rng(3)
    data = [(rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8)) for _ in range(5)]
    reference = _params(0)
    tx = optax.adam(0.05)
    state = tx.init(reference)
    for x, y in data:
        grads = jax.grad(_loss)(reference, x, y)
        updates, state = tx.update(grads, state, reference)
        reference = optax.apply_updates(reference, updates)

    def worker(rank):
        params = gwj.broadcast(_params(rank), root_rank=0, name=f"start.{chain}")  # rank 1 starts elsewhere
        name = f"grads.{chain}"
        opt = (
            optax.chain(gwj.distributed(name=name), optax.adam(0.05))
            if chain
            else gwj.DistributedOptimizer(optax.adam(0.05), name=name)
        )
        opt_state = opt.init(params)

        @jax.jit
        def step(params, opt_state, x, y):
            updates, opt_state = opt.update(jax.grad(_loss)(params, x, y), opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        for x, y in data:
            half = slice(rank * 4, (rank + 1) * 4)
            params, opt_state = step(params, opt_state, x[half], y[half])
        return params

    for params in cluster.run_ranks(worker):
        for key in reference:
            np.testing.assert_allclose(params[key], reference[key], rtol=2e-5, atol=2e-6)
