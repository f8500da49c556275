"""Train an MLP on scikit-learn's bundled digits (8x8 images, no download) with JAX and optax, data-parallel.

    pip install 'gradwire[jax]' scikit-learn
    gradwire launch -n 2 -s 1 -- python examples/jax_digits_train.py

Each worker takes its share of every batch; gradwire.jax.DistributedOptimizer averages the gradients over the workers
inside the jitted step, before Adam. Rank 0 prints a line per epoch and, at the end, one JSON summary line.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import gradwire.jax as gw


def init_params(key: jax.Array, sizes: tuple[int, ...] = (64, 128, 10)) -> list[dict]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (m, n)) * jnp.sqrt(2.0 / m), "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def logits(params: list[dict], x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss(params: list[dict], x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    gw.init()
    rank, size = gw.rank(), gw.size()
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data.astype(np.float32) / 16.0, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )
    params = gw.broadcast(init_params(jax.random.PRNGKey(rank)), root_rank=0, name="init")  # rank 0's everywhere
    tx = gw.DistributedOptimizer(optax.adam(args.lr))
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = tx.update(grads, state, params)  # the average over the workers, then Adam
        return optax.apply_updates(params, updates), state, value

    batch = args.batch_size * size
    steps = len(x_train) // batch
    order_rng = np.random.default_rng(0)  # the same shuffle on every worker: each takes its slice
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = order_rng.permutation(len(x_train))
        for i in range(steps):
            idx = order[i * batch : (i + 1) * batch][rank::size]
            params, state, value = step(params, state, x_train[idx], y_train[idx])
        accuracy = float((logits(params, x_test).argmax(-1) == y_test).mean())
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {float(value):.3f}, test accuracy {accuracy:.3f}", flush=True)
    if rank == 0:
        summary = {"workers": size, "epochs": args.epochs, "accuracy": accuracy, "seconds": time.perf_counter() - start}
        print(json.dumps(summary), flush=True)
    gw.shutdown()


if __name__ == "__main__":
    main()
