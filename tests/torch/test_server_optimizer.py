"""ServerOptimizer: the servers hold parameters and optimizer state and step torch.optim's own optimizer.

Synchronous mode is checked bit for bit against DistributedOptimizer wrapping the same torch optimizer, in the same
cluster (its parameters and its state_dict); checkpoints go both ways between the two; asynchronous mode keeps the
staleness bound and trains; a server killed mid-training loses no parameter. In-process clusters: a thread per rank,
small partitions so every parameter spans several keys and servers."""

import copy
import threading
import time

import numpy as np
import pytest

import gradwire
import gradwire.torch as gw
import torch
from gradwire.errors import TensorError
from gradwire.testing import LocalCluster
from tests.torch.inprocess import run

torch.manual_seed(0)
_MODEL = torch.nn.Sequential(  # layers of mixed sizes: some span several partitions, some fit one
    torch.nn.Linear(10, 64), torch.nn.ReLU(), torch.nn.Linear(64, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3)
)
ALGORITHMS = {
    "adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 1e-2}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 1e-3}),
}


def _model():
    return copy.deepcopy(_MODEL)  # built once, outside the ranks' threads (torch's RNG is global)


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)


def _steps(model, optimizer, rank, steps, first=0, scheduler=None):
    for step in range(first, first + steps):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _same_state(a, b):
    """Two torch optimizer state_dicts hold the same tensors, bit for bit."""
    assert a["state"].keys() == b["state"].keys()
    for i, entry in a["state"].items():
        assert entry.keys() == b["state"][i].keys(), i
        for k, v in entry.items():
            assert torch.equal(v, b["state"][i][k]) if torch.is_tensor(v) else v == b["state"][i][k], (i, k)
    assert [g["lr"] for g in a["param_groups"]] == [g["lr"] for g in b["param_groups"]]


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_workers=3, num_servers=2, partition_bytes=1024) as c:
        yield c


@pytest.mark.parametrize("algorithm, steps", [("adam", 50), ("sgd", 12), ("adamw", 12), ("adagrad", 12)])
def test_sync_is_bit_identical_to_distributed_optimizer(cluster, algorithm, steps):
    cls, hyper = ALGORITHMS[algorithm]

    def worker(rank):
        local = _model()
        reference = gw.DistributedOptimizer(cls(local.parameters(), **hyper), named_parameters=local.named_parameters())
        _steps(local, reference, rank, steps, scheduler=torch.optim.lr_scheduler.StepLR(reference, 5, 0.5))
        served = _model()
        optimizer = gw.ServerOptimizer(served, algorithm, **hyper)
        assert isinstance(optimizer, cls) and not optimizer.state  # a torch optimizer, with no state on the worker
        _steps(served, optimizer, rank, steps, scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.5))
        return _params(local), _params(served), reference.state_dict(), optimizer.state_dict()

    for local, served, local_state, served_state in run(cluster, worker):
        assert all(torch.equal(a, b) for a, b in zip(local, served, strict=True))
        _same_state(local_state, served_state)


def test_checkpoints_go_both_ways_with_the_torch_optimizer(cluster):
    """A ServerOptimizer's state_dict resumes a local torch Adam, and a local Adam's resumes a ServerOptimizer, both
    bit-identical to a run that never stopped."""
    hyper = ALGORITHMS["adam"][1]

    def worker(rank):
        whole = _model()
        straight = gw.ServerOptimizer(whole, "adam", **hyper)
        _steps(whole, straight, rank, 10)
        # the first 5 steps on the servers, the next 5 on a local DistributedOptimizer from its checkpoint
        a = _model()
        first = gw.ServerOptimizer(a, "adam", **hyper)
        _steps(a, first, rank, 5)
        checkpoint = copy.deepcopy((a.state_dict(), first.state_dict()))
        b = _model()
        b.load_state_dict(checkpoint[0])
        local = gw.DistributedOptimizer(torch.optim.Adam(b.parameters(), **hyper), b.named_parameters())
        local.load_state_dict(checkpoint[1])
        _steps(b, local, rank, 5, first=5)
        # and back: 5 local steps, then 5 on the servers from the local optimizer's checkpoint
        c = _model()
        local2 = gw.DistributedOptimizer(torch.optim.Adam(c.parameters(), **hyper), c.named_parameters())
        _steps(c, local2, rank, 5)
        checkpoint = copy.deepcopy((c.state_dict(), local2.state_dict()))
        d = _model()
        resumed = gw.ServerOptimizer(d, "adam", **hyper)
        d.load_state_dict(checkpoint[0])
        resumed.load_state_dict(checkpoint[1])
        _steps(d, resumed, rank, 5, first=5)
        return _params(whole), _params(b), _params(d)

    for whole, b, d in run(cluster, worker):
        assert all(torch.equal(x, y) for x, y in zip(whole, b, strict=True))
        assert all(torch.equal(x, y) for x, y in zip(whole, d, strict=True))


