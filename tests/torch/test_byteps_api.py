"""BytePS's module wrapper (gradwire.torch.parallel.DistributedDataParallel) and CrossBarrier, on an in-process
cluster: the same parameters as one process with the whole batch, or as DistributedOptimizer, step by step."""

import pytest

import gradwire.torch as gwt
import torch
from tests.torch.inprocess import N, run


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


def _bn_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 2)
    )


def _data(steps, batch, shape=(10,), classes=3):
    g = torch.Generator().manual_seed(42)
    return [
        (torch.randn(batch * N, *shape, generator=g), torch.randint(0, classes, (batch * N,), generator=g))
        for _ in range(steps)
    ]


def _steps(model, opt, data, rank, batch, synchronize=False):
    """Train on this rank's slice of each batch; the parameters after each step (`synchronize`: a CrossBarrier's
    updates all applied first)."""
    after = []
    for x, y in data:
        opt.zero_grad()
        sl = slice(rank * batch, (rank + 1) * batch)
        torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
        opt.step()
        if synchronize:
            opt.synchronize()
        after.append([p.detach().clone() for p in model.parameters()])
    return after


def test_byteps_ddp_matches_one_process_with_the_whole_batch(cluster):
    data, batch = _data(8, 4), 4
    reference = _model(0)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()
    models = [_model(rank) for rank in range(N)]  # rank 1 starts elsewhere: the wrapper broadcasts rank 0's

    def worker(rank):
        model = gwt.parallel.DistributedDataParallel(models[rank])
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, y in data:
            opt.zero_grad()
            sl = slice(rank * batch, (rank + 1) * batch)
            torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
            assert not model._sync.handles  # backward returned with the averages in place
            opt.step()
        return models[rank]

    for model in run(cluster, worker):
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_byteps_ddp_no_sync_and_buffers(cluster):
    data = _data(4, 2, shape=(2, 6, 6), classes=2)
    models = [_bn_model(rank) for rank in range(N)]

    def worker(rank):
        model = gwt.parallel.DistributedDataParallel(models[rank])
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for i, (x, y) in enumerate(data):
            sl = slice(rank * 2, (rank + 1) * 2)
            if i % 2 == 0:
                opt.zero_grad()
                with model.no_sync():  # accumulate locally; pushed with the next backward
                    torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
                assert not model._sync.handles
                continue
            torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
            opt.step()
        model(data[0][0][:1])  # a forward broadcasts rank 0's buffers
        return models[rank].state_dict()

    a, b = run(cluster, worker)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("fusion_bytes", [0, 1 << 20], ids=["unfused", "fused"])
def test_cross_barrier_gives_distributed_optimizer_s_parameters(cluster, fusion_bytes):
    data, batch = _data(6, 4), 4

    models = {cross: [_model(0) for _ in range(N)] for cross in (False, True)}  # torch's RNG is not per thread

    def train(cross):
        def worker(rank):
            model = models[cross][rank]
            opt = gwt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                named_parameters=model.named_parameters(),
                fusion_bytes=fusion_bytes,
            )
            if cross:
                opt = gwt.cross_barrier.CrossBarrier(model, opt, num_steps=len(data))
            return _steps(model, opt, data, rank, batch, synchronize=cross)

        return run(cluster, worker)

    plain, crossed = train(False), train(True)
    for rank in range(N):
        for step_plain, step_crossed in zip(plain[rank], crossed[rank], strict=True):
            for a, b in zip(step_plain, step_crossed, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_cross_barrier_applies_updates_as_the_next_forward_reaches_each_layer(cluster):
    models = [_model(0) for _ in range(N)]

    def worker(rank):
        model = models[rank]
        opt = gwt.cross_barrier.CrossBarrier(
            model,
            gwt.DistributedOptimizer(  # unfused: each layer's sums travel (and arrive) on their own
                torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), fusion_bytes=0
            ),
        )
        x = torch.ones(4, 10)
        model(x).sum().backward()
        before = model[2].weight.detach().clone()
        opt.step()  # returns with the sums possibly still in flight: nothing applied yet
        assert len(opt._pending) == 4 and torch.equal(model[2].weight, before)
        model[0](x)  # only the first layer's forward: its update is applied, the last layer's still waits
        assert len(opt._pending) == 2
        model(x)
        assert not opt._pending and not torch.equal(model[2].weight, before)
        return True

    assert run(cluster, worker) == [True] * N


