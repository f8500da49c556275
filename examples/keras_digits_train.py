"""Train a small Keras 3 model on scikit-learn's bundled digits (8x8 images, no download), data-parallel, on any
Keras backend (KERAS_BACKEND=tensorflow, jax or torch).

    pip install 'gradwire[tensorflow]' scikit-learn          # or Keras with JAX or PyTorch
    gradwire launch -n 2 -s 1 -- python examples/keras_digits_train.py

Each worker fits on its share of the training set (every size-th example); gradwire.keras.DistributedOptimizer
averages the gradients over the workers in every step, the callbacks start every worker from rank 0's variables,
warm the learning rate up and average the epoch's logs. Every worker prints a digest of its weights at the end (the
same on all of them); rank 0 prints one JSON summary line.
"""

import argparse
import hashlib
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import gradwire.keras as gw  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=1e-3, help="per worker; scaled by the number of workers")
    args = parser.parse_args()

    gw.init()
    rank, size = gw.rank(), gw.size()
    keras.utils.set_random_seed(rank)  # different initial weights: the broadcast must make them equal
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data.astype(np.float32) / 16.0, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    scaled_lr = args.lr * size
    model.compile(
        optimizer=gw.DistributedOptimizer(keras.optimizers.Adam(scaled_lr)),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    callbacks = [
        gw.callbacks.BroadcastGlobalVariablesCallback(0),
        gw.callbacks.MetricAverageCallback(),
        gw.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1),
    ]
    start = time.perf_counter()
    history = model.fit(
        x_train[rank::size],
        y_train[rank::size],
        batch_size=args.batch_size,
        epochs=args.epochs,
        shuffle=False,  # every worker takes as many steps (a shard's size differs by at most one example)
        callbacks=callbacks,
        verbose=2 if rank == 0 else 0,
    )
    seconds = time.perf_counter() - start
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    digest = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).hexdigest()[:16]
    print(f"weights {digest}", flush=True)
    if rank == 0:
        summary = {
            "backend": keras.backend.backend(),
            "workers": size,
            "epochs": args.epochs,
            "loss": history.history["loss"][-1],
            "accuracy": float(accuracy),
            "seconds": seconds,
        }
        print(json.dumps(summary), flush=True)
    gw.shutdown()


if __name__ == "__main__":
    main()
