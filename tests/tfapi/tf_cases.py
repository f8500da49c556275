"""gradwire.tensorflow and gradwire.keras (TensorFlow backend) on an in-process cluster of 2 workers: each collective
eagerly and inside tf.function, Horovod's gradients, DistributedGradientTape and Keras training through
DistributedOptimizer equal to one process training on the whole batch.

Run by test_tensorflow.py in a pytest process of its own: TensorFlow starts threads at import, and a process that
forks after that (Ray's tests do) may deadlock."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["KERAS_BACKEND"] = "tensorflow"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
# one process holds every worker here, and a worker's call inside tf.function blocks a thread of TensorFlow's
# inter-op pool until the others' arrive: the pool needs a thread per worker (a real job has a process each)
tf.config.threading.set_inter_op_parallelism_threads(8)

import gradwire  # noqa: E402
import gradwire.keras as gwk  # noqa: E402
import gradwire.tensorflow as gw  # noqa: E402
from gradwire.testing import LocalCluster  # noqa: E402
from tests.tfapi.keras_fit import N, fit_in_parallel_and_alone  # noqa: E402
from tests.tfapi.keras_fit import model as keras_model  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_workers=N, num_servers=2, partition_bytes=16 << 10) as c:
        yield c


def test_allreduce_reduces_by_each_op_eagerly_and_inside_tf_function_reusing_its_keys(cluster):
    def worker(rank):
        x = tf.constant([1.0, -2.0, 3.0]) * (rank + 1)
        eager = {op: gw.allreduce(x, op=op, name=f"ar.{op}").numpy() for op in (gw.Average, gw.Sum, gw.Min, gw.Max)}
        eager["product"] = gw.allreduce(x, op=gw.Product, name="ar.product").numpy()
        eager["scaled"] = gw.allreduce(x, op=gw.Sum, prescale_factor=2.0, postscale_factor=0.5, name="ar.sc").numpy()
        eager["ints"] = gw.allreduce(tf.constant([rank, 10], tf.int64), op=gw.Sum, name="ar.int").numpy()
        eager["fp16"] = gw.allreduce(x, compression=gw.Compression.fp16, name="ar.fp16").numpy()
        step = tf.function(lambda t: gw.allreduce(t, op=gw.Sum))  # one function per worker: each its own trace
        inside = [step(x * i).numpy() for i in range(1, 4)]
        keys = gradwire.current_worker().status()["tensors"]
        step(x)
        return eager, inside, keys, gradwire.current_worker().status()["tensors"]

    base = np.array([1.0, -2.0, 3.0])
    for eager, inside, keys_before, keys_after in cluster.run_ranks(worker):
        np.testing.assert_allclose(eager["average"], base * 1.5)
        np.testing.assert_allclose(eager["sum"], base * 3)
        np.testing.assert_allclose(eager["min"], [1.0, -4.0, 3.0])
        np.testing.assert_allclose(eager["max"], [2.0, -2.0, 6.0])
        np.testing.assert_allclose(eager["product"], base * base * 2)
        np.testing.assert_allclose(eager["scaled"], base * 3)
        np.testing.assert_array_equal(eager["ints"], [1, 20])
        assert eager["fp16"].dtype == np.float32
        np.testing.assert_allclose(eager["fp16"], base * 1.5)
        for i, got in enumerate(inside, start=1):
            np.testing.assert_allclose(got, base * 3 * i)
        assert keys_after == keys_before  # a traced function's calls reuse the tensor named when it was traced


def test_grouped_allreduce_fuses_dtypes_and_keeps_shapes_and_dtypes(cluster):
    def worker(rank):
        tensors = [
            tf.fill([2, 3], float(rank + 1)),
            tf.constant([rank + 1, 5], tf.int32),
            tf.cast(tf.fill([4], rank + 1.0), tf.bfloat16),
            tf.constant(float(rank), tf.float64),
        ]
        eager = gw.grouped_allreduce(tensors, op=gw.Sum, name="grouped")
        inside = tf.function(lambda ts: gw.grouped_allreduce(ts, op=gw.Average))(tensors)
        return eager, inside

    for eager, inside in cluster.run_ranks(worker):
        assert [t.dtype for t in eager] == [tf.float32, tf.int32, tf.bfloat16, tf.float64]
        assert [t.shape.as_list() for t in inside] == [[2, 3], [2], [4], []]
        np.testing.assert_array_equal(eager[0].numpy(), np.full((2, 3), 3.0))
        np.testing.assert_array_equal(eager[1].numpy(), [3, 10])
        np.testing.assert_array_equal(tf.cast(eager[2], tf.float32).numpy(), np.full(4, 3.0))
        assert float(eager[3]) == 1.0 and float(inside[3]) == 0.5
        np.testing.assert_array_equal(inside[0].numpy(), np.full((2, 3), 1.5))


def test_the_gradient_of_an_allreduce_is_the_allreduce_of_the_gradients(cluster):
    def worker(rank):
        x = tf.Variable([1.0, 2.0])
        with tf.GradientTape() as tape:
            y = gw.allreduce(x * (rank + 1), op=gw.Sum, name="grad.sum")
            loss = tf.reduce_sum(y * tf.constant([1.0, 10.0]) * (rank + 1))
        return tape.gradient(loss, x).numpy()

    # d loss_r / d y = c * (r + 1); the sum's gradient sums them over ranks (c * 3), times d(x * (r + 1)) / dx
    for rank, grad in enumerate(cluster.run_ranks(worker)):
        np.testing.assert_allclose(grad, np.array([1.0, 10.0]) * 3 * (rank + 1))


def test_allgather_broadcast_alltoall_and_reducescatter_eagerly_and_in_tf_function(cluster):
    def worker(rank):
        rows = tf.fill([rank + 1, 2], float(rank))
        out = {"gather": gw.allgather(rows).numpy()}
        out["gather_fn"] = tf.function(lambda t: gw.allgather(t))(rows).numpy()
        out["bcast"] = gw.broadcast(tf.fill([3], float(rank + 5)), root_rank=1).numpy()
        received, splits = gw.alltoall(tf.constant([rank * 10, rank * 10 + 1, rank * 10 + 2]), splits=[1, 2])
        out["a2a"], out["a2a_splits"] = received.numpy(), splits.numpy()
        out["rs"] = gw.reducescatter(tf.reshape(tf.range(6.0), [3, 2]) * (rank + 1), op=gw.Sum).numpy()
        out["objects"] = gw.broadcast_object({"from": rank}, root_rank=1), gw.allgather_object(rank * 2)
        return out

    for rank, out in enumerate(cluster.run_ranks(worker)):
        np.testing.assert_array_equal(out["gather"], [[0, 0], [1, 1], [1, 1]])
        np.testing.assert_array_equal(out["gather_fn"], out["gather"])
        np.testing.assert_array_equal(out["bcast"], [6.0, 6.0, 6.0])
        np.testing.assert_array_equal(out["a2a"], [0, 10] if rank == 0 else [1, 2, 11, 12])
        np.testing.assert_array_equal(out["a2a_splits"], [1, 1] if rank == 0 else [2, 2])
        full = np.arange(6.0).reshape(3, 2) * 3
        np.testing.assert_array_equal(out["rs"], full[:2] if rank == 0 else full[2:])
        assert out["objects"] == ({"from": 1}, [0, 2])


def test_unsigned_integers_the_wire_has_no_type_for_are_gathered_broadcast_and_exchanged_as_their_bits(cluster):
    def worker(rank):
        values = tf.constant([65535 - rank, rank], tf.uint16)
        received = gw.alltoall(tf.constant([rank, 60000 + rank], tf.uint32), name="u32.a2a")
        return gw.allgather(values, name="u16.gather"), gw.broadcast(values, root_rank=1, name="u16.bcast"), received

    for rank, (gathered, broadcast, received) in enumerate(cluster.run_ranks(worker)):
        assert gathered.dtype == tf.uint16 and received.dtype == tf.uint32
        np.testing.assert_array_equal(gathered.numpy(), [65535, 0, 65534, 1])
        np.testing.assert_array_equal(broadcast.numpy(), [65534, 1])
        np.testing.assert_array_equal(received.numpy(), [0, 1] if rank == 0 else [60000, 60001])


def test_gradients_of_reducescatter_and_alltoall_are_horovods(cluster):
    def worker(rank):
        x = tf.Variable(tf.reshape(tf.range(8.0), [4, 2]))
        with tf.GradientTape(persistent=True) as tape:
            scattered = gw.reducescatter(x, op=gw.Sum, name="grad.rs")  # 2 rows each
            loss_rs = tf.reduce_sum(scattered * (rank + 1.0))
            exchanged = gw.alltoall(x, splits=[1, 3], name="grad.a2a")[0]
            loss_a2a = tf.reduce_sum(exchanged * (rank + 1.0))
        return tape.gradient(loss_rs, x).numpy(), tape.gradient(loss_a2a, x).numpy()

    for grad_rs, grad_a2a in cluster.run_ranks(worker):
        # reducescatter (Sum): every worker's rows gathered, times n
        np.testing.assert_allclose(grad_rs, [[2, 2], [2, 2], [4, 4], [4, 4]])
        # alltoall: row 0 went to rank 0 (weight 1), rows 1-3 to rank 1 (weight 2)
        np.testing.assert_allclose(grad_a2a, [[1, 1], [2, 2], [2, 2], [2, 2]])


def test_gradients_of_allgather_and_broadcast_are_horovods(cluster):
    def worker(rank):
        x = tf.Variable(tf.fill([rank + 1, 2], 1.0))
        with tf.GradientTape(persistent=True) as tape:
            gathered = gw.allgather(x, name="grad.gather")
            loss_gather = tf.reduce_sum(gathered * (rank + 1.0))
            broadcast = gw.broadcast(x[:1] * 1.0, root_rank=0, name="grad.bcast")
            loss_bcast = tf.reduce_sum(broadcast * (rank + 1.0))
        return tape.gradient(loss_gather, x).numpy(), tape.gradient(loss_bcast, x).numpy()

    for rank, (gather_grad, bcast_grad) in enumerate(cluster.run_ranks(worker)):
        # allgather: the output's gradient averaged over the ranks ((1 + 2) / 2), this rank's rows of it
        np.testing.assert_allclose(gather_grad, np.full((rank + 1, 2), 1.5))
        # broadcast: the average on the root, zero elsewhere (only the first row was broadcast)
        expected = np.zeros((rank + 1, 2))
        expected[0] = 1.5 if rank == 0 else 0.0
        np.testing.assert_allclose(bcast_grad, expected)


def test_broadcast_variables_eagerly_and_inside_tf_function(cluster):
    def worker(rank):
        a, b = tf.Variable(tf.fill([3], float(rank))), tf.Variable(tf.constant([rank, rank], tf.int64))
        gw.broadcast_variables([a, b], root_rank=1)
        eager = a.numpy(), b.numpy()
        c = tf.Variable(tf.fill([2, 2], float(rank + 7)))

        @tf.function
        def broadcast():
            gw.broadcast_variables([c], root_rank=0)  # a group of assignments, run as the function's side effect

        broadcast()
        return eager, c.numpy()

    for (a, b), c in cluster.run_ranks(worker):
        np.testing.assert_array_equal(a, [1.0, 1.0, 1.0])
        np.testing.assert_array_equal(b, [1, 1])
        np.testing.assert_array_equal(c, np.full((2, 2), 7.0))


def test_sparse_gradients_are_allgathered_or_densified(cluster):
    def worker(rank):
        table = tf.Variable(tf.ones([4, 2]))
        results = []
        for sparse_as_dense in (False, True):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.nn.embedding_lookup(table, [rank, 3]) * (rank + 1.0))
            tape = gw.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
            results.append(tape.gradient(loss, [table])[0])
        return results

    for sparse, dense in cluster.run_ranks(worker):
        assert isinstance(sparse, tf.IndexedSlices) and not isinstance(dense, tf.IndexedSlices)
        expected = np.zeros((4, 2))
        expected[0], expected[1], expected[3] = 0.5, 1.0, 1.5  # the average of rank 0's rows {0, 3} and rank 1's {1, 3}
        np.testing.assert_allclose(tf.convert_to_tensor(sparse).numpy(), expected)
        np.testing.assert_allclose(dense.numpy(), expected)


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8))
    y = x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(n, 1))
    return x, y


def _train_with_tape(x, y, steps, distributed, w0):
    w = tf.Variable(w0)
    opt = keras.optimizers.SGD(0.05, momentum=0.9)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.matmul(xb, w) - yb) ** 2)
        if distributed:
            tape = gw.DistributedGradientTape(tape)
        grads = tape.gradient(loss, [w])
        opt.apply_gradients(zip(grads, [w], strict=True))

    for _ in range(steps):
        step(x, y)
    return w.numpy()


def test_distributed_gradient_tape_trains_as_one_process_on_the_whole_batch(cluster):
    x, y = _data()
    w0 = np.random.default_rng(1).normal(size=(8, 1))

    def worker(rank):
        return _train_with_tape(x[rank::N], y[rank::N], 20, True, w0)

    alone = _train_with_tape(x[np.r_[0:64:2, 1:64:2]], y[np.r_[0:64:2, 1:64:2]], 20, False, w0)
    results = cluster.run_ranks(worker)
    np.testing.assert_array_equal(results[0], results[1])  # every worker the same bits
    np.testing.assert_allclose(results[0], alone, rtol=1e-10, atol=1e-12)


def test_keras_fit_through_distributed_optimizer_equals_one_process_on_the_whole_batch(cluster):
    keras.backend.set_floatx("float64")
    try:
        results, alone, _ = fit_in_parallel_and_alone(cluster, *_data())
        for a, b, c in zip(results[0], results[1], alone, strict=True):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(a, c, rtol=1e-9, atol=1e-12)
    finally:
        keras.backend.set_floatx("float32")


def test_keras_callbacks_average_metrics_and_warm_the_learning_rate_up(cluster):
    def worker(rank):
        model = keras_model(rank)
        model.compile(optimizer=gwk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
        x, y = _data(32, seed=rank)
        warmup = gwk.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2)
        history = model.fit(
            x.astype("float32"),
            y.astype("float32"),
            batch_size=8,
            epochs=3,
            verbose=0,
            callbacks=[
                gwk.callbacks.BroadcastGlobalVariablesCallback(0),
                gwk.callbacks.MetricAverageCallback(),
                warmup,
            ],
        )
        return history.history

    results = cluster.run_ranks(worker)
    assert results[0]["loss"] == results[1]["loss"]  # averaged over the workers: the same on both
    # Horovod's warm-up from lr / n to lr over 2 epochs, batch by batch: at the end of epoch e (its last batch)
    # lr * (1 / n) * ((e + 1) * (n - 1) / 2 + 1), then lr from the end of the warm-up on
    assert results[0]["lr"] == pytest.approx([0.075, 0.1, 0.1])


def test_adasum_and_a_shape_mismatch_are_refused_naming_the_rank(cluster):
    def worker(rank):
        with pytest.raises(gradwire.NotSupported):
            gw.allreduce(tf.ones([2]), op=gw.Adasum)
        with pytest.raises(tf.errors.FailedPreconditionError) as error:  # Horovod's type; gradwire's is the cause
            gw.allreduce(tf.ones([rank + 1]), name="mismatch")
        assert isinstance(error.value.__cause__, gradwire.TensorMismatch)
        with pytest.raises(tf.errors.FailedPreconditionError):  # as many elements, another shape
            gw.allreduce(tf.ones([2, 3] if rank == 0 else [3, 2]), name="mismatch.shape")
        return str(error.value)

    for message in cluster.run_ranks(worker):
        assert "worker 0: sum of float32[1]" in message and "worker 1: sum of float32[2]" in message
        assert "'mismatch" in message


def test_workers_passing_other_dtypes_under_one_name_get_an_error_not_a_hang(cluster):
    def worker(rank):
        with pytest.raises(tf.errors.FailedPreconditionError) as error:
            gw.allreduce(tf.ones([3], tf.int32 if rank == 0 else tf.float32), name="dtypes")
        with pytest.raises(tf.errors.FailedPreconditionError):
            gw.broadcast(tf.ones([2], tf.int32 if rank == 0 else tf.float32), root_rank=0, name="dtypes.bcast")
        return str(error.value)

    for message in cluster.run_ranks(worker):
        assert "worker 0: sum of int32[3]" in message and "worker 1: sum of float32[3]" in message


def test_elastic_training_goes_on_when_a_worker_is_lost_inside_tf_function():
    """A worker lost mid-step fails the survivors' exchange inside tf.function (TensorFlow hands on an OpError); run
    finds the MembershipChanged behind it, restores the last commit, re-forms and goes on with two workers."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    steps = 40
    with LocalCluster(num_workers=3, num_servers=1, min_workers=2, max_workers=3, partition_bytes=4096) as c:
        at_step_5 = threading.Event()

        def worker(w):
            with gradwire.use_worker(w):
                v = tf.Variable(tf.zeros([1000]))
                state = gw.elastic.TensorFlowState([v], batch=0)

                @tf.function
                def step():
                    v.assign_add(gw.allreduce(tf.ones([1000]), op=gw.Sum, name="elastic.g"))

                @gw.elastic.run
                def train(state):
                    while state.batch < steps:
                        step()
                        state.batch += 1
                        state.commit()
                        if state.batch == 5:
                            at_step_5.set()
                    return float(v.numpy()[0]), gradwire.size()

                try:
                    return train(state)
                except Exception as e:  # the lost worker's own thread: its worker was cut off
                    if w is not workers[1]:
                        raise
                    return type(e).__name__

        workers = list(c.workers)
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(worker, w) for w in workers]
            assert at_step_5.wait(60)
            c.kill_worker(1)
            results = [f.result(timeout=120) for f in futures]
    assert isinstance(results[1], str), results
    survivors = [results[0], results[2]]
    assert survivors[0] == survivors[1], results  # the same bits on both
    total, size = survivors[0]
    assert size == 2
    lost_at = (total - 2 * steps) / (3 - 2)  # steps summed by 3 workers before the loss, by 2 after it
    # The first worker at batch 5 set the event: step 5's sum needed every worker's push, so every worker had committed
    # batch 4 at least; the re-formed job goes on from the new rank 0's last commit, which may be 4 or later.
    assert lost_at == int(lost_at) and 4 <= lost_at < steps, results


