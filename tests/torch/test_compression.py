"""The servers' compressors through the torch API (docs/compression.md): DistributedOptimizer with Compression.onebit,
topk, randomk and dithering keeps every worker's parameters bit-identical after every step and trains; BytePS's
compression_params spelling takes the optimizer's momentum; push_pull and allreduce take a compressor; error feedback
follows the learning rate."""

import logging
import time

import pytest

import gradwire
import gradwire.torch as gwt
import torch
from tests.torch.inprocess import N, run

COMPRESSORS = {
    "onebit": gwt.Compression.onebit(),
    "topk": gwt.Compression.topk(0.05),
    "randomk": gwt.Compression.randomk(0.1),
    "dithering": gwt.Compression.dithering(),
}


def _model():
    torch.manual_seed(0)
    # layers of mixed sizes: the large ones are compressed, the small ones travel as they are (under 64 KiB)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4))


def _data(steps, batch=16):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 4, generator=g)
    xs = [torch.randn(batch * N, 64, generator=g) for _ in range(steps)]
    return [(x, (x @ w).argmax(1)) for x in xs]


def _train(cluster, make_optimizer, steps=30):
    data = _data(steps)
    models = [_model() for _ in range(N)]

    def worker(rank):
        model = models[rank]
        opt = make_optimizer(model)
        losses, params = [], []
        for x, y in data:
            opt.zero_grad()
            sl = slice(rank * 16, (rank + 1) * 16)
            loss = torch.nn.functional.cross_entropy(model(x[sl]), y[sl])
            loss.backward()
            opt.step()
            losses.append(loss.item())
            params.append([p.detach().clone() for p in model.parameters()])
        return losses, params

    return run(cluster, worker)


@pytest.mark.parametrize("method", COMPRESSORS)
def test_distributed_optimizer_trains_with_every_worker_identical(cluster, method):
    def make(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return gwt.DistributedOptimizer(opt, model.named_parameters(), compression=COMPRESSORS[method])

    (losses, params0), (_, params1) = _train(cluster, make)
    for a, b in zip(params0, params1, strict=True):  # after every step
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, losses


def test_bytesps_compression_params_take_the_optimizers_momentum(cluster):
    made = []

    def make(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        params = {"compressor": "onebit", "ef": "vanilla", "momentum": "nesterov", "scaling": True}
        wrapped = gwt.DistributedOptimizer(opt, model.named_parameters(), compression_params=params)
        made.append(wrapped)
        return wrapped

    (losses, params0), (_, params1) = _train(cluster, make)
    assert all(g["momentum"] == 0.0 for o in made for g in o.param_groups)  # the workers' momentum replaces it
    assert made[0]._sync.compression.args["momentum"] == 0.9
    assert all(torch.equal(x, y) for x, y in zip(params0[-1], params1[-1], strict=True))
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])


def test_push_pull_and_allreduce_take_a_compressor(cluster):
    torch.manual_seed(1)
    inputs = [torch.randn(40_000) for _ in range(N)]

    def worker(rank):
        a = gwt.push_pull(inputs[rank].clone(), average=True, name="pp", compression=COMPRESSORS["topk"])
        b = gwt.allreduce(inputs[rank].clone(), name="ar", compression=gwt.Compression.onebit(scaling=False))
        return a, b

    (a0, b0), (a1, b1) = run(cluster, worker)
    assert torch.equal(a0, a1) and torch.equal(b0, b1)
    assert (a0 != 0).sum() <= 0.05 * 40_000 + 1  # the server's top 5% of the sum
    assert b0.abs().unique().tolist() == [1.0 / N]  # unscaled signs: the server's +-1, averaged


def test_error_feedback_follows_the_learning_rate(cluster):
    def worker(rank):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = gwt.DistributedOptimizer(opt, model.named_parameters(prefix="lr"), compression=COMPRESSORS["topk"])
        x, y = _data(1)[0]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        store = opt._sync.worker.calls.compressing
        before = {k: e.residual.copy() for k, e in store.keys.items() if e.residual is not None}
        for group in opt.param_groups:
            group["lr"] = 0.05
        opt.zero_grad()
        opt._follow_lr()
        return {k: (before[k], store.keys[k].residual) for k in before}

    for pairs in run(cluster, worker):
        assert pairs
        for old, new in pairs.values():
            assert (new == old * 2).all()


