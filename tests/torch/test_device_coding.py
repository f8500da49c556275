"""Compression on the device (docs/compression.md, "On a GPU"): the torch codecs make the blocks the servers read and
decode blocks as the host does, and a compressed push_pull of a tensor that is not on the host (here: CPU tensors
sent the device's way, `device_coding.ON_CPU_TOO`; no GPU on this machine) trains with every worker identical, its
residuals kept beside the tensor, and gives what the host path gives."""

import numpy as np
import pytest

import gradwire
import gradwire.torch as gwt
import torch
from gradwire.errors import TensorError
from gradwire.protocol import compression
from gradwire.testing import LocalCluster
from gradwire.torch import device_coding, ops
from tests.torch.inprocess import N, run
from tests.torch.test_compression import COMPRESSORS, _data, _model, _train

N_ELEMENTS = 10_001  # not a multiple of 8 or 2: the padding of bits and nibbles
ARGS = [
    {"method": "onebit"},
    {"method": "onebit", "scaling": False},
    {"method": "topk", "k": 0.01},
    {"method": "topk", "k": 7},
    {"method": "randomk", "k": 0.05},
    {"method": "dithering"},
    {"method": "dithering", "s": 15, "norm": "l2"},
    {"method": "dithering", "partition": "natural"},
]


def _codec(args):
    return compression.for_partition(compression.codec(compression.check_args(args)), N_ELEMENTS)


@pytest.mark.parametrize("args", ARGS, ids=lambda a: "-".join(str(v) for v in a.values()))
def test_device_blocks_are_the_hosts(args):
    codec = _codec(args)
    x = np.random.default_rng(0).standard_normal(N_ELEMENTS).astype(np.float32)
    host = np.zeros(codec.wire_bytes(N_ELEMENTS), np.uint8)
    codec.encode(x, host, 5, 3, 1)
    device = device_coding.encode(codec, torch.from_numpy(x), 5, 3, 1).numpy()
    assert device.shape == host.shape
    from_device, from_host = np.zeros(N_ELEMENTS, np.float32), np.zeros(N_ELEMENTS, np.float32)
    codec.decode(device, from_device, 5, 3, add=False)
    codec.decode(host, from_host, 5, 3, add=False)
    # the torch decoder reads any block exactly as the host's (the servers' answers are decoded on the device)
    assert np.array_equal(device_coding.decode(codec, torch.from_numpy(host), N_ELEMENTS, 5, 3).numpy(), from_host)
    if args["method"] == "dithering":  # another generator's draws: the same levels and error, other bytes
        norm = float(np.abs(x).max()) if args.get("norm") != "l2" else float(np.linalg.norm(x))
        levels = args.get("s", 7)
        bound = norm / levels if args.get("partition") != "natural" else norm / 2
        assert float(np.abs(from_device - x).max()) <= bound * 1.0001
        assert abs(float(np.abs(from_device - x).mean()) / float(np.abs(from_host - x).mean()) - 1) < 0.05
    elif args == {"method": "onebit"}:  # mean |x| summed in another order: the scale's last bit may differ
        assert np.array_equal(device[4:], host[4:])
        np.testing.assert_allclose(from_device, from_host, rtol=1e-6)
    else:
        assert np.array_equal(device, host)


def test_device_decoding_refuses_forged_blocks():
    topk = _codec({"method": "topk", "k": 0.01})
    block = device_coding.encode(topk, torch.randn(N_ELEMENTS), 1, 1, 0)
    k = len(block) // 8
    block[: 4 * k].view(torch.int32)[0] = N_ELEMENTS  # past the partition, and unsorted
    with pytest.raises(TensorError, match="topk block of key 0000000000000001"):
        device_coding.decode(topk, block, N_ELEMENTS, 1, 1)
    dither = _codec({"method": "dithering", "s": 3})
    block = device_coding.encode(dither, torch.randn(N_ELEMENTS), 2, 1, 0)
    block[4] = 0x77  # codes of 7 levels in a 3-level block
    with pytest.raises(TensorError, match="above its 3 levels"):
        device_coding.decode(dither, block, N_ELEMENTS, 2, 1)
    onebit = _codec({"method": "onebit"})
    block = device_coding.encode(onebit, torch.randn(N_ELEMENTS), 3, 1, 0)
    block[:4].view(torch.float32)[0] = float("nan")
    with pytest.raises(TensorError, match="scale nan"):
        device_coding.decode(onebit, block, N_ELEMENTS, 3, 1)


