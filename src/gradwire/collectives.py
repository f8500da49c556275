"""Horovod's collectives beyond allreduce, on numpy arrays, carried by the servers' per-key operations.

- `allgather_async`: the first dimension may differ by rank. Two rounds: a gather of every rank's first dimension
  (8 bytes each), then a gather of the data, declared as the output's shape, that each rank fills with its rows.
- `broadcast_async`: a gather to which only the root contributes: the root pushes S bytes, every rank pulls S (a
  broadcast by summing zeros pushed S from every rank).
- `reducescatter_async`: a reduction whose result each rank pulls only its rows of: every rank pushes S and pulls
  S/n, where an allreduce pulls S. Rows are split as Horovod does: d0 // n each, the first d0 % n ranks one more.
- `alltoall_async`: a gather of every rank's splits (n integers each), then one gather per destination that only
  the destination pulls: every rank pushes its tensor once and pulls what is sent to it.

Two-round collectives return at once: the second round is started by a helper thread (one per process) when the
first one's result arrives, so a rank never blocks in an `_async` call waiting for the others (Horovod's tests rely
on that).
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable

import numpy as np

from gradwire.errors import GradwireError, NotSupported, TensorError
from gradwire.worker import Handle, Worker

log = logging.getLogger("gradwire.worker")


# Horovod's reduction ops, as every adapter names them. Average and Sum are what summation servers compute; Min, Max
# and Product are per-key operations of the servers; Adasum is not carried.
Average = "average"
Sum = "sum"
Adasum = "adasum"
Min = "min"
Max = "max"
Product = "product"
KEY_OPS = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "product"}  # Horovod's op -> the servers'
_OPS = (Average, Sum, Adasum, Min, Max, Product)


def horovod_op(average: bool | None, op: str | None, rank: int, name: str | None = None) -> str:
    """Horovod's rules for a reduction's arguments: `average` (deprecated) and `op` are exclusive; the default is
    Average; Adasum is refused (NotSupported, naming the rank and the tensor)."""
    if average is not None and op is not None:
        raise ValueError("allreduce takes op or average (deprecated), not both")
    if average is not None:
        return Average if average else Sum
    op = Average if op is None else op
    if op not in _OPS:
        raise ValueError(f"op must be one of Average, Sum, Adasum, Min, Max, Product; got {op!r}")
    if op == Adasum:
        raise NotSupported(
            f"worker {rank}: op=adasum of {name or 'an unnamed tensor'!r} is not supported: Adasum combines pairs of "
            "gradients recursively, which summation servers do not (docs/horovod.md)",
            tensor=name,
            rank=rank,
        )
    return op


def row_split(rows: int, size: int) -> list[int]:
    """Horovod's split of `rows` over `size` ranks: rows // size each, the first rows % size one more."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def _ranks(worker: Worker, members: list[int] | None) -> list[int]:
    """The ranks taking part (a process set's, or every worker's); this worker must be one of them."""
    ranks = list(range(worker.size)) if members is None else sorted(members)
    if worker.rank not in ranks or ranks[0] < 0 or ranks[-1] >= worker.size:
        raise TensorError(f"worker {worker.rank} called a collective of the ranks {ranks}", rank=worker.rank)
    return ranks


def _row_elements(array: np.ndarray) -> int:
    return int(np.prod(array.shape[1:], dtype=np.int64)) if array.ndim else 1


def broadcast_async(
    worker: Worker,
    array: np.ndarray,
    root: int,
    name: str,
    out: np.ndarray | None = None,
    priority: int = 0,
    dtype: str | None = None,
    members: list[int] | None = None,
) -> Handle:
    """Every rank receives the root's `array` (into `out`, which may be `array` itself, or a new array)."""
    ranks = _ranks(worker, members)
    if root not in ranks:
        raise TensorError(
            f"worker {worker.rank}: broadcast of {name!r} from root rank {root}, but its ranks are {ranks[0]} to "
            f"{ranks[-1]}" + ("" if members is None else f" (the process set {ranks})"),
            tensor=name,
            rank=worker.rank,
        )
    out = np.empty_like(array) if out is None else out
    counts = [array.size if r == root else 0 for r in range(worker.size)]
    source = array if worker.rank == root else array.reshape(-1)[:0]
    return worker.gather_async(
        source,
        name,
        counts,
        out,
        priority=priority,
        shape=array.shape,
        meta=f"root {root}",
        dtype=dtype,
        members=members,
    )


