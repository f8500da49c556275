"""What the Keras cases on every backend share (tf_cases.py, keras_cases.py): a small model, and `model.fit` through
DistributedOptimizer on 2 in-process workers beside one process fitting the whole batch."""

import keras
import numpy as np

import gradwire.keras as gwk

N = 2


def model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])


def _fit(net, xs, ys, optimizer, callbacks=()):
    net.compile(optimizer=optimizer, loss="mse")
    net.fit(xs, ys, batch_size=len(xs), epochs=5, shuffle=False, verbose=0, callbacks=list(callbacks))
    return net.get_weights()


def fit_in_parallel_and_alone(cluster, x, y):
    """Each worker fits its half of (x, y) (every N-th row) through DistributedOptimizer(Adam), starting from weights
    of its own that the broadcast callback replaces by rank 0's; one process fits the whole batch from rank 0's
    weights. Returns every worker's final weights, the one process's, and the initial ones."""
    reference = model(0)
    weights0 = reference.get_weights()

    def worker(rank):
        net = model(rank + 10)  # different weights: the broadcast makes them rank 0's
        if rank == 0:
            net.set_weights(weights0)
        opt = gwk.DistributedOptimizer(keras.optimizers.Adam(0.01))
        return _fit(net, x[rank::N], y[rank::N], opt, [gwk.callbacks.BroadcastGlobalVariablesCallback(0)])

    results = cluster.run_ranks(worker)
    whole = (np.concatenate([x[r::N] for r in range(N)]), np.concatenate([y[r::N] for r in range(N)]))
    alone = _fit(reference, *whole, keras.optimizers.Adam(0.01))
    return results, alone, weights0