def test_powersgd_trains_with_every_worker_identical(cluster, caplog):
    caplog.set_level(logging.INFO, logger="gradwire.compression")
    compressor = gwt.Compression.powersgd(rank=2, start_iter=2)

    def make(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return gwt.DistributedOptimizer(opt, model.named_parameters(prefix="psgd"), compression=compressor)

    (losses, params0), (_, params1) = _train(cluster, make)
    for a, b in zip(params0, params1, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    states = [s for (_, name), s in compressor._tensors.items() if name.endswith("0.weight")]
    assert states and all(s.steps == 30 and s.error.abs().sum() > 0 for s in states)  # compressed, with feedback
    said = [r.getMessage() for r in caplog.records if r.name == "gradwire.compression"]
    assert any("the first 2 steps of each tensor are plain sums" in m for m in said)  # what the first steps are
    assert sum("compressing from step 3 of" in m for m in said) == 1  # said once, when the first tensor begins


def test_powersgd_sums_p_and_q_on_the_servers_and_rebuilds_the_average(cluster):
    """Gradients of rank 2 spanning the same columns on every worker: rank-2 PowerSGD rebuilds their average (P spans
    the sum's columns, and P P^T projects the average onto them)."""
    a, c = torch.linspace(-1, 1, 300), torch.cos(torch.linspace(0, 6, 300))
    b, d = torch.linspace(0.5, 2, 200), torch.sin(torch.linspace(0, 3, 200))
    inputs = [torch.outer(a * (r + 1), b) + torch.outer(c, d * (2 - r)) for r in range(N)]
    compressor = gwt.Compression.powersgd(rank=2, start_iter=0)

    def worker(rank):
        return gwt.push_pull(inputs[rank].clone(), average=True, name="psgd.rank2", compression=compressor)

    results = run(cluster, worker)
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], sum(inputs) / N, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("servers", [True, False], ids=["onebit-topk", "powersgd"])
def test_byteps_ddp_and_cross_barrier_take_a_compressor(cluster, servers):
    """BytePS's module wrapper with compression=, and CrossBarrier over a compressed DistributedOptimizer (the
    servers' compressors, or PowerSGD): every rank's parameters identical after every step, and moved."""
    data = _data(6)
    models = {way: [_model() for _ in range(N)] for way in ("ddp", "cross")}
    powersgd = gwt.Compression.powersgd(rank=2, start_iter=2)
    compressors = (
        {"ddp": COMPRESSORS["onebit"], "cross": COMPRESSORS["topk"]}
        if servers
        else dict.fromkeys(("ddp", "cross"), powersgd)
    )

    def worker(rank, way):
        model = models[way][rank]
        if way == "ddp":
            wrapped = gwt.parallel.DistributedDataParallel(model, compression=compressors[way])
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        else:
            wrapped = model
            named = model.named_parameters(prefix="cross" if servers else "cross-psgd")
            opt = gwt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), named, compression=compressors[way]
            )
            opt = gwt.cross_barrier.CrossBarrier(model, opt, num_steps=len(data))
        after = []
        for x, y in data:
            opt.zero_grad()
            sl = slice(rank * 16, (rank + 1) * 16)
            torch.nn.functional.cross_entropy(wrapped(x[sl]), y[sl]).backward()
            opt.step()
            if way == "cross":
                opt.synchronize()
            after.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
        return after

    start = torch.cat([p.detach().reshape(-1) for p in _model().parameters()])
    for way in ("ddp", "cross"):
        steps0, steps1 = run(cluster, lambda rank, way=way: worker(rank, way))
        assert all(torch.equal(a, b) for a, b in zip(steps0, steps1, strict=True)), way
        assert not torch.equal(steps0[-1], start), way
    if not servers:  # the large matrix went as P and Q from the third step on, in both wrappers
        steps = sorted(st.steps for (_, name), st in powersgd._tensors.items() if name.endswith("0.weight"))
        assert len(steps) == 2 * N and all(st.error.abs().sum() > 0 for st in powersgd._tensors.values()), steps