def reducescatter_async(
    worker: Worker,
    array: np.ndarray,
    name: str,
    average: bool = False,
    op: str = "sum",
    priority: int = 0,
    dtype: str | None = None,
    members: list[int] | None = None,
) -> Handle:
    """Reduce `array` over all ranks (or `members`); this rank receives its rows of the result (see `row_split`)."""
    ranks = _ranks(worker, members)
    if array.ndim == 0:
        raise TensorError(
            f"worker {worker.rank}: reducescatter of {name!r} needs a tensor of at least one dimension (a scalar "
            "cannot be split)",
            tensor=name,
            rank=worker.rank,
        )
    rows, per_row = row_split(array.shape[0], len(ranks)), _row_elements(array)
    starts = np.cumsum([0] + rows)
    slices = [(0, 0)] * worker.size
    for k, r in enumerate(ranks):
        slices[r] = (int(starts[k]) * per_row, rows[k] * per_row)
    out = np.empty((rows[ranks.index(worker.rank)], *array.shape[1:]), array.dtype)
    return worker.reduce_scatter_async(array, name, slices, out, average, priority, op, dtype, members)


class _Chain:
    """A worker's two-round collectives in flight (by name). Their second rounds run on one thread shared by every
    worker of the process, each when its first round's result is in: that thread never waits on the network (it
    only declares and submits), so one serves all, and nothing is left running when a worker goes."""

    _queue: queue.SimpleQueue = queue.SimpleQueue()
    _thread: threading.Thread | None = None
    _start_lock = threading.Lock()

    def __init__(self) -> None:
        self.in_flight: set[str] = set()  # names of two-round collectives not yet complete
        self._lock = threading.Lock()

    @classmethod
    def _run(cls) -> None:
        while True:
            cls._queue.get()()

    def begin(self, worker: Worker, name: str) -> Handle:
        """A handle for a new collective called `name`, completed by its later round (its output is set then);
        TensorError if one of that name is still in flight (Horovod's duplicate-name error)."""
        with self._lock:
            if name in self.in_flight:
                raise TensorError(
                    f"worker {worker.rank}: a collective named {name!r} is already in flight: synchronize it before "
                    "starting another of that name",
                    tensor=name,
                    rank=worker.rank,
                )
            self.in_flight.add(name)
        return Handle(name, np.empty(0), 1, self._end)

    def _end(self, handle: Handle) -> None:
        with self._lock:
            self.in_flight.discard(handle.name)

    def then(self, first: Handle, result: Handle, start: Callable[[np.ndarray], Handle]) -> None:
        """When `first` completes, run `start(first's output)` on the shared thread; `result` completes with what
        it returns."""

        def second() -> None:
            try:
                handle = start(first.wait(0))
            except GradwireError as e:
                result.fail(e)
                return
            except Exception as e:  # noqa: BLE001 - a bug in a second round fails its handle, not the thread
                log.exception("second round of %s failed", result.name)
                result.fail(TensorError(f"{result.name}: {e}", tensor=result.name))
                return
            handle.add_done_callback(lambda h: _forward(h, result))

        with _Chain._start_lock:
            if _Chain._thread is None:
                _Chain._thread = threading.Thread(target=_Chain._run, name="gw-collectives", daemon=True)
                _Chain._thread.start()
        result.waits_on = first.name  # until its first round is declared, the collective waits for that
        first.add_done_callback(lambda h: _Chain._queue.put(second))


def _forward(done: Handle, result: Handle) -> None:
    if done.error is not None:
        result.fail(done.error)  # type: ignore[arg-type]
    else:
        result.output = done.output
        result.part_done()


_chains: weakref.WeakKeyDictionary[Worker, _Chain] = weakref.WeakKeyDictionary()
_chains_lock = threading.Lock()


def _chain(worker: Worker) -> _Chain:
    with _chains_lock:
        chain = _chains.get(worker)
        if chain is None:
            chain = _chains[worker] = _Chain()
        return chain