def test_a_keras_state_commits_restores_and_syncs_the_model_and_its_optimizer(cluster):
    def worker(rank):
        model = keras_model(rank)
        model.compile(optimizer=gwk.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
        state = gwk.elastic.KerasState(model, epoch=0, batch=0)
        x, y = _data(16)
        callbacks = [
            gwk.elastic.UpdateEpochStateCallback(state),
            gwk.elastic.UpdateBatchStateCallback(state),
            gwk.elastic.CommitStateCallback(state, batches_per_commit=2),
        ]
        state.sync()  # rank 0's weights everywhere
        model.fit(x.astype("float32"), y.astype("float32"), batch_size=4, epochs=2, verbose=0, callbacks=callbacks)
        committed = [np.array(w) for w in model.get_weights()]
        epoch_batch = (state.epoch, state.batch)
        model.set_weights([w + 1.0 for w in committed])
        state.epoch = 99
        state.restore()  # back to the commit at the end of the last epoch
        restored = [np.array(w) for w in model.get_weights()]
        return committed, restored, epoch_batch, state.epoch

    results = cluster.run_ranks(worker)
    for committed, restored, epoch_batch, epoch in results:
        assert epoch_batch == (2, 0) and epoch == 2
        for a, b in zip(committed, restored, strict=True):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(results[0][0], results[1][0], strict=True):
        np.testing.assert_array_equal(a, b)  # synced at the start, averaged every step: the same on both


def test_horovods_tensorflow2_example_step_with_a_keras_model_leaves_every_worker_alike(cluster):
    """Horovod's tensorflow2_mnist.py's step: a Keras 3 model, DistributedGradientTape, and on the first batch
    broadcast_variables of the model's and the optimizer's variables (Keras variables) inside tf.function."""

    def worker(rank):
        keras.utils.set_random_seed(rank)  # different initial weights
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
        opt = keras.optimizers.Adam(0.1)

        @tf.function
        def step(x, first):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x) ** 2)
            tape = gw.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            if first:
                gw.broadcast_variables(model.variables, root_rank=0)
                gw.broadcast_variables(opt.variables, root_rank=0)

        for i in range(3):
            step(tf.fill([2, 3], float(rank + 1)), i == 0)
        return [np.array(v.numpy()) for v in model.variables + opt.variables]

    first, second = cluster.run_ranks(worker)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