def test_allgather_in_bytepss_spelling_same_shape_or_not_with_an_output_and_its_gradient(cluster):
    """BytePS's `allgather(tensor, same_shape=..., name=...)`, its positional form, an output tensor after the input
    (its tests), `allgather_async(tensor, shape_list, ...)`, and the gradient: this rank's rows of the average."""

    def worker(rank):
        same = torch.full((2, 3), float(rank))
        ragged = torch.full((2 + rank, 3), float(rank))
        out = torch.empty(2 * N, 3)
        x = torch.full((2,), float(rank + 1), requires_grad=True)
        (gwt.allgather(x, same_shape=True, name="bps.grad") ** 2).sum().backward()
        return (
            gwt.allgather(same, same_shape=True, name="bps.same"),
            gwt.allgather(ragged, False, "bps.ragged"),
            gwt.allgather(same, out, same_shape=True, name="bps.out") is out and out,
            gwt.synchronize(gwt.allgather_async(ragged, [2 + r for r in range(N)], "bps.async")),
            x.grad,
        )

    results = run(cluster, worker)
    same = torch.cat([torch.full((2, 3), float(r)) for r in range(N)])
    ragged = torch.cat([torch.full((2 + r, 3), float(r)) for r in range(N)])
    for rank, (a, b, c, d, grad) in enumerate(results):
        assert torch.equal(a, same) and torch.equal(b, ragged) and torch.equal(c, same) and torch.equal(d, ragged)
        # d/dx of sum over ranks of gathered**2, averaged over the N ranks' losses: 2 x (each rank's loss has it)
        torch.testing.assert_close(grad, torch.full((2,), 2.0 * (rank + 1)))


def test_allgather_refuses_arguments_neither_api_has(cluster):
    def worker(rank):
        with pytest.raises(TypeError, match="unexpected"):
            gwt.allgather(torch.ones(1), name="a", colour="red")
        with pytest.raises(ValueError, match="shape_list says 5 rows"):
            gwt.allgather_async(torch.ones(2), [5] * N, "b")
        with pytest.raises(ValueError, match="the output has shape"):
            gwt.allgather(torch.ones(2), torch.empty(3), name="c")
        return True

    assert run(cluster, worker) == [True] * N


def test_the_cross_barrier_module_is_bytepss_whole_api_and_wraps_a_plain_optimizer(cluster):
    """`import ... cross_barrier as bps` scripts: init, rank, broadcast_parameters ... from the module, and
    CrossBarrier(model, torch optimizer, named_parameters=..., compression=..., num_steps=...) as BytePS's example
    calls it: the same parameters as DistributedOptimizer, step by step."""
    import gradwire.torch.cross_barrier as bps

    for name in (
        "init",
        "shutdown",
        "rank",
        "size",
        "local_rank",
        "push_pull",
        "broadcast_parameters",
        "broadcast_optimizer_state",
        "DistributedOptimizer",
        "Compression",
        "poll",
        "synchronize",
    ):
        assert getattr(bps, name) is getattr(gwt, name), name
    with pytest.raises(AttributeError):
        bps.no_such_thing  # noqa: B018
    data, batch = _data(4, 4), 4
    models = {cross: [_model(0) for _ in range(N)] for cross in (False, True)}

    def train(cross):
        def worker(rank):
            model = models[cross][rank]
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if cross:
                opt = bps.CrossBarrier(
                    model,
                    opt,
                    named_parameters=model.named_parameters(),
                    compression=bps.Compression.none,
                    num_steps=len(data),
                )
            else:
                opt = gwt.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            bps.broadcast_parameters(model.state_dict(), root_rank=0)
            return _steps(model, opt, data, rank, batch, synchronize=cross)[-1]

        return run(cluster, worker)

    for plain, crossed in zip(train(False), train(True), strict=True):
        for a, b in zip(plain, crossed, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
