"""Parameter-server mode with compressed gradients: each worker encodes its gradient's partitions with its
own error feedback, the servers decode every push where they would add it, step the optimizer, and answer the
parameters as they are. Checked against a simulation that runs the same codecs by hand, synchronous and asynchronous;
small and float64 tensors travel as they are; a server's death keeps every worker identical."""

import threading

import numpy as np
import pytest

import gradwire
from gradwire import compression
from gradwire.protocol import compression as codecs
from gradwire.testing import LocalCluster

N = 20_000  # float32 elements: 80 KB, over GRADWIRE_COMPRESSION_MIN_BYTES, in several 16 KiB partitions
METHODS = {
    "onebit": compression.onebit(),
    "topk": compression.topk(0.05),
    "randomk": compression.randomk(0.1),
    "dithering": compression.dithering(ef=True),
}


def _grad(rank: int, step: int, n: int = N) -> np.ndarray:
    return np.random.default_rng(100 * step + rank).standard_normal(n).astype(np.float32)


def _parts(worker, name: str) -> list[tuple[int, int, int]]:
    """(first element, count, key) of each partition of tensor `name` on `worker`."""
    tensor = worker.table.tensors[name]
    return [(p.start, p.count, key) for p, key in zip(tensor.parts, tensor.keys, strict=True)]


def _simulated(method: str, parts, steps: int, lr: float, workers: int = 2) -> np.ndarray:
    """Synchronous SGD with `method`: each worker encodes (gradient + residual) per partition and keeps what encoding
    dropped; the servers add the decoded blocks in rank order, average and step."""
    args = METHODS[method].args
    w = np.zeros(N, np.float32)
    residual = np.zeros((workers, N), np.float32)
    for step in range(steps):
        rnd = step + 2  # a tensor's rounds count its calls from 1: the init, then each update
        total = np.empty(N, np.float32)
        for start, count, key in parts:
            codec = codecs.for_partition(codecs.codec(args), count)
            acc = total[start : start + count]
            for r in range(workers):
                x = residual[r, start : start + count]
                x += _grad(r, step)[start : start + count]
                block = np.zeros(codec.wire_bytes(count), np.uint8)
                codec.encode(x, block, key, rnd, r)
                decoded = np.empty(count, np.float32)
                codec.decode(block, decoded, key, rnd, add=False)
                x -= decoded
                codec.decode(block, acc, key, rnd, add=r > 0)
        total /= np.float32(workers)
        w -= np.float32(lr) * total
    return w


def _job(method, steps, lr, staleness=0, name="w"):
    def job(worker):
        with gradwire.use_worker(worker):
            gradwire.set_optimizer("sgd", lr=lr, staleness=staleness, compression=METHODS[method])
            w = gradwire.init_parameter(name, np.zeros(N, np.float32))
            before = worker.state.metrics.bytes_pushed
            for step in range(steps):
                w = gradwire.update(name, _grad(worker.rank, step), out=w)
            return w, worker.state.metrics.bytes_pushed - before, _parts(worker, name)

    return job


@pytest.mark.parametrize("method", METHODS)
def test_servers_decode_each_compressed_gradient_as_the_workers_encoded_it(method):
    steps, lr = 4, 0.1
    with LocalCluster(num_workers=2, num_servers=2, partition_bytes=16 << 10) as c:
        results = c.run(_job(method, steps, lr))
        stats = [s.status()["optimizer"] for s in c.servers]
    (w0, pushed, parts), (w1, _, _) = results
    assert w0.tobytes() == w1.tobytes()  # every worker is answered the same parameters
    assert len(parts) > 2
    np.testing.assert_allclose(w0, _simulated(method, parts, steps, lr), rtol=1e-5, atol=1e-6)
    assert sum(s["decoded"] for s in stats) == 2 * steps * len(parts)
    ratio = {"onebit": 20, "topk": 5, "randomk": 5, "dithering": 4}[method]
    assert pushed * ratio < steps * N * 4, pushed  # the blocks, not the gradients (plus a 64-byte trailer each)


def test_asynchronous_updates_decode_each_push_and_train():
    """Staleness 1: each compressed push is decoded and applied as it arrives; on a quadratic (gradient w - target)
    the parameters approach the target as plain asynchronous SGD does."""
    target = np.random.default_rng(3).standard_normal(N).astype(np.float32)

    def job(worker, comp):
        with gradwire.use_worker(worker):
            gradwire.set_optimizer("sgd", lr=0.2, staleness=1, compression=comp)
            name = f"q.{comp is not None}"
            w = gradwire.init_parameter(name, np.zeros(N, np.float32))
            for _ in range(25):
                w = gradwire.update(name, w - target, out=w)
            return np.linalg.norm(gradwire.optimizer_state(name, w)["params"] - target) / np.linalg.norm(target)

    with LocalCluster(num_workers=2, num_servers=2, partition_bytes=16 << 10) as c:
        plain = c.run(lambda w: job(w, None))
        packed = c.run(lambda w: job(w, METHODS["onebit"]))
        decoded = sum(s.status()["optimizer"]["decoded"] for s in c.servers)
    assert decoded > 0
    assert max(plain) < 0.05, plain
    assert max(packed) < 0.1, (packed, plain)  # sign steps with error feedback get there too, a little behind


def test_small_and_float64_parameters_travel_as_they_are():
    with LocalCluster(num_workers=2, num_servers=1) as c:

        def job(worker):
            with gradwire.use_worker(worker):
                gradwire.set_optimizer("sgd", lr=1.0, compression=METHODS["onebit"])
                out = []
                for name, dtype, n in (("small", np.float32, 1000), ("wide", np.float64, N)):
                    w = gradwire.init_parameter(name, np.zeros(n, dtype))
                    out.append(gradwire.update(name, np.full(n, worker.rank + 1, dtype), out=w))
                return out

        for small, wide in c.run(job):
            assert np.all(small == -1.5) and np.all(wide == -1.5)  # the average of 1 and 2, exactly
        assert c.servers[0].status()["optimizer"]["decoded"] == 0


def test_compressors_the_servers_cannot_decode_are_refused():
    import gradwire.torch as gwt

    with LocalCluster(num_workers=1, num_servers=1) as c:
        with gradwire.use_worker(c.workers[0]):
            for comp in (gwt.Compression.fp16, gwt.Compression.powersgd(rank=2)):
                with pytest.raises(ValueError, match="onebit, topk, randomk or dithering"):
                    gradwire.set_optimizer("sgd", lr=0.1, compression=comp)
            with pytest.raises(ValueError, match="unknown compressor"):
                gradwire.set_optimizer("sgd", lr=0.1, compression={"method": "twobit"})
            gradwire.set_optimizer("sgd", lr=0.1, compression=gwt.Compression.none)  # none is none


def test_a_server_killed_mid_training_keeps_every_worker_identical():
    steps = 16
    killed = threading.Event()

    def job(worker):
        with gradwire.use_worker(worker):
            gradwire.set_optimizer("sgd", lr=0.05, momentum=0.9, compression=METHODS["onebit"])
            w = gradwire.init_parameter("ft", np.zeros(N, np.float32))
            for step in range(steps):
                if step == steps // 2 and worker.rank == 0:
                    c.kill_server(1)
                    killed.set()
                w = gradwire.update("ft", _grad(worker.rank, step), out=w)
            return w

    with LocalCluster(num_workers=3, num_servers=3, partition_bytes=16 << 10, placement="equal") as c:
        results = c.run(job)
        assert killed.is_set() and c.scheduler.failovers
    assert results[0].tobytes() == results[1].tobytes() == results[2].tobytes()
    assert np.all(np.isfinite(results[0]))