def _two_layer_model(rank):
    """Dense(2) then Dense(1), every weight `rank + 1`: each worker's gradients differ."""
    init = keras.initializers.Constant(rank + 1.0)
    layers = [keras.layers.Dense(2, kernel_initializer=init), keras.layers.Dense(1, kernel_initializer=init)]
    return keras.Sequential([keras.Input((3,)), *layers])


def test_a_partial_tape_keeps_its_local_layers_gradients_scaled_and_averages_the_rest(cluster):
    x = np.arange(12, dtype=np.float32).reshape(4, 3) / 10

    def worker(rank):
        model = _two_layer_model(rank)
        out = {}
        for locals_, scale in ((0, True), (1, True), (1, False), (2, True)):
            with tf.GradientTape(persistent=True) as tape:
                loss = tf.reduce_sum(model(x) ** 2)
            plain = [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]
            layers = model.layers[:locals_]
            partial = gw.PartialDistributedGradientTape(tape, local_layers=layers, scale_local_gradients=scale)
            reduced = [g.numpy() for g in partial.gradient(loss, model.trainable_weights)]
            local, shared = partial.get_local_and_global_gradients(loss, model.trainable_weights)
            out[(locals_, scale)] = plain, reduced, len(local), len(shared)
        return out

    results = cluster.run_ranks(worker)
    for (locals_, scale), (plain0, reduced0, n_local, n_shared) in results[0].items():
        plain1, reduced1, _, _ = results[1][(locals_, scale)]
        assert (n_local, n_shared) == (2 * locals_, 4 - 2 * locals_)
        for i in range(4):
            if i < 2 * locals_:  # a local layer's kernel and bias: this worker's own gradient, over 2 if scaled
                np.testing.assert_allclose(reduced0[i], plain0[i] / (N if scale else 1), rtol=1e-6)
                np.testing.assert_allclose(reduced1[i], plain1[i] / (N if scale else 1), rtol=1e-6)
            else:  # the average, the same on both workers
                np.testing.assert_allclose(reduced0[i], (plain0[i] + plain1[i]) / 2, rtol=1e-6)
                np.testing.assert_array_equal(reduced0[i], reduced1[i])


