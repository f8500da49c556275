"""Train a small CNN written with Flax (linen) on scikit-learn's bundled digits (no download), data-parallel.

    pip install 'gradwire[flax]' scikit-learn
    gradwire launch -n 2 -s 1 -- python examples/flax_digits_train.py

Flax's parameters are a pytree and its training step takes any optax transformation: gradwire.jax's
DistributedOptimizer is one, averaging the gradients over the workers inside the jitted step. Rank 0 prints a line
per epoch and, at the end, one JSON summary line.
"""

import argparse
import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import gradwire.jax as gw


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


@jax.jit
def train_step(state: train_state.TrainState, x: jax.Array, y: jax.Array) -> tuple:
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss  # the optimizer averages over the workers first


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    args = parser.parse_args()

    gw.init()
    rank, size = gw.rank(), gw.size()
    digits = load_digits()
    images = digits.images.astype(np.float32)[..., None] / 16.0  # NHWC
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )
    model = CNN()
    params = model.init(jax.random.PRNGKey(rank), x_train[:1])["params"]
    params = gw.broadcast(params, root_rank=0, name="init")  # every worker starts from rank 0's parameters
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=gw.DistributedOptimizer(optax.adam(1e-3))
    )
    batch = args.batch_size * size
    steps = len(x_train) // batch
    order_rng = np.random.default_rng(0)  # the same shuffle on every worker: each takes its slice
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = order_rng.permutation(len(x_train))
        for i in range(steps):
            idx = order[i * batch : (i + 1) * batch][rank::size]
            state, loss = train_step(state, x_train[idx], y_train[idx])
        predictions = model.apply({"params": state.params}, x_test).argmax(-1)
        accuracy = float(jnp.mean(predictions == y_test))
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {float(loss):.3f}, test accuracy {accuracy:.3f}", flush=True)
    if rank == 0:
        summary = {"workers": size, "epochs": args.epochs, "accuracy": accuracy, "seconds": time.perf_counter() - start}
        print(json.dumps(summary), flush=True)
    gw.shutdown()


if __name__ == "__main__":
    main()