def test_powersgd_carries_a_steps_matrices_in_one_sum_of_p_and_one_of_q(cluster):
    """The matrices started before any is waited for travel together (torch's hook does so with a bucket): one sum of
    every P, one of every Q, each matrix's result what it is alone; polling `done()` moves them on too."""
    shapes = [(300, 200), (64, 96), (128, 40)]
    inputs = [[torch.randn(s, generator=torch.Generator().manual_seed(10 * r + i)) for i, s in enumerate(shapes)]
              for r in range(N)]  # fmt: skip
    together, alone = gwt.Compression.powersgd(rank=2, start_iter=0), gwt.Compression.powersgd(rank=2, start_iter=0)

    def worker(rank):
        worker = gradwire.current_worker()
        before = set(worker.table.tensors)
        handles = [
            gwt.allreduce_async(t.clone(), name=f"m{i}", compression=together) for i, t in enumerate(inputs[rank])
        ]
        while not all(h.done() for h in handles):
            time.sleep(0.001)
        sums = [t.user_name for k, t in worker.table.tensors.items() if k not in before]
        batched = [gwt.synchronize(h) for h in handles]
        singles = [gwt.push_pull(t.clone(), name=f"m{i}", compression=alone) for i, t in enumerate(inputs[rank])]
        return sums, batched, singles

    results = run(cluster, worker)
    sums = results[0][0]
    assert len(sums) == 2 and sums[0].endswith(".p") and sums[1].endswith(".q") and sums[0].startswith("m0+2"), sums
    for _, batched, singles in results:
        for got, want, first in zip(batched, singles, results[0][1], strict=True):
            assert torch.equal(got, want) and torch.equal(got, first)  # the same bits as alone, on every worker


def test_a_powersgd_batch_of_a_megabyte_leaves_before_it_is_waited_for(cluster):
    """A large layer's matrix goes out as backward produces it (overlapping the rest of backward); small ones wait
    until one of them is waited for, then travel together."""
    big, small = (600, 500), (40, 30)  # 1.2 MB and 4.8 KB of float32

    def worker(rank):
        worker, compressor = gradwire.current_worker(), gwt.Compression.powersgd(rank=2, start_iter=0)
        before = set(worker.table.tensors)

        def sums():
            return sorted(t.user_name for k, t in worker.table.tensors.items() if k not in before)

        first = gwt.allreduce_async(torch.ones(small), name="small", compression=compressor)
        none_yet = sums()
        second = gwt.allreduce_async(_rank2(big, rank), name="big", compression=compressor)
        left = sums()  # the batch (small, big) holds a megabyte: its P sum has left
        third = gwt.allreduce_async(torch.ones(small), name="small2", compression=compressor)
        still = sums()
        results = [gwt.synchronize(h) for h in (first, second, third)]
        return none_yet, left, still, results

    for none_yet, left, still, results in run(cluster, worker):
        assert none_yet == [] and left and left[0].startswith("small+1.") and left[0].endswith(".p"), left
        # the first batch's P has left, and its Q once P's sum is back (the receiving thread computes it, so it may
        # already have left too); nothing of the third call's batch, which waits to be waited for
        first_batch = {left[0], left[0][: -len(".p")] + ".q"}
        assert set(left) <= first_batch and set(still) <= first_batch, (left, still)
        average = sum(_rank2(big, r) for r in range(N)) / N  # rank-2 matrices: rebuilt exactly
        torch.testing.assert_close(results[1], average, rtol=1e-4, atol=1e-4)


def test_a_powersgd_batch_is_done_by_its_sums_alone_before_anyone_waits(cluster):
    """Each sum of a batch that has left moves it on as it arrives (Q computed and sent, then the approximation and
    the residual made) on the compressor's thread: a training thread still in backward finds it done."""
    big = (600, 500)

    def worker(rank):
        compressor = gwt.Compression.powersgd(rank=2, start_iter=0)
        call = gwt.allreduce_async(_rank2(big, rank), name="alone", compression=compressor)
        deadline = time.monotonic() + 30
        while call.batch.stage != "done" and time.monotonic() < deadline:  # no done(), no synchronize
            time.sleep(0.005)
        return call.batch.stage, gwt.synchronize(call)

    average = sum(_rank2(big, r) for r in range(N)) / N
    for stage, result in run(cluster, worker):
        assert stage == "done"
        torch.testing.assert_close(result, average, rtol=1e-4, atol=1e-4)


def test_distributed_optimizer_never_fuses_a_matrix_powersgd_compresses(cluster):
    """Small matrices PowerSGD shrinks (10 x 64 and 64 x 5 here, under the fusion size) travel as P and Q, as torch's
    hook carries every matrix of a bucket; the biases and a matrix too small to gain travel fused, across them."""
    before = {}

    def worker(rank):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 64), torch.nn.Linear(64, 10), torch.nn.Linear(10, 3))
        worker = gradwire.current_worker()
        before[rank] = set(worker.table.tensors)
        compressor = gwt.Compression.powersgd(rank=2, start_iter=0)
        opt = gwt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), compression=compressor
        )
        torch.nn.functional.cross_entropy(model(torch.randn(8, 5)), torch.randint(0, 3, (8,))).backward()
        opt.step()
        return sorted(t.user_name for k, t in worker.table.tensors.items() if k not in before[rank])

    for names in run(cluster, worker):
        # both matrices in one batch (started before any is waited for): one sum of P, one of Q
        assert [n.rsplit(".", 1)[1] for n in names if n.startswith("grad.1.weight+1.powersgd.")] == ["p", "q"], names
        # in backward order 2.bias, 2.weight, 1.bias, (1.weight apart), 0.bias, (0.weight apart): one fused sum
        assert [n.rsplit(".", 1)[0] for n in names if n.startswith("grad.fused.")] == ["grad.fused.2.bias..0.bias.4"]
        assert len(names) == 3, names