def test_a_partial_keras_optimizer_steps_its_local_layers_alone(cluster):
    x = np.arange(12, dtype=np.float32).reshape(4, 3) / 10

    def worker(rank):
        model = _two_layer_model(rank)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        grads = tape.gradient(loss, model.trainable_weights)
        before = [w.numpy() for w in model.trainable_weights]
        opt = gwk.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=model.layers[0])
        opt.apply_gradients(zip(grads, model.trainable_weights, strict=True))
        return before, [g.numpy() for g in grads], [w.numpy() for w in model.trainable_weights]

    (b0, g0, a0), (b1, g1, a1) = cluster.run_ranks(worker)
    for i in range(2):  # the first layer: each worker's own step, its gradient over the 2 workers
        np.testing.assert_allclose(a0[i], b0[i] - g0[i] / N, rtol=1e-6)
        np.testing.assert_allclose(a1[i], b1[i] - g1[i] / N, rtol=1e-6)
    for i in range(2, 4):  # the second: the averaged gradient on both
        np.testing.assert_allclose(a0[i], b0[i] - (g0[i] + g1[i]) / 2, rtol=1e-6)
        np.testing.assert_allclose(a1[i], b1[i] - (g0[i] + g1[i]) / 2, rtol=1e-6)
    with pytest.raises(ValueError, match="keras.layers.Layer"):
        gwk.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=["not a layer"])


