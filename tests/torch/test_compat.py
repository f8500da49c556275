"""What Horovod's and BytePS's scripts rely on: 0-dim tensors, out-of-place results, names reused with
new shapes, Horovod's optimizer keywords, and errors that say what to do. In-process cluster: a thread per rank."""

import time

import numpy as np
import pytest

import gradwire
import gradwire.torch as gwt
import torch
from gradwire.testing import LocalCluster
from tests.torch.inprocess import N, run

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_dim_tensors_of_every_dtype(cluster, dtype):
    def worker(rank):
        t = torch.tensor(rank + 1, dtype=dtype)
        total = gwt.push_pull(t, average=False, name=f"scalar.{dtype}")
        in_place = torch.tensor(rank + 1, dtype=dtype)
        gwt.allreduce_(in_place, op=gwt.Sum, name=f"scalar_.{dtype}")
        root = torch.tensor(10 * (rank + 1), dtype=dtype)
        gwt.broadcast_(root, root_rank=1, name=f"scalar.b.{dtype}")
        numpy_sum = gradwire.current_worker().push_pull(np.array(rank + 1, np.int64), f"np.scalar.{dtype}")
        return total, in_place, root, numpy_sum

    for total, in_place, root, numpy_sum in run(cluster, worker):
        assert total.shape == in_place.shape == root.shape == () and total.dtype == dtype
        assert total.item() == in_place.item() == 3
        assert root.item() == 20
        assert numpy_sum.shape == () and int(numpy_sum) == 3


def test_scalar_metric_average_as_horovod_examples_do(cluster):
    def worker(rank):
        return gwt.allreduce(torch.tensor(float(rank)), name="avg_loss").item()

    assert run(cluster, worker) == [0.5, 0.5]


def test_batchnorm_buffers_and_scalar_parameters_broadcast(cluster):
    def make(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
        model.register_parameter("temperature", torch.nn.Parameter(torch.tensor(float(seed))))
        model(torch.randn(2, 3, 8, 8))  # running stats and num_batches_tracked differ by rank
        return model

    models = [make(seed) for seed in range(N)]

    def worker(rank):
        gwt.broadcast_parameters(models[rank].state_dict(), root_rank=0)
        return models[rank].state_dict()

    a, b = run(cluster, worker)
    assert "1.num_batches_tracked" in a and a["1.num_batches_tracked"].dim() == 0
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_byteps_push_pull_leaves_its_input_alone(cluster):
    def worker(rank):
        t = torch.full((5,), rank + 1.0)
        mean = gwt.push_pull(t, name="bps.out")  # BytePS: average by default, out of place
        total = gwt.synchronize(gwt.push_pull_async(t, average=False, name="bps.async"))
        inplace = t.clone()
        gwt.push_pull_inplace(inplace, average=False, name="bps.inplace")
        handle = gwt.push_pull_async_inplace(t.clone(), average=True, name="bps.async_inplace")
        return t, mean, total, inplace, gwt.synchronize(handle)

    for rank, (t, mean, total, inplace, async_inplace) in enumerate(run(cluster, worker)):
        assert torch.equal(t, torch.full((5,), rank + 1.0))  # unchanged
        assert torch.equal(mean, torch.full((5,), 1.5)) and torch.equal(async_inplace, torch.full((5,), 1.5))
        assert torch.equal(total, torch.full((5,), 3.0)) and torch.equal(inplace, torch.full((5,), 3.0))


def test_horovod_allreduce_ops_scales_and_auto_names(cluster):
    def worker(rank):
        t = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)
        results = {
            "average": gwt.allreduce(t),
            "sum": gwt.allreduce(t, op=gwt.Sum),
            "deprecated_average_false": gwt.allreduce(t, average=False),
            "scaled": gwt.allreduce(t, op=gwt.Sum, prescale_factor=2.0, postscale_factor=0.25),
            "async": gwt.synchronize(gwt.allreduce_async(t, op=gwt.Sum)),
            "ints": gwt.allreduce(torch.tensor([rank, 1], dtype=torch.int32), op=gwt.Sum),
        }
        return t, results

    for rank, (t, r) in enumerate(run(cluster, worker)):
        base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        assert torch.equal(t, base * (rank + 1))
        assert torch.equal(r["average"], base * 1.5)
        assert torch.equal(r["sum"], base * 3) and torch.equal(r["deprecated_average_false"], base * 3)
        assert torch.equal(r["async"], base * 3)
        torch.testing.assert_close(r["scaled"], base * 3 * 2 * 0.25)
        assert r["ints"].tolist() == [1, 2]


