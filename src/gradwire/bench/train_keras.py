"""End-to-end Keras training as a benchmark: `python -m gradwire.bench.train_keras {keras|mwms} STEPS WARMUP`.

The model of bench/train.py (a conv stack with BatchNorm, then a 3M-parameter MLP: layers of mixed sizes), written in
Keras 3 on TensorFlow, trained by a `tf.function` step on each worker's own random batches of 32, SGD with momentum:
- `keras`: gradwire.keras's DistributedOptimizer (the gradients leave the compiled step for the summation servers);
- `mwms`: TensorFlow's own MultiWorkerMirroredStrategy over its ring (CommunicationImplementation.RING; TF_CONFIG
  names every worker, as `gradwire.netem.jobs.start_tf_ring` sets it), the peer.
Rank 0 prints one JSON line: every timed step's seconds, the samples per step and the parameter count.
`python -m gradwire.bench.train_keras bridge` prints what leaving the TensorFlow graph costs a step (`bridge_cost`).
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

BATCH = 32


def model():
    import keras

    keras.utils.set_random_seed(0)
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            layers.Conv2D(32, 3, padding="same"),
            layers.BatchNormalization(),
            layers.ReLU(),
            layers.Conv2D(64, 3, padding="same"),
            layers.BatchNormalization(),
            layers.ReLU(),
            layers.MaxPooling2D(4),
            layers.Flatten(),
            layers.Dense(768, activation="relu"),
            layers.Dense(768, activation="relu"),
            layers.Dense(10),
        ]
    )


def _distributed(way: str):
    """The model and its optimizer made distributed `way`'s way, the strategy (MWMS) or None, this worker's rank and
    the number of workers."""
    import keras
    import tensorflow as tf

    if way == "mwms":
        ring = tf.distribute.experimental.CommunicationImplementation.RING
        options = tf.distribute.experimental.CommunicationOptions(implementation=ring)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        with strategy.scope():
            net, opt = model(), keras.optimizers.SGD(0.01, momentum=0.9)
            opt.build(net.trainable_variables)
        return net, opt, strategy, strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync
    import gradwire.keras as gw

    gw.init()
    net, opt = model(), gw.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9))
    opt.build(net.trainable_variables)
    return net, opt, None, gw.rank(), gw.size()


def main(way: str, steps: int, warmup: int) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)  # as bench/train.py's torch.set_num_threads(1)
    net, opt, strategy, rank, world = _distributed(way)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(rank)

    def step(x: tf.Tensor, y: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, net(x, training=True))
        grads = tape.gradient(loss, net.trainable_variables)
        opt.apply_gradients(zip(grads, net.trainable_variables, strict=True))  # gradwire: averaged in `apply`

    if strategy is None:
        train_step = tf.function(step)
    else:
        train_step = tf.function(lambda x, y: strategy.run(step, args=(x, y)))  # MWMS: its ring averages
    times = []
    for i in range(warmup + steps):
        x = tf.constant(rng.normal(size=(BATCH, 32, 32, 3)).astype("float32"))
        y = tf.constant(rng.integers(0, 10, BATCH))
        t0 = time.perf_counter()
        train_step(x, y)
        float(net.trainable_variables[-1][0])  # the step is done (its update is readable)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        params = int(sum(np.prod(w.shape) for w in net.trainable_weights))
        row = {"way": way, "times": times, "samples_per_step": BATCH * world, "parameters": params}
        print(json.dumps(row))
        sys.stdout.flush()
    if strategy is None:
        import gradwire.keras as gw

        gw.shutdown()
    sys.stdout.flush()
    os._exit(0)  # TensorFlow's collective threads need not wind down: the job is done


def bridge_cost(repeats: int = 40) -> dict:
    """What leaving the TensorFlow graph costs a step (`python -m gradwire.bench.train_keras bridge`): one process, the
    model's forward and backward inside `tf.function`, alone, with its gradients handed out of the graph to a
    `tf.numpy_function` and back (an identity), and with a grouped allreduce through a 1-worker, 1-server job on
    loopback. Medians over `repeats` steps, in seconds."""
    import statistics

    import keras
    import tensorflow as tf

    import gradwire
    import gradwire.tensorflow as gwt
    from gradwire.session import use_worker
    from gradwire.testing import LocalCluster

    tf.config.threading.set_intra_op_parallelism_threads(1)
    net = model()
    x, y = tf.random.normal([BATCH, 32, 32, 3]), tf.zeros([BATCH], tf.int64)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def grads() -> list:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, net(x, training=True))
        return tape.gradient(loss, net.trainable_variables)

    def identity(*arrays: object) -> list:
        return list(arrays)

    def handed_out() -> list:
        g = grads()
        return tf.numpy_function(identity, g, [t.dtype for t in g], stateful=True)

    def timed(step) -> float:
        step = tf.function(step)
        step(), step()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            float(tf.reduce_sum(step()[-1]))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    row = {"backward": timed(grads), "handed_out": timed(handed_out)}
    with LocalCluster(num_workers=1, num_servers=1) as cluster:

        def reduced(worker: gradwire.Worker) -> float:
            with use_worker(worker):
                return timed(lambda: gwt.grouped_allreduce(grads(), name="bench.bridge"))

        (row["grouped_allreduce"],) = cluster.run(reduced)
    return row


if __name__ == "__main__":
    if sys.argv[1] == "bridge":
        print(json.dumps(bridge_cost()))
    else:
        main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