@pytest.fixture
def device_path(monkeypatch):
    monkeypatch.setattr(device_coding, "ON_CPU_TOO", True)


@pytest.mark.parametrize("method", ["onebit", "topk", "randomk"])
def test_training_on_the_device_path_is_the_host_path(cluster, device_path, method):
    """The same steps through the device path and the host path: every worker identical on each, residuals kept as
    tensors beside the gradient, and the same parameters as the host path's (onebit: up to its scales' last bits)."""

    def make(prefix):
        def optimizer(model):
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            named = model.named_parameters(prefix=prefix)
            return gwt.DistributedOptimizer(opt, named, compression=COMPRESSORS[method])

        return optimizer

    (losses, params0), (_, params1) = _train(cluster, make(method), steps=12)
    for a, b in zip(params0, params1, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    worker = cluster.workers[0]
    coded = [e for e in worker.calls.compressing.keys.values() if isinstance(e.residual, torch.Tensor)]
    assert coded, "no key went the device's way"
    device_coding.ON_CPU_TOO = False
    with LocalCluster(num_workers=N, num_servers=2, partition_bytes=16 << 10) as host:  # the same names and rounds
        (_, host0), _ = _train(host, make(method), steps=12)
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if method == "onebit" else {"rtol": 0, "atol": 0}
    for a, b in zip(params0[-1], host0[-1], strict=True):
        torch.testing.assert_close(a, b, **tolerance)
    assert sum(losses[-3:]) < sum(losses[:3])


def test_the_device_path_takes_momentum_and_follows_the_learning_rate(cluster, device_path):
    compressor = gwt.Compression.topk(0.05, momentum=0.9)

    def worker(rank):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = gwt.DistributedOptimizer(opt, model.named_parameters(prefix="dev-lr"), compression=compressor)
        x, y = _data(1)[0]
        store = gradwire.current_worker().calls.compressing
        earlier = set(store.keys)  # other tests' keys (one cluster per module)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        kept = {k: e for k, e in store.keys.items() if k not in earlier and isinstance(e.residual, torch.Tensor)}
        before = {k: e.residual.clone() for k, e in kept.items()}
        moving = all(isinstance(e.velocity, torch.Tensor) and e.velocity.abs().sum() > 0 for e in kept.values())
        for group in opt.param_groups:
            group["lr"] = 0.05
        opt.zero_grad()
        opt._follow_lr()
        return moving, {k: (before[k], kept[k].residual) for k in before}

    for moving, pairs in run(cluster, worker):
        assert moving and pairs
        for old, new in pairs.values():
            assert torch.equal(new, old * 2)


def test_push_pull_on_the_device_path_in_place_and_not(cluster, device_path):
    """Positive constants: onebit's scale is each worker's value and its signs all 0, so the average is exact."""

    def worker(rank):
        w = gradwire.current_worker()
        t = torch.full((40_000,), float(rank + 1))
        handle = ops.push_pull_async(t, True, "dev-inplace", compression=gwt.Compression.onebit(), worker=w)
        inplace = handle.result(w)
        u = torch.full((40_000,), float(rank + 1))
        summed = gwt.push_pull(u, average=False, name="dev-new", compression=gwt.Compression.onebit())
        return inplace.data_ptr() == t.data_ptr(), t, u, summed

    for same, t, u, summed in run(cluster, worker):
        assert same
        assert torch.equal(t, torch.full((40_000,), (N + 1) / 2))
        assert torch.equal(summed, torch.full((40_000,), N * (N + 1) / 2)) and u[0] != summed[0]


def test_workers_sharing_a_host_stage_the_gradient_as_before(device_path):
    """Local aggregation's shared-memory stage needs the gradient itself: the device path steps aside, and the host's
    sum is what gets encoded (every worker the same result)."""
    with LocalCluster(num_workers=4, num_servers=2, colocated=2, hosts=2) as shared:

        def worker(rank):
            t = torch.full((80_000,), float(rank + 1))
            out = gwt.push_pull(t, average=True, name="dev-hosts", compression=gwt.Compression.onebit())
            store = gradwire.current_worker().calls.compressing
            return out, [e for e in store.keys.values() if isinstance(e.residual, torch.Tensor)]

        results = run(shared, worker)
    for out, coded in results:
        assert not coded
        assert torch.equal(out, results[0][0])
        torch.testing.assert_close(out, torch.full((80_000,), 2.5))