def test_allreduce_is_differentiable(cluster):
    def worker(rank):
        x = torch.full((3,), rank + 1.0, requires_grad=True)
        y = gwt.allreduce(x * 2, name="diff")  # average of 2x over ranks
        (y * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
        return y.detach(), x.grad

    for y, grad in run(cluster, worker):
        assert torch.equal(y, torch.full((3,), 3.0))
        # d/dx of mean(2x): the incoming gradient, averaged over ranks (the same on each), times 2
        assert torch.equal(grad, torch.tensor([2.0, 4.0, 6.0]))


def test_unsupported_ops_say_so(cluster):
    with gradwire.use_worker(cluster.workers[0]):
        with pytest.raises(gradwire.TensorError, match=r"worker 0: op=adasum of 'm' is not supported"):
            gwt.allreduce(torch.ones(2), name="m", op=gwt.Adasum)
        with pytest.raises(ValueError, match="not both"):
            gwt.allreduce(torch.ones(2), average=True, op=gwt.Sum)
        with pytest.raises(gradwire.TensorError, match=r"worker 0: push_pull needs a name"):
            gwt.push_pull(torch.ones(2))


def _generator():
    return torch.nn.Sequential(torch.nn.Linear(4, 20), torch.nn.ReLU(), torch.nn.Linear(20, 11))


def _discriminator():
    return torch.nn.Sequential(torch.nn.Linear(11, 7), torch.nn.ReLU(), torch.nn.Linear(7, 1))


@pytest.mark.parametrize("fusion_bytes", [0, 1 << 20], ids=["unfused", "fused"])
def test_two_models_whose_parameter_names_clash(cluster, fusion_bytes):
    """A GAN: both models' parameters are named 0.weight, 0.bias, ..., with other shapes; fused and unfused."""
    torch.manual_seed(0)
    pairs = [(_generator(), _discriminator()) for _ in range(N)]
    assert [n for n, _ in pairs[0][0].named_parameters()] == [n for n, _ in pairs[0][1].named_parameters()]
    for g, d in pairs[1:]:
        g.load_state_dict(pairs[0][0].state_dict())
        d.load_state_dict(pairs[0][1].state_dict())

    def worker(rank):
        g, d = pairs[rank]
        g_opt = gwt.DistributedOptimizer(
            torch.optim.Adam(g.parameters(), 1e-3), named_parameters=g.named_parameters(), fusion_bytes=fusion_bytes
        )
        d_opt = gwt.DistributedOptimizer(
            torch.optim.SGD(d.parameters(), 0.1), named_parameters=d.named_parameters(), fusion_bytes=fusion_bytes
        )
        gen = torch.Generator().manual_seed(rank)
        sums = []
        for _ in range(3):
            z = torch.randn(8, 4, generator=gen)
            d_opt.zero_grad()
            d(g(z).detach()).mean().backward()
            d_opt.step()
            g_opt.zero_grad()
            d.requires_grad_(False)  # as with Horovod: D's gradients would start pushes that no D step waits for
            (-d(g(z)).mean()).backward()
            d.requires_grad_(True)
            g_opt.step()
            sums.append([p.grad.clone() for p in list(g.parameters()) + list(d.parameters())])
        return sums, [p.detach().clone() for p in list(g.parameters()) + list(d.parameters())]

    (sums_a, a), (sums_b, b) = run(cluster, worker)
    for step_a, step_b in zip(sums_a, sums_b, strict=True):  # each step's summed gradients: bit-identical
        for ga, gb in zip(step_a, step_b, strict=True):
            assert torch.equal(ga, gb)
    # the parameters: as close as two threads' Adam steps get. Measured (hashes before and after Adam.step): identical
    # gradients and parameters in, the first parameter slightly apart out, in about one run in twenty; torch's CPU
    # kernels do not promise bit-identical results for equal inputs at other memory addresses
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-6)


def test_horovod_optimizer_keywords(cluster):
    def model():
        torch.manual_seed(3)
        m = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(8, 2))
        return m

    models = {key: [model() for _ in range(N)] for key in ("plain", "keywords")}

    def train(key, **kwargs):
        def worker(rank):
            m = models[key][rank]
            opt = gwt.DistributedOptimizer(
                torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(), **kwargs
            )
            for step in range(3):
                opt.zero_grad()
                x = torch.tensor([[rank, step], [step, 9 - rank]])
                m(x).pow(2).mean().backward()
                opt.step()
            return [p.detach().clone() for p in m.parameters()]

        return run(cluster, worker)

    plain = train("plain", sparse_as_dense=True, fusion_bytes=0)
    keywords = train("keywords", sparse_as_dense=True, gradient_predivide_factor=2.0, num_groups=1)
    for a, b in zip(plain[0], keywords[0], strict=True):
        torch.testing.assert_close(a, b)
    assert all(torch.equal(a, b) for a, b in zip(keywords[0], keywords[1], strict=True))


