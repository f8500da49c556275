"""Horovod's collectives beyond allreduce, on numpy arrays, carried by the servers' per-key operations.

- `allgather_async`: the first dimension may differ by rank. Two rounds: a gather of every rank's first dimension
  (8 bytes each), then a gather of the data, declared as the output's shape, that each rank fills with its rows.
- `broadcast_async`: a gather to which only the root contributes: the root pushes S bytes, every rank pulls S (a
  broadcast by summing zeros pushed S from every rank).
- `reducescatter_async`: a reduction whose result each rank pulls only its rows of: every rank pushes S and pulls
  S/n, where an allreduce pulls S. Rows are split as Horovod does: d0 // n each, the first d0 % n ranks one more.
- `alltoall_async`: a gather of every rank's splits (n integers each), then one gather per destination that only
  the destination pulls: every rank pushes its tensor once and pulls what is sent to it.

Two-round collectives return at once: the second round is started by a helper thread when the first one's result
arrives, so a rank never blocks in an `_async` call waiting for the others (Horovod's tests rely on that).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import numpy as np

from gradwire.errors import GradwireError, TensorError
from gradwire.worker import Handle, Worker

log = logging.getLogger("gradwire.worker")


def row_split(rows: int, size: int) -> list[int]:
    """Horovod's split of `rows` over `size` ranks: rows // size each, the first rows % size one more."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


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
) -> Handle:
    """Every rank receives the root's `array` (into `out`, which may be `array` itself, or a new array)."""
    if not 0 <= root < worker.size:
        raise TensorError(
            f"worker {worker.rank}: broadcast of {name!r} from root rank {root}, but the job has ranks 0 to "
            f"{worker.size - 1}",
            tensor=name,
            rank=worker.rank,
        )
    out = np.empty_like(array) if out is None else out
    counts = [array.size if r == root else 0 for r in range(worker.size)]
    source = array if worker.rank == root else array.reshape(-1)[:0]
    return worker.gather_async(
        source, name, counts, out, priority=priority, shape=array.shape, meta=f"root {root}", dtype=dtype
    )


def reducescatter_async(
    worker: Worker,
    array: np.ndarray,
    name: str,
    average: bool = False,
    op: str = "sum",
    priority: int = 0,
    dtype: str | None = None,
) -> Handle:
    """Reduce `array` over all ranks; this rank receives its rows of the result (see `row_split`)."""
    if array.ndim == 0:
        raise TensorError(
            f"worker {worker.rank}: reducescatter of {name!r} needs a tensor of at least one dimension (a scalar "
            "cannot be split)",
            tensor=name,
            rank=worker.rank,
        )
    rows, per_row = row_split(array.shape[0], worker.size), _row_elements(array)
    starts = np.cumsum([0] + rows)
    slices = [(int(starts[r]) * per_row, rows[r] * per_row) for r in range(worker.size)]
    out = np.empty((rows[worker.rank], *array.shape[1:]), array.dtype)
    return worker.reduce_scatter_async(array, name, slices, out, average, priority, op, dtype)


class _Chain:
    """Runs the second rounds of two-round collectives, each when its first round's result is in (one thread per
    worker, never waiting on the network: it only declares and submits)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="gw-collectives", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            fn()

    def then(self, first: Handle, result: Handle, start: Callable[[np.ndarray], Handle]) -> None:
        """When `first` completes, run `start(first's output)` here; `result` completes with what it returns."""

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

        first.add_done_callback(lambda h: self._queue.put(second))


def _forward(done: Handle, result: Handle) -> None:
    if done.error is not None:
        result.fail(done.error)  # type: ignore[arg-type]
    else:
        result.output = done.output
        result.part_done()


_chains: dict[int, _Chain] = {}
_chains_lock = threading.Lock()


def _chain(worker: Worker) -> _Chain:
    with _chains_lock:
        chain = _chains.get(id(worker))
        if chain is None:
            chain = _chains[id(worker)] = _Chain()
        return chain


def _pending(name: str) -> Handle:
    """A handle completed by a later round (its output is set then)."""
    return Handle(name, np.empty(0), 1, lambda h: None)


def allgather_async(
    worker: Worker, array: np.ndarray, name: str, priority: int = 0, dtype: str | None = None
) -> Handle:
    """Concatenate every rank's `array` along the first dimension (which may differ by rank); all others match."""
    if array.ndim == 0:
        array = array.reshape(1)  # Horovod gathers a scalar as a 1-element vector
    sizes = np.empty(worker.size, np.int64)
    first = worker.gather_async(
        np.array([array.shape[0]], np.int64), f"{name}.sizes", [1] * worker.size, sizes, priority=priority
    )
    result = _pending(name)
    src, per_row = np.ascontiguousarray(array), _row_elements(array)

    def start(dims: np.ndarray) -> Handle:
        rows = [int(d) for d in dims]
        out = np.empty((sum(rows), *src.shape[1:]), src.dtype)
        counts = [d * per_row for d in rows]
        return worker.gather_async(src, name, counts, out, priority=priority, shape=out.shape, dtype=dtype)

    _chain(worker).then(first, result, start)
    return result


def alltoall_async(
    worker: Worker,
    array: np.ndarray,
    splits: list[int] | None,
    name: str,
    priority: int = 0,
    dtype: str | None = None,
) -> tuple[Handle, np.ndarray]:
    """Send `splits[j]` rows of `array` (in order) to rank j and receive, in rank order, the rows each rank sends
    to this one. Returns the handle of the received rows and the array of the row counts received from each rank
    (filled once the handle completes)."""
    n, rank = worker.size, worker.rank
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
    matrix = np.empty(n * n, np.int64)
    first = worker.gather_async(np.array(splits, np.int64), f"{name}.splits", [n] * n, matrix, priority=priority)
    received = np.empty(n, np.int32)
    result = _pending(name)
    src, per_row = np.ascontiguousarray(array), _row_elements(array)
    offsets = np.cumsum([0] + splits) * per_row

    def start(flat: np.ndarray) -> Handle:
        table = flat.reshape(n, n)  # table[r][j]: rows rank r sends to rank j
        received[:] = table[:, rank]
        out = np.empty((int(received.sum()), *src.shape[1:]), src.dtype)
        flat_src = src.reshape(-1)
        handles = []
        for j in range(n):
            counts = [int(table[r][j]) * per_row for r in range(n)]
            total = sum(counts)
            slices = [(0, total if r == j else 0) for r in range(n)]
            into = out if j == rank else out.reshape(-1)[:0]
            give = flat_src[offsets[j] : offsets[j + 1]]
            handles.append(
                worker.gather_async(give, f"{name}.to{j}", counts, into, slices, priority, (total,), dtype=dtype)
            )
        return _all(handles, out, name)

    _chain(worker).then(first, result, start)
    return result, received


def _all(handles: list[Handle], out: np.ndarray, name: str) -> Handle:
    """A handle that completes when every one of `handles` has, with output `out`."""
    done = Handle(name, out, len(handles), lambda h: None)
    for handle in handles:
        handle.add_done_callback(lambda h: done.fail(h.error) if h.error is not None else done.part_done())  # type: ignore[arg-type]
    return done