def allgather_async(
    worker: Worker,
    array: np.ndarray,
    name: str,
    priority: int = 0,
    dtype: str | None = None,
    members: list[int] | None = None,
) -> Handle:
    """Concatenate every rank's `array` along the first dimension (which may differ by rank); all others match."""
    if array.ndim == 0:
        array = array.reshape(1)  # Horovod gathers a scalar as a 1-element vector
    ranks = _ranks(worker, members)
    chain = _chain(worker)
    result = chain.begin(worker, name)
    sizes = np.empty(len(ranks), np.int64)
    ones = [1 if r in ranks else 0 for r in range(worker.size)]
    try:
        first = worker.gather_async(
            np.array([array.shape[0]], np.int64), f"{name}.sizes", ones, sizes, priority=priority, members=members
        )
    except GradwireError as e:
        result.fail(e)
        raise
    src, per_row = np.ascontiguousarray(array), _row_elements(array)

    def start(dims: np.ndarray) -> Handle:
        rows = dict(zip(ranks, (int(d) for d in dims), strict=True))
        out = np.empty((sum(rows.values()), *src.shape[1:]), src.dtype)
        counts = [rows.get(r, 0) * per_row for r in range(worker.size)]
        return worker.gather_async(
            src, name, counts, out, priority=priority, shape=out.shape, dtype=dtype, members=members
        )

    chain.then(first, result, start)
    return result


def alltoall_async(
    worker: Worker,
    array: np.ndarray,
    splits: list[int] | None,
    name: str,
    priority: int = 0,
    dtype: str | None = None,
    members: list[int] | None = None,
) -> tuple[Handle, np.ndarray]:
    """Send `splits[j]` rows of `array` (in order) to rank j and receive, in rank order, the rows each rank sends
    to this one. Returns the handle of the received rows and the array of the row counts received from each rank
    (filled once the handle completes)."""
    ranks = _ranks(worker, members)
    n, rank, me = len(ranks), worker.rank, ranks.index(worker.rank)
    splits = _splits(array, splits, n, name, rank)
    chain = _chain(worker)
    result = chain.begin(worker, name)
    matrix = np.empty(n * n, np.int64)
    counts = [n if r in ranks else 0 for r in range(worker.size)]
    try:
        first = worker.gather_async(
            np.array(splits, np.int64), f"{name}.splits", counts, matrix, priority=priority, members=members
        )
    except GradwireError as e:
        result.fail(e)
        raise
    received, src, per_row = np.empty(n, np.int32), np.ascontiguousarray(array), _row_elements(array)
    offsets = np.cumsum([0] + splits) * per_row

    def start(flat: np.ndarray) -> Handle:
        table = flat.reshape(n, n)  # table[a][b]: rows the a-th rank sends to the b-th (of `ranks`)
        received[:] = table[:, me]
        out = np.empty((int(received.sum()), *src.shape[1:]), src.dtype)
        flat_src = src.reshape(-1)
        handles = []
        for b, dest in enumerate(ranks):
            counts = [0] * worker.size
            for a, r in enumerate(ranks):
                counts[r] = int(table[a][b]) * per_row
            total = sum(counts)
            slices = [(0, total if r == dest else 0) for r in range(worker.size)]
            into = out if dest == rank else out.reshape(-1)[:0]
            give, to = flat_src[offsets[b] : offsets[b + 1]], f"{name}.to{dest}"
            handles.append(
                worker.gather_async(give, to, counts, into, slices, priority, (total,), dtype=dtype, members=members)
            )
        return _all(handles, out, name)

    chain.then(first, result, start)
    return result, received


def _splits(array: np.ndarray, splits: list[int] | None, n: int, name: str, rank: int) -> list[int]:
    """An alltoall's row counts per destination, checked (None: the rows split evenly over the `n` ranks)."""
    if array.ndim == 0:
        raise TensorError(f"worker {rank}: alltoall of {name!r} needs at least one dimension", tensor=name, rank=rank)
    if splits is None:
        if array.shape[0] % n:
            raise TensorError(
                f"worker {rank}: alltoall of {name!r} without splits needs a first dimension divisible by the "
                f"{n} ranks, got {array.shape[0]}",
                tensor=name,
                rank=rank,
            )
        splits = [array.shape[0] // n] * n
    splits = [int(s) for s in splits]
    if len(splits) != n or min(splits) < 0 or sum(splits) != array.shape[0]:
        raise TensorError(
            f"worker {rank}: alltoall of {name!r}: splits {splits} must give {n} non-negative row counts that add "
            f"up to the first dimension, {array.shape[0]}",
            tensor=name,
            rank=rank,
        )
    return splits


def _all(handles: list[Handle], out: np.ndarray, name: str) -> Handle:
    """A handle that completes when every one of `handles` has, with output `out`."""
    done = Handle(name, out, len(handles), lambda h: None)
    for handle in handles:
        handle.add_done_callback(lambda h: done.fail(h.error) if h.error is not None else done.part_done())  # type: ignore[arg-type]
    return done
