"""The PyTorch integration on an in-process cluster: one thread (and one Worker) per rank."""

import pytest

import gradwire
import gradwire.torch as gwt
import torch
from tests.torch.inprocess import N, run


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


def _data(steps, batch):
    g = torch.Generator().manual_seed(42)
    return [
        (torch.randn(batch * N, 10, generator=g), torch.randint(0, 3, (batch * N,), generator=g)) for _ in range(steps)
    ]


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        lambda p: torch.optim.Adam(p, lr=0.01),
    ],
    ids=["sgd-momentum", "adam"],
)
def test_n_workers_match_one_process_with_n_times_the_batch(cluster, make_opt):
    data, batch = _data(20, 8), 8
    reference = _model()
    opt = make_opt(reference.parameters())
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()

    models = [_model() for _ in range(N)]  # here: torch's RNG is global, threads would interleave its draws

    def worker(rank):
        model = models[rank]
        opt = gwt.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters())
        for x, y in data:
            opt.zero_grad()
            sl = slice(rank * batch, (rank + 1) * batch)
            torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
            opt.step()
        return model

    for model in run(cluster, worker):
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_backward_passes_per_step_and_clipping(cluster):
    data, batch = _data(6, 4), 4
    reference = _model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i in range(0, 6, 2):
        opt.zero_grad()
        for x, y in data[i : i + 2]:
            (torch.nn.functional.cross_entropy(reference(x), y) / 2).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        opt.step()

    models = [_model() for _ in range(N)]

    def worker(rank):
        model = models[rank]
        opt = gwt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            backward_passes_per_step=2,
        )
        for i in range(0, 6, 2):
            opt.zero_grad()
            for x, y in data[i : i + 2]:
                sl = slice(rank * batch, (rank + 1) * batch)
                torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with opt.skip_synchronize():
                opt.step()
        return model

    for model in run(cluster, worker):
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_clear_errors_for_misuse(cluster):
    model = _model()
    with gradwire.use_worker(cluster.workers[0]):
        with pytest.raises(ValueError, match="duplicate names"):
            named = list(model.named_parameters())
            gwt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named + named[:1])
        with pytest.raises(ValueError, match="lacks 2"):
            gwt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=list(model.named_parameters())[:2]
            )

    def worker(rank):
        m = _model()
        opt = gwt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
        x, y = torch.randn(4, 10), torch.randint(0, 3, (4,))
        torch.nn.functional.cross_entropy(m(x), y).backward()
        with pytest.raises(gradwire.TensorError, match="zero_grad"):
            opt.zero_grad()
        with pytest.raises(gradwire.TensorError, match="backward_passes_per_step=1"):
            torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.synchronize()  # complete the round on every rank
        return True

    assert run(cluster, worker) == [True] * N


def test_broadcasts(cluster):
    models = [_model(seed=r) for r in range(N)]  # different on every rank

    def worker(rank):
        model = models[rank]
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        if rank == 0:  # only the root has optimizer state
            torch.nn.functional.cross_entropy(model(torch.randn(4, 10)), torch.tensor([0, 1, 2, 0])).backward()
            opt.step()
        gwt.broadcast_parameters(model.state_dict(), root_rank=0)
        gwt.broadcast_optimizer_state(opt, root_rank=0)
        obj = gwt.broadcast_object({"epoch": 7, "rank": rank}, root_rank=0)
        return model, opt.state_dict(), obj

    (m0, s0, o0), (m1, s1, o1) = run(cluster, worker)
    for a, b in zip(m0.state_dict().values(), m1.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert o0 == o1 == {"epoch": 7, "rank": 0}
    assert s1["state"].keys() == s0["state"].keys() and s0["state"]
    for k in s0["state"]:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s0["state"][k][field], s1["state"][k][field])


@pytest.mark.parametrize("compression,tol", [(gwt.Compression.fp16, 1e-3), (gwt.Compression.bf16, 1e-2)])
def test_compression_within_tolerance(cluster, compression, tol):
    torch.manual_seed(1)
    inputs = [torch.randn(5000) for _ in range(N)]
    expected = sum(inputs) / N

    def worker(rank):
        t = inputs[rank].clone()
        return gwt.push_pull(t, average=True, name=f"compressed-{compression.__name__}", compression=compression)

    for result in run(cluster, worker):
        assert result.dtype == torch.float32
        torch.testing.assert_close(result, expected, rtol=tol, atol=tol)


def test_cpu_tensors_travel_without_copies(cluster):
    def worker(rank):
        t = torch.full((1000,), float(rank + 1))
        ptr = t.data_ptr()
        out = gwt.push_pull_inplace(t, average=False, name="zero-copy")
        return out.data_ptr() == ptr and bool(torch.all(t == 3.0))

    assert run(cluster, worker) == [True, True]


def test_ddp_hook_matches_allreduce_hook(tmp_path):
    # DDP needs a process group even when the hook replaces its all-reduce: one gloo group per process is the rule,
    # so this runs as real processes
    from tests.multiprocess.harness import ROOT, launch

    result = launch(2, 1, str(ROOT / "tests" / "torch" / "ddp_job.py"), str(tmp_path / "store"), timeout=120)
    assert result.code == 0, result.output
    assert len(result.lines("[worker 0] DDP-HOOK-MATCH")) == 1, result.output
    assert len(result.lines("[worker 1] DDP-HOOK-COMPRESSED-IDENTICAL")) == 1, result.output
    # PowerSGD in the hook, where rank 2 is exact: allreduce_hook's parameters, bit-identical across ranks
    for rank in range(2):
        for way in ("module", "ddp"):
            assert len(result.lines(f"[worker {rank}] DDP-POWERSGD-MATCH {way}")) == 1, result.output


def test_small_gradients_are_fused_and_results_unchanged(cluster):
    data, batch = _data(4, 8), 8
    models = {fb: [_model() for _ in range(N)] for fb in (0, 1 << 20)}

    def train(fusion_bytes):
        def worker(rank):
            model = models[fusion_bytes][rank]
            opt = gwt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                named_parameters=model.named_parameters(),
                fusion_bytes=fusion_bytes,
            )
            for x, y in data:
                opt.zero_grad()
                sl = slice(rank * batch, (rank + 1) * batch)
                torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
                opt.step()
            return model, len({g.name for g in opt._groups.values()})

        return run(cluster, worker)

    unfused, fused = train(0), train(1 << 20)
    assert unfused[0][1] == 0 and fused[0][1] == 1  # all four parameters are small: one group
    declared = cluster.workers[0].table.tensors
    assert any(name.startswith("grad.fused.") for name in declared)
    for (a, _), (b, _) in zip(unfused, fused, strict=True):
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_init_shutdown_init_three_times_in_one_process():
    import uuid

    from tests.multiprocess.harness import ROOT, launch, leftover_processes

    marker = uuid.uuid4().hex
    result = launch(2, 2, str(ROOT / "tests" / "torch" / "reinit_job.py"), marker, timeout=90)
    assert result.code == 0, result.output
    for rank in range(2):
        for generation in range(3):
            assert result.lines(f"[worker {rank}] GENERATION {generation} rank {rank} of 2"), result.output
    assert not leftover_processes(marker)