@pytest.mark.parametrize("optimizer", ["sgd", "sparse_adam"])
def test_sparse_gradients_are_summed_as_horovod_does(cluster, optimizer):
    """Without sparse_as_dense an embedding's sparse gradient travels as an allgather of its indices and values
    (fused, small ones are summed dense); every way gives the same parameters, on every rank, still sparse for
    optimizers that want them so (SparseAdam)."""

    def model():
        torch.manual_seed(5)  # here, not in the ranks' threads: they would share torch's generator
        return torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(8, 2))

    def train(**kwargs):
        models = [model() for _ in range(N)]

        def worker(rank):
            m = models[rank]
            base = (
                torch.optim.SGD(m.parameters(), lr=0.1)
                if optimizer == "sgd"
                else torch.optim.SparseAdam(list(m[0].parameters()), lr=0.1)
            )
            opt = gwt.DistributedOptimizer(base, named_parameters=m.named_parameters(), **kwargs)
            for step in range(3):
                opt.zero_grad()
                m(torch.tensor([[rank, step], [step, 9 - rank]])).pow(2).mean().backward()
                opt.step()
            return [p.detach().clone() for p in m.parameters()]

        return run(cluster, worker)

    gathered = train(fusion_bytes=0)  # the embedding alone: the allgather path
    fused = train()  # small: fused with the linear layer, summed dense
    dense = train(sparse_as_dense=True)
    for ways in (gathered, fused, dense):
        assert all(torch.equal(a, b) for a, b in zip(ways[0], ways[1], strict=True))  # the same on every rank
    for a, b, c in zip(gathered[0], fused[0], dense[0], strict=True):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c)


def test_step_after_synchronize_warns_as_horovod_does(cluster):
    def worker(rank):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 1)
        opt = gwt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
        m(torch.ones(2, 3)).sum().backward()
        opt.synchronize()
        with pytest.warns(UserWarning, match="skip_synchronize"):
            opt.step()
        return True

    assert run(cluster, worker) == [True] * N


def test_the_optimizer_may_be_wrapped_before_init():
    assert not gradwire.is_initialized()
    m = torch.nn.Linear(3, 1)
    opt = gwt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    with pytest.raises(ValueError, match="duplicate names"):  # arguments are checked first, as after init()
        named = list(m.named_parameters())
        gwt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=named + named[:1])
    with pytest.raises(gradwire.ConfigError, match="call gradwire.init"):  # the first push needs a job
        m(torch.ones(1, 3)).sum().backward()


def test_byteps_init_keywords_and_declare():
    with pytest.raises(ValueError, match="MPI"):
        gwt.init(comm=object())
    assert gwt.declare("Gradient.fc.weight") == 0


def test_a_barrier_with_a_departed_peer_fails_at_once_naming_it():
    with LocalCluster(num_workers=3, num_servers=1) as c:
        c.workers[2].shutdown()
        started = time.monotonic()
        with pytest.raises(gradwire.WorkerLost, match=r"worker 0: barrier failed: worker 2 left the job") as info:
            c.workers[0].barrier()
        assert time.monotonic() - started < 1.0
        assert info.value.lost_rank == 2


def test_sync_batch_norm_equals_batch_norm_over_the_whole_batch(cluster):
    """Each rank holds a part of the batch; outputs, input gradients, parameter gradients and running statistics
    match torch's BatchNorm2d over the whole batch in one process."""
    torch.manual_seed(0)
    full = torch.randn(4 * N, 3, 5, 5) * 3 + 1
    upstream = torch.randn(4 * N, 3, 5, 5)
    reference = torch.nn.BatchNorm2d(3)
    reference.weight.data = torch.tensor([0.5, 2.0, -1.0])
    x = full.clone().requires_grad_()
    expected = reference(x)
    (expected * upstream).sum().backward()
    layers = []
    for _ in range(N):
        layer = gwt.SyncBatchNorm(3)
        layer.weight.data = reference.weight.data.clone()
        layers.append(layer)

    def worker(rank):
        part = full[4 * rank : 4 * rank + 4].clone().requires_grad_()
        out = layers[rank](part)
        (out * upstream[4 * rank : 4 * rank + 4]).sum().backward()
        weight_grad = gwt.allreduce(layers[rank].weight.grad, op=gwt.Sum, name="sbn.wgrad")
        return out.detach(), part.grad, weight_grad, layers[rank].running_mean, layers[rank].running_var

    results = run(cluster, worker)
    for rank, (out, grad, weight_grad, mean, var) in enumerate(results):
        rows = slice(4 * rank, 4 * rank + 4)
        torch.testing.assert_close(out, expected[rows].detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grad, x.grad[rows], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(weight_grad, reference.weight.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mean, reference.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(var, reference.running_var, rtol=1e-4, atol=1e-5)