def test_horovods_tensorflow_util_module_and_global_variables_broadcast(cluster):
    from gradwire.tensorflow import util

    assert gw.util is util and util._executing_eagerly()
    calls = []
    cached = util._cache(lambda a: calls.append(a) or a * 2)
    assert (cached(3), cached(3), calls) == (6, 6, [3])
    v = tf.Variable(1.0)
    assert util.refs_to_vars(util.vars_to_refs([v, [v]])) == [v, [v]]
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        gw.broadcast_global_variables(0)

    def worker(rank):
        with tf.Graph().as_default():
            var = tf.compat.v1.get_variable("g", initializer=float(rank + 5))
            assign = gw.broadcast_global_variables(0)
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                session.run(assign)
                return session.run(var)

    assert cluster.run_ranks(worker) == [5.0, 5.0]


def test_sync_batch_normalization_normalises_by_the_whole_global_batch(cluster):
    x = np.arange(24, dtype=np.float32).reshape(8, 3) ** 1.5
    whole = keras.layers.BatchNormalization(axis=1, momentum=0.5)
    expected = whole(x, training=True).numpy()

    def worker(rank):
        sync = gw.SyncBatchNormalization(axis=1, momentum=0.5, name="bn_case")
        half = x[rank * 4 : (rank + 1) * 4]
        eager = sync(half, training=True).numpy()
        inside = gw.SyncBatchNormalization(axis=1, momentum=0.5, name="bn_case_in_function")
        graph = tf.function(lambda h: inside(h, training=True))(tf.constant(half)).numpy()
        return eager, graph, sync.moving_mean.numpy(), sync.moving_variance.numpy()

    for rank, (out, graph, mean, variance) in enumerate(cluster.run_ranks(worker)):
        np.testing.assert_allclose(out, expected[rank * 4 : (rank + 1) * 4], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(graph, out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(mean, whole.moving_mean.numpy(), rtol=1e-5)
        np.testing.assert_allclose(variance, whole.moving_variance.numpy(), rtol=1e-4)
    with pytest.raises(ValueError, match="fused=True"):
        gw.SyncBatchNormalization(fused=True)


def test_keras_2_idioms_on_the_wrapped_optimizer_variables_called_and_a_legacy_optimizer_refused():
    opt = gwk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    opt.build([keras.Variable(np.zeros(3, np.float32))])
    with pytest.warns(DeprecationWarning, match="variables` is a property"):
        called = opt.variables()
    assert [id(v) for v in called] == [id(v) for v in opt.variables] and len(called) >= 2

    class KerasTwoSGD:  # what tf_keras's optimizers look like to the wrapper: no Keras 3 `apply`
        def apply_gradients(self, grads_and_vars):
            pass

    with pytest.raises(TypeError, match="wraps a Keras 3 optimizer .* not .*KerasTwoSGD: .*learning_rate for lr"):
        gwk.DistributedOptimizer(KerasTwoSGD())
