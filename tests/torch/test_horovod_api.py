"""Horovod's collectives, checked exactly: every op, every dtype gradwire carries, odd sizes, 1 to 4
workers, process sets, gradients, and the errors Horovod raises, on every rank. In-process clusters: a thread per
rank, small partitions so every tensor spans several keys and servers."""

import threading

import pytest

import gradwire
import gradwire.torch as hvd
import torch
from gradwire.testing import LocalCluster
from tests.torch.inprocess import run

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.int8,
    torch.int16,
]
SIZES = [1, 2, 3, 4]


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"{n}w")
def cluster(request):
    with LocalCluster(num_workers=request.param, num_servers=2, partition_bytes=256) as c:
        yield c


def _values(rank, shape, dtype, seed=0):
    """Small integers (exact in every dtype, sums and products too), different on every rank."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-3, 4, shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reductions_of_every_dtype(cluster, dtype):
    n = len(cluster.workers)
    shape = (7, 13)  # 91 elements: odd, across several partitions
    ops = [("sum", hvd.Sum), ("min", hvd.Min), ("max", hvd.Max), ("product", hvd.Product)]

    def worker(rank):
        return {name: hvd.allreduce(_values(rank, shape, dtype), name=f"r.{name}.{dtype}", op=op) for name, op in ops}

    inputs = torch.stack([_values(r, shape, dtype).to(torch.float64) for r in range(n)])
    expected = {
        "sum": inputs.sum(0),
        "min": inputs.min(0).values,
        "max": inputs.max(0).values,
        "product": inputs.prod(0),
    }
    for out in run(cluster, worker):
        for name, want in expected.items():
            got = out[name]
            assert got.dtype == dtype and got.shape == shape
            if dtype == torch.uint8:  # wraps around, as torch's own uint8 arithmetic
                want = want.to(torch.int64).remainder(256)
            torch.testing.assert_close(got.to(torch.float64), want.to(torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allgather_with_first_dimensions_that_differ_by_rank(cluster, dtype):
    n = len(cluster.workers)

    def worker(rank):
        mine = _values(rank, (rank + 1, 3, 5), dtype)
        return hvd.allgather(mine, name=f"ag.{dtype}"), hvd.synchronize(hvd.allgather_async(mine))

    expected = torch.cat([_values(r, (r + 1, 3, 5), dtype) for r in range(n)])
    for named, unnamed in run(cluster, worker):
        assert torch.equal(named, expected) and torch.equal(unnamed, expected)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.bool], ids=str)
def test_broadcast_from_every_root(cluster, dtype):
    n = len(cluster.workers)

    def worker(rank):
        out = []
        for root in range(n):
            mine = _values(rank, (11, 3), dtype)
            copy = hvd.broadcast(mine, root_rank=root, name=f"b.{dtype}")
            hvd.broadcast_(mine, root_rank=root, name=f"b_.{dtype}")
            out.append((copy, mine))
        return out

    for out in run(cluster, worker):
        for root, (copy, in_place) in enumerate(out):
            want = _values(root, (11, 3), dtype)
            assert torch.equal(copy, want) and torch.equal(in_place, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64], ids=str)
def test_reducescatter_gives_each_rank_its_rows(cluster, dtype):
    n = len(cluster.workers)
    rows = 2 * n + 1  # uneven: the first rank(s) get one more row

    def worker(rank):
        return hvd.reducescatter(_values(rank, (rows, 3), dtype), name=f"rs.{dtype}", op=hvd.Sum)

    total = sum(_values(r, (rows, 3), dtype).to(torch.float64) for r in range(n))
    start = 0
    for rank, got in enumerate(run(cluster, worker)):
        mine = rows // n + (1 if rank < rows % n else 0)
        assert got.dtype == dtype and got.shape == (mine, 3)
        torch.testing.assert_close(got.to(torch.float64), total[start : start + mine], rtol=0, atol=0)
        start += mine


def test_alltoall_with_and_without_splits(cluster):
    n = len(cluster.workers)

    def worker(rank):
        splits = [(rank + j) % 3 for j in range(n)]  # zero rows to some ranks
        rows = torch.cat([torch.full((s, 2), 10.0 * rank + j) for j, s in enumerate(splits)])
        got, received = hvd.alltoall(rows, splits=torch.tensor(splits, dtype=torch.int32), name="a2a")
        equal = hvd.alltoall(torch.arange(2 * n, dtype=torch.int64) + 100 * rank, name="a2a.equal")
        return got, received, equal

    for rank, (got, received, equal) in enumerate(run(cluster, worker)):
        counts = [(r + rank) % 3 for r in range(n)]
        assert received.tolist() == counts
        assert torch.equal(got, torch.cat([torch.full((c, 2), 10.0 * r + rank) for r, c in enumerate(counts)]))
        assert equal.tolist() == [100 * r + 2 * rank + k for r in range(n) for k in range(2)]


def test_average_prescale_postscale_and_integer_average(cluster):
    n = len(cluster.workers)

    def worker(rank):
        f = hvd.allreduce(torch.full((5,), float(rank + 1)), name="avg", prescale_factor=2.0, postscale_factor=0.5)
        i = hvd.allreduce(torch.full((5,), -(rank + 1), dtype=torch.int32), name="avg.int")  # truncated to zero
        return f, i

    mean = sum(range(1, n + 1)) / n
    for f, i in run(cluster, worker):
        assert torch.equal(f, torch.full((5,), mean))
        assert torch.equal(i, torch.full((5,), int(-sum(range(1, n + 1)) / n), dtype=torch.int32))


def test_grouped_collectives(cluster):
    n = len(cluster.workers)

    def worker(rank):
        tensors = [torch.full((k + 1,), float(rank + k)) for k in range(3)]
        summed = hvd.grouped_allreduce(tensors, op=hvd.Sum, name="g")
        hvd.grouped_allreduce_(tensors, op=hvd.Sum)
        gathered = hvd.synchronize(hvd.grouped_allgather_async([torch.tensor([rank, rank])]))
        scattered = hvd.grouped_reducescatter([torch.ones(n, 2)], op=hvd.Sum)
        return summed, tensors, gathered, scattered

    for summed, in_place, gathered, scattered in run(cluster, worker):
        for k in range(3):
            want = torch.full((k + 1,), float(sum(r + k for r in range(n))))
            assert torch.equal(summed[k], want) and torch.equal(in_place[k], want)
        assert gathered[0].tolist() == [r for r in range(n) for _ in range(2)]
        assert torch.equal(scattered[0], torch.full((1, 2), float(n)))


def test_objects(cluster):
    n = len(cluster.workers)

    def worker(rank):
        return hvd.allgather_object({"rank": rank}), hvd.broadcast_object([rank] * 3, root_rank=n - 1)

    for gathered, broadcast in run(cluster, worker):
        assert gathered == [{"rank": r} for r in range(n)] and broadcast == [n - 1] * 3


def test_gradients_are_horovods(cluster):
    n = len(cluster.workers)

    def worker(rank):
        x = torch.full((n + 1, 2), float(rank + 1), requires_grad=True)
        (hvd.allreduce(x, op=hvd.Sum, name="grad.ar") * 2).sum().backward()
        ar = x.grad.clone()
        x.grad = None
        (hvd.allgather(x, name="grad.ag") * (rank + 1)).sum().backward()
        ag = x.grad.clone()
        x.grad = None
        hvd.broadcast(x, root_rank=0, name="grad.b").sum().backward()
        b = x.grad.clone()
        x.grad = None
        hvd.reducescatter(x, name="grad.rs", op=hvd.Sum).sum().backward()
        return ar, ag, b, x.grad

    mean_weight = sum(range(1, n + 1)) / n
    for rank, (ar, ag, b, rs) in enumerate(run(cluster, worker)):
        assert torch.equal(ar, torch.full((n + 1, 2), 2.0 * n))  # the sum of the gradients (2 from every rank)
        assert torch.allclose(ag, torch.full((n + 1, 2), mean_weight))  # this rank's rows of the averaged gradient
        assert torch.equal(b, torch.full((n + 1, 2), 1.0 if rank == 0 else 0.0))
        assert torch.equal(rs, torch.full((n + 1, 2), float(n)))  # the allgathered gradient, times n for a Sum


def test_process_sets(cluster):
    n = len(cluster.workers)
    if n < 2:
        pytest.skip("needs two ranks")
    even, odd = list(range(0, n, 2)), list(range(1, n, 2))

    def worker(rank):
        sets = {"even": hvd.ProcessSet(even), "odd": hvd.ProcessSet(odd)}
        for i, ps in enumerate(sets.values()):
            ps.process_set_id = i + 1  # as add_process_set numbers them (it is per process: here, threads share one)
        mine = sets["even" if rank in even else "odd"]
        out = {
            "sum": hvd.allreduce(torch.full((3,), float(rank + 1)), op=hvd.Sum, process_set=mine),
            "avg": hvd.allreduce(torch.full((3,), float(rank + 1)), process_set=mine),
            "gather": hvd.allgather(torch.tensor([rank]), process_set=mine),
            "bcast": hvd.broadcast(torch.tensor([rank]), root_rank=mine.ranks[-1], process_set=mine),
            "scatter": hvd.reducescatter(torch.ones(len(mine.ranks), 1), op=hvd.Sum, process_set=mine),
        }
        hvd.barrier(process_set=mine)
        out["all"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after")
        return out

    for rank, out in enumerate(run(cluster, worker)):
        ranks = even if rank in even else odd
        assert torch.equal(out["sum"], torch.full((3,), float(sum(r + 1 for r in ranks))))
        assert torch.equal(out["avg"], torch.full((3,), sum(r + 1 for r in ranks) / len(ranks)))
        assert out["gather"].tolist() == ranks and out["bcast"].tolist() == [ranks[-1]]
        assert torch.equal(out["scatter"], torch.full((1, 1), float(len(ranks))))
        assert out["all"].item() == n


def test_errors_are_horovods_on_every_rank(cluster):
    n = len(cluster.workers)
    if n < 2:
        pytest.skip("needs two ranks")
    go = threading.Barrier(n)

    def worker(rank):
        raised = []
        go.wait()
        for call in (
            lambda: hvd.allreduce(torch.ones(17 + rank), name="e.shape"),  # shapes differ
            lambda: hvd.allgather(torch.ones(2, 3 + rank), name="e.rows"),  # non-first dimensions differ
            lambda: hvd.allreduce(torch.ones(3, dtype=torch.float32 if rank else torch.float64), name="e.dtype"),
            lambda: hvd.broadcast(torch.ones(3), root_rank=rank, name="e.root"),  # roots differ
        ):
            with pytest.raises(RuntimeError, match=r"declared differently by the workers") as info:
                call()
            assert isinstance(info.value, gradwire.TensorMismatch)
            raised.append(type(info.value).__name__)
        with pytest.raises(ValueError, match="root rank"):
            hvd.broadcast(torch.ones(1), root_rank=n, name="e.bad_root")
        with pytest.raises(ValueError, match="splits"):
            hvd.alltoall(torch.ones(3), splits=[5] * n, name="e.splits")
        with pytest.raises(RuntimeError, match="Adasum|adasum"):
            hvd.allreduce(torch.ones(2), op=hvd.Adasum)
        first = hvd.allreduce_async(torch.ones(2), name="e.dup")
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allreduce_async(torch.ones(2), name="e.dup")
        hvd.synchronize(first)
        # after every error the job goes on, and the names are free again
        return raised, hvd.allreduce(torch.ones(4), name="e.shape", op=hvd.Sum)

    for raised, after in run(cluster, worker):
        assert raised == ["TensorMismatch"] * 4
        assert torch.equal(after, torch.full((4,), float(n)))


@pytest.mark.parametrize("cached", [False, True], ids=["new-tensors", "declared-before"])
def test_join_lets_the_others_allreduce_with_zeros_in_its_place(cluster, cached):
    """Horovod's join: each rank in turn joins first; the others' averages count it as zeros (divided by every
    rank); an allgather or broadcast among them fails with a RuntimeError; join returns the last rank to join, the
    same everywhere; and the joined rank's later collectives line up with the others' (it skipped their rounds)."""
    n = len(cluster.workers)
    if n == 1:
        pytest.skip("needs two ranks")

    def worker(rank):
        out = []
        for first in range(n):
            a = torch.arange(12, dtype=torch.float32).reshape(3, 4) + first
            b = torch.full((17,), 3, dtype=torch.int32)
            tag = f"{cached}"
            if cached:
                hvd.allreduce(a, name=f"join.a.{tag}"), hvd.allreduce(b, name=f"join.b.{tag}")
            if rank == first:
                last = hvd.join()
            else:
                avg_a = hvd.allreduce(a, name=f"join.a.{tag}")
                avg_b = hvd.allreduce(b, name=f"join.b.{tag}")
                assert torch.allclose(avg_a, a * (n - 1) / n), (avg_a, a)
                assert torch.equal(avg_b, torch.div(b * (n - 1), n, rounding_mode="trunc")), avg_b
                with pytest.raises(RuntimeError):  # unnamed, as Horovod's test: the joined rank skipped a name
                    hvd.allgather(a)
                with pytest.raises(RuntimeError):
                    hvd.broadcast(a, 0 if first else 1, name=f"join.bcast.{first}.{tag}")
                last = hvd.join()
            out.append(last)
            # everyone on again: a sum over every rank, the joined one included
            total = hvd.allreduce(torch.ones(5), name=f"join.after.{tag}", op=hvd.Sum)
            assert torch.equal(total, torch.full((5,), float(n))), total
        return out

    results = run(cluster, worker)
    for first in range(n):
        lasts = {r[first] for r in results}
        assert len(lasts) == 1 and lasts != {first}, (first, results)