def test_parameters_start_as_worker_zeros(cluster):
    def worker(rank):
        model = torch.nn.Linear(3, 2)
        with torch.no_grad():
            model.weight.fill_(rank)
            model.bias.fill_(rank)
        gw.ServerOptimizer(model, "sgd", lr=0.1)
        return _params(model)

    for weight, bias in run(cluster, worker):
        assert torch.all(weight == 0) and torch.all(bias == 0)


def test_arguments_are_checked_as_torch_checks_them(cluster):
    with gradwire.use_worker(cluster.workers[0]):
        with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
            gw.ServerOptimizer(torch.nn.Linear(2, 2), "lamb")
        with pytest.raises(ValueError, match="Invalid learning rate"):
            gw.ServerOptimizer(torch.nn.Linear(2, 2), "adam", lr=-1.0)
        with pytest.raises(ValueError, match="single-tensor step on CPU"):
            gw.ServerOptimizer(torch.nn.Linear(2, 2), "adam", fused=True)
        with pytest.raises(TensorError, match="float32 or float64"):
            gw.ServerOptimizer(torch.nn.Linear(2, 2).half(), "sgd", lr=0.1)


def test_async_keeps_the_staleness_bound_and_trains():
    bound, steps, slow = 2, 16, 2
    pushed = [0, 0, 0]
    violations = []
    losses = {}
    lock = threading.Lock()

    def worker(rank):
        model = _model()
        optimizer = gw.ServerOptimizer(model, "sgd", lr=0.2, momentum=0.5, staleness=bound)
        x, y = _batch(0, 0)  # one batch: the loss must fall
        first = None
        for step in range(steps):
            if rank == slow:
                time.sleep(0.03)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            first = float(loss.detach()) if first is None else first
            with lock:  # counted before backward, whose hooks push the gradients (the server may see them at once)
                pushed[rank] += 1
            loss.backward()
            optimizer.step()
            with lock:
                if min(pushed) < step + 1 - bound:
                    violations.append((rank, step, list(pushed)))
        with torch.no_grad():
            losses[rank] = (first, float(torch.nn.functional.cross_entropy(model(x), y)))

    with LocalCluster(num_workers=3, num_servers=2, partition_bytes=1024) as c:
        run(c, worker)
        staleness = max(s.status()["optimizer"]["staleness_max"] for s in c.servers)
    assert not violations, violations
    assert 0 < staleness  # the fast workers' pushes were applied on parameters the slow one had not seen
    for rank, (first, last) in losses.items():
        assert last < 0.7 * first, (rank, first, last)


def test_async_adam_with_delay_compensation_trains_and_reports_the_corrections():
    """ServerOptimizer(..., "adam", staleness=s, delay_compensation=lambda): the torch integration declares it, the
    servers correct the pushes (counted in /status and /metrics) and Adam still brings the loss down."""
    losses = {}

    def worker(rank):
        model = _model()
        optimizer = gw.ServerOptimizer(model, "adam", lr=0.02, staleness=1, delay_compensation=0.5)
        x, y = _batch(0, 0)
        with torch.no_grad():
            first = float(torch.nn.functional.cross_entropy(model(x), y))
        for _ in range(12):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        with torch.no_grad():
            losses[rank] = (first, float(torch.nn.functional.cross_entropy(model(x), y)))

    with LocalCluster(num_workers=2, num_servers=2, partition_bytes=1024) as c:
        run(c, worker)
        stats = [s.status()["optimizer"] for s in c.servers]
        metrics = c.servers[0].metrics.exposition()[2].decode()
    assert sum(s["delay_compensated"] for s in stats) > 0 and sum(s["delay_compensation_bytes"] for s in stats) > 0
    assert "gradwire_server_delay_compensated" in metrics
    for first, last in losses.values():
        assert last < 0.7 * first, losses
    with pytest.raises(ValueError, match="staleness > 0"):
        gw.ServerOptimizer(_model(), "sgd", lr=0.1, delay_compensation=0.5)


STEPS = 20


def test_compressed_gradients_train_identically_on_every_worker_and_follow_the_learning_rate():
    """ServerOptimizer(..., compression=onebit): every gradient travels as signs and a scale with the worker's error
    feedback, every worker is answered the same parameters, the loss falls; a learning rate halved doubles each
    residual (what it carries then moves the parameters as far as when it was dropped)."""
    losses, pushed = {}, {}

    def worker(rank):
        model = _model()
        optimizer = gw.ServerOptimizer(model, "sgd", lr=0.2, momentum=0.9, compression=gw.Compression.onebit())
        x, y = _batch(0, 0)  # one batch: the loss must fall
        worker = gradwire.current_worker()
        with torch.no_grad():
            first = float(torch.nn.functional.cross_entropy(model(x), y))
        before = worker.state.metrics.bytes_pushed
        for _ in range(STEPS):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        pushed[rank] = worker.state.metrics.bytes_pushed - before
        with torch.no_grad():
            losses[rank] = (first, float(torch.nn.functional.cross_entropy(model(x), y)))
        residuals = [e.residual.copy() for e in worker.calls.compressing.keys.values() if e.residual is not None]
        optimizer.param_groups[0]["lr"] = 0.1
        optimizer._follow_lr()
        doubled = [e.residual for e in worker.calls.compressing.keys.values() if e.residual is not None]
        assert residuals and all(np.array_equal(2 * a, b) for a, b in zip(residuals, doubled, strict=True))
        return _params(model)

    with LocalCluster(num_workers=2, num_servers=2, partition_bytes=1024, compression_min_bytes=0) as c:
        results = run(c, worker)
        decoded = sum(s.status()["optimizer"]["decoded"] for s in c.servers)
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1], strict=True))
    assert decoded > 0
    gradient_bytes = 4 * sum(p.numel() for p in _model().parameters())
    assert max(pushed.values()) < STEPS * gradient_bytes / 4  # signs, a scale and a trailer per partition
    for first, last in losses.values():
        assert last < 0.7 * first, losses


@pytest.mark.parametrize("standby", [0, 1], ids=["onto-survivors", "with-a-standby"])
def test_a_server_killed_mid_training_changes_no_bit(standby):
    """Adam, 3 workers, 3 servers; server 1 dies at step 10 of 20. Its keys go on on their replicas, which hold the
    parameters and Adam's moments: the result is bit-identical to DistributedOptimizer's failure-free run (done
    first, in the same cluster)."""
    killed = threading.Event()
    hyper = ALGORITHMS["adam"][1]

    def worker(rank):
        local = _model()
        reference = gw.DistributedOptimizer(torch.optim.Adam(local.parameters(), **hyper), local.named_parameters())
        _steps(local, reference, rank, 20)
        model = _model()
        optimizer = gw.ServerOptimizer(model, "adam", **hyper)
        for step in range(20):
            if step == 10 and rank == 0:
                c.kill_server(1)
                killed.set()
            _steps(model, optimizer, rank, 1, first=step)
        return _params(local), _params(model), reference.state_dict(), optimizer.state_dict()

    with LocalCluster(num_workers=3, num_servers=3, num_standby=standby, partition_bytes=1024) as c:
        results = run(c, worker)
        assert killed.is_set() and [f["server"] for f in c.scheduler.failovers] == [1]
        stats = [s.status()["optimizer"] for s in c.servers + c.standby]
        assert sum(s["restarts"] for s in stats) == 0  # no partition's state started afresh
        assert sum(s["replicated"] for s in stats) > 0
    for local, served, local_state, served_state in results:
        assert all(torch.equal(a, b) for a, b in zip(local, served, strict=True))
        _same_state(local_state, served_state)


def test_without_a_replica_a_dead_servers_partitions_restart_from_the_workers_parameters():
    """One server and a standby: nowhere to replicate. The standby starts the dead server's partitions from the
    parameters the workers hold, with Adam's moments afresh (docs/ps-mode.md): the job completes, every worker with
    the same parameters, and the restart is counted."""

    def worker(rank):
        model = _model()
        optimizer = gw.ServerOptimizer(model, "adam", lr=1e-2)
        for step in range(12):
            if step == 6 and rank == 0:
                c.kill_server(0)
            _steps(model, optimizer, rank, 1, first=step)
        return _params(model)

    with LocalCluster(num_workers=3, num_servers=1, num_standby=1, partition_bytes=1024) as c:
        results = run(c, worker)
        assert [f["to"] for f in c.scheduler.failovers] == ["standby"]
        assert sum(s.status()["optimizer"]["restarts"] for s in c.servers + c.standby) > 0
    for params in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], params, strict=True))


def test_server_memory_is_allocated_at_declaration_and_reported():
    """Adam's state is allocated with the key (not at its first update): parameters + 2 moments, on each key's
    server and on its replica, from the moment ServerOptimizer is built; /status and /metrics report it."""
    params = sum(p.numel() for p in _MODEL.parameters()) * 4

    def worker(rank):
        gw.ServerOptimizer(_model(), "adam", lr=1e-3)

    with LocalCluster(num_workers=2, num_servers=2, partition_bytes=1024) as c:
        run(c, worker)
        held = sum(s.status()["optimizer"]["bytes"] for s in c.servers)
        assert held == 2 * 3 * params  # primary and replica, each parameters + exp_avg + exp_avg_sq
        assert "gradwire_server_optimizer_bytes" in c.servers[0].metrics.exposition()[2].decode()