def _rank2(shape, rank):
    a, c = torch.linspace(-1, 1, shape[0]), torch.cos(torch.linspace(0, 6, shape[0]))
    b, d = torch.linspace(0.5, 2, shape[1]), torch.sin(torch.linspace(0, 3, shape[1]))
    return torch.outer(a * (rank + 1), b) + torch.outer(c, d * (2 - rank))


@pytest.mark.parametrize("name,k,expect", [("topk", 0.05, "compressed"), ("powersgd", 2, "sum"), ("", 0.01, "sum")])
def test_gradwire_compressor_names_the_default_compressor(name, k, expect):
    """GRADWIRE_COMPRESSOR (BytePS's BYTEPS_COMPRESSOR) and _K: DistributedOptimizer's compressor where the code
    names none (PowerSGD's sums of P and Q are plain sums, as no compressor's are)."""
    from gradwire.testing import LocalCluster

    with LocalCluster(num_workers=N, num_servers=1, compressor=name, compressor_k=k) as c:
        models = [_model() for _ in range(N)]

        def worker(rank):
            model = models[rank]
            opt = gwt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
            for x, y in _data(3):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[:16]), y[:16]).backward()
                opt.step()
            return {t.user_name: t.signature.key_op for t in gradwire.current_worker().table.tensors.values()}

        ops = run(c, worker)[0]
    assert ops["grad.0.weight"] == expect  # the 64 x 512 layer (128 KiB): compressed unless PowerSGD or none
    if name == "powersgd":  # its first steps are plain sums: what counts them is the one PowerSGD of that setting
        from gradwire.torch.compression import _named

        assert any(s.steps == 3 for s in _named("powersgd", k)._tensors.values())


def test_the_ddp_hook_s_sub_buckets_carry_each_powersgd_matrix_alone_and_the_biases_around_them_in_one_sum():
    """In DDP's bucket order (last layer first) a bias sits between every two matrices: each matrix PowerSGD carries
    goes apart, and the biases, a matrix too small to gain and the rest still go together (every sum waits for the
    slowest worker: five biases in five sums cost five waits), up to the fusion size and by dtype."""
    from gradwire.torch.hook import sub_buckets

    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 64), torch.nn.Linear(64, 3))
    w0, b0, w1, b1, w2, b2 = model.parameters()
    powersgd = gwt.Compression.powersgd(rank=2)
    bucket = [b2, w2, b1, w1, b0, w0]  # DDP's order; w2 (3 x 64) is too small to gain
    groups = sub_buckets(bucket, cap=1 << 20, alone=powersgd)
    assert [[id(p) for p in g] for g in groups] == [[id(b2), id(w2), id(b1), id(b0)], [id(w1)], [id(w0)]]
    small = sub_buckets(bucket, cap=3 * 64 * 4 + 3 * 4 + 64 * 4, alone=powersgd)  # b2, w2 and b1 fill it
    assert [len(g) for g in small] == [3, 1, 1, 1] and small[2][0] is b0
    assert [len(g) for g in sub_buckets(bucket, cap=1 << 20)] == [6]  # no PowerSGD: one sum
    half = [b2.detach().half(), b1]
    assert [len(g) for g in sub_buckets(half, cap=1 << 20, alone=powersgd)] == [1, 1]  # by dtype


def test_a_finished_powersgd_step_leaves_no_reference_cycle_for_the_garbage_collector(cluster):
    """A call and its batch referred to each other (and the sum's handle, through its callback): every step left its
    tensors, locks and events for the collector. Once a batch is done it lets go of its calls and its handle."""
    import gc

    def worker(rank):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 64))
        opt = gwt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            compression=gwt.Compression.powersgd(rank=2, start_iter=0),
        )
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
        return True

    run(cluster, worker)  # the first steps declare, warm and cache what later steps reuse
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run(cluster, worker)
        gc.collect()
        left = sorted({type(o).__name__ for o in gc.garbage if type(o).__module__ == "gradwire.torch.powersgd"})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []
