"""The calls a training process makes: push_pull (allreduce), reduce-scatter, gather (allgather, broadcast,
alltoall) and a server-side update (worker/updates.py), each asynchronous with a handle to synchronize; and hvd.join.
A call numbers the tensor's next round, cuts it into its partitions (a `Work` each) and submits each to its server's
link, at once or when the tensor's declaration completes.
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from gradwire.errors import JobAborted, TensorError
from gradwire.protocol import messages, operations
from gradwire.worker import single
from gradwire.worker.compressing import Coder, CompressedTransfer, Compressing
from gradwire.worker.control import Control
from gradwire.worker.declaring import Declaring
from gradwire.worker.handle import Handle
from gradwire.worker.launching import Launching
from gradwire.worker.recut import Recutting
from gradwire.worker.state import WorkerState
from gradwire.worker.tensors import Tensor, TensorTable
from gradwire.worker.updates import Updates
from gradwire.worker.work import Transfer, divisor

log = logging.getLogger("gradwire.worker")


class Aggregation(Protocol):
    """What `push_pull_async` hands a reduction of the whole job to, where workers share hosts (worker/aggregation.py
    `LocalAggregation`)."""

    def applies(self, array: np.ndarray, op: str, members: list[int] | None) -> bool: ...

    def push_pull_async(
        self,
        src: np.ndarray,
        name: str,
        average: bool,
        priority: int,
        out: np.ndarray,
        dtype: object,
        op: str,
        compressor: dict | None = None,
    ) -> Handle: ...

    def status(self) -> dict: ...

    def close(self) -> None: ...


class Calls(Updates):
    def __init__(
        self, state: WorkerState, table: TensorTable, control: Control, declaring: Declaring, recut: Recutting
    ) -> None:
        self.state = state
        self.table = table
        self.control = control
        self.declaring = declaring
        self.recut = recut
        self.launching = Launching(state, table, recut)  # a call's round, cut and submitted (worker/launching.py)
        self.aggregation: Aggregation | None = None  # where workers share hosts (worker/aggregation.py)
        self.compressing = Compressing(state)  # compressed tensors' residuals (worker/compressing.py)

    rank = property(lambda self: self.state.rank)
    size = property(lambda self: self.state.size)
    timeout = property(lambda self: self.state.config.timeout)

    def push_pull_async(
        self,
        array: np.ndarray,
        name: str,
        average: bool = False,
        priority: int = 0,
        out: np.ndarray | None = None,
        dtype: object = None,
        op: str = "sum",
        members: list[int] | None = None,
        compression: object = None,
    ) -> Handle:
        """Start summing `array` across workers; the sum (or average) lands in `out` (a new array if None).
        `op` is the reduction: "sum" (the default), "min", "max" or "product". `members`: only these ranks take
        part (a process set; each of them calls it, the average divides by their number). `compression`: a
        compressor (gradwire.compression, or its arguments; docs/compression.md) for a float32 sum of at least
        GRADWIRE_COMPRESSION_MIN_BYTES; anything else travels as it is.

        `out` may be `array` itself (in place). Neither may be modified until the handle completes.
        `dtype` overrides the wire dtype name (e.g. "bfloat16" for uint16-held bfloat16 bits).
        """
        self.state.check_usable()
        if not isinstance(array, np.ndarray):
            raise TensorError(f"push_pull of {name!r} needs a numpy array, got {type(array).__name__}", tensor=name)
        # np.ascontiguousarray turns a 0-dim array into shape (1,): keep the caller's shape (a scalar is a tensor)
        src = array if array.flags.c_contiguous else np.ascontiguousarray(array).reshape(array.shape)
        out = self._output(src, out, name)
        args = None
        if compression is not None and self.compressing.applies(src, op, dtype):
            args = self.compressing.arguments(compression, name)
        if single.applies(self.state, op, members):
            return single.answered(name, out, src)
        if self.aggregation is not None and self.aggregation.applies(src, op, members):
            return self.aggregation.push_pull_async(src, name, average, priority, out, dtype, op, args)
        if args is not None:
            return self.compressed_async(src, name, self._divisor(average, members), priority, out, members, args)
        tensor = self.declaring.declare(name, src.shape, dtype or src.dtype, op, wait=False, members=members)
        return self.launch(
            tensor, out, Transfer(src.reshape(-1), 0, out.reshape(-1), 0, self._divisor(average, members), priority)
        )

    def compressed_async(
        self,
        src: np.ndarray,
        name: str,
        divisor: int,
        priority: int,
        out: np.ndarray,
        members: list[int] | None,
        args: dict,
    ) -> Handle:
        """A sum of compressed partitions (worker/compressing.py), divided by `divisor`: declared as the `compressed`
        operation with the compressor's checked arguments `args`, which every worker must pass alike. Where workers
        share hosts, local aggregation calls it for its cross-host stage: a host's sum is what gets encoded."""
        tensor = self._declare_compressed(name, src.shape, members, args)
        flat, result = src.reshape(-1), out.reshape(-1)
        transfer = CompressedTransfer(flat, 0, result, 0, divisor, priority, args=args, store=self.compressing)
        return self.launch(tensor, out, transfer)

    def push_pull_coded_async(
        self,
        name: str,
        shape: tuple[int, ...],
        coder: Coder,
        average: bool,
        priority: int,
        members: list[int] | None,
        compression: object,
    ) -> Handle:
        """A compressed sum of a float32 tensor that stays where it lives (a GPU): `coder` encodes each partition
        there into the block that travels, and decodes each answered block into the output, averaged
        (worker/compressing.py, CompressedTransfer with a coder). Declared as compressed_async declares it, so a job
        may mix workers that encode on the host and on a device."""
        self.state.check_usable()
        args = self.compressing.arguments(compression, name)
        tensor = self._declare_compressed(name, shape, members, args)
        none, divisor = np.empty(0, np.float32), self._divisor(average, members)
        store = self.compressing
        transfer = CompressedTransfer(none, 0, none, 0, divisor, priority, args=args, store=store, coder=coder)
        return self.launch(tensor, none, transfer)

    def _declare_compressed(self, name: str, shape: tuple[int, ...], members: list[int] | None, args: dict) -> Tensor:
        """Declare a tensor as the `compressed` operation with the compressor's checked arguments `args` (which
        every worker must pass alike), cut in partitions as large as the compressor shrinks them."""
        cut = self.compressing.partition_bytes(args)
        return self.declaring.declare(
            name, shape, np.float32, "compressed", wait=False, members=members, op_args=args, partition_bytes=cut
        )

    def launch(self, tensor: Tensor, out: np.ndarray, transfer: Transfer) -> Handle:
        """Push every partition of `tensor`'s next round as `transfer` says; the handle completes into `out`."""
        return self.launching.launch(tensor, out, transfer)

    def _divisor(self, average: bool, members: list[int] | None) -> int:
        """What the sum is divided by (worker/work.py's `divisor`)."""
        return divisor(self.size, average, members)

    def _check_output(self, what: str, name: str, out: np.ndarray, count: int, dtype: np.dtype) -> None:
        if out.size != count or not out.flags.c_contiguous or out.dtype != dtype:
            raise TensorError(
                f"worker {self.rank}: {what} for {self.size} workers needs a C-contiguous output of {count} {dtype} "
                f"elements, got {out.size} {out.dtype}",
                tensor=name,
                rank=self.rank,
            )

    def reduce_scatter_async(
        self,
        array: np.ndarray,
        name: str,
        slices: list[tuple[int, int]],
        out: np.ndarray,
        average: bool = False,
        priority: int = 0,
        op: str = "sum",
        dtype: object = None,
        members: list[int] | None = None,
        partition_bytes: int = 0,
    ) -> Handle:
        """Reduce `array` across workers and receive only this worker's part of the result: worker r receives
        `slices[r]` = (first element, count) of the flattened result into its `out`. Each worker pushes all of its
        array and pulls only its slice (half an allreduce's bytes). Every worker passes the same `slices`.
        `partition_bytes`: the tensor's own partition size (0: the worker's)."""
        self.state.check_usable()
        src = np.ascontiguousarray(array).reshape(array.shape)
        first, count = slices[self.rank] if len(slices) == self.size else (0, -1)
        self._check_output(f"reduce-scatter of {name!r} with slices {slices}", name, out, count, src.dtype)
        if single.applies(self.state, op, members):
            return single.answered(name, out, src.reshape(-1)[first : first + count])
        tensor = self.declaring.declare(
            name,
            src.shape,
            dtype or src.dtype,
            op,
            slices,
            wait=False,
            members=members,
            partition_bytes=partition_bytes,
        )
        n = self._divisor(average, members)
        return self.launch(tensor, out, Transfer(src.reshape(-1), 0, out.reshape(-1), first, n, priority))

    def gather_async(
        self,
        array: np.ndarray,
        name: str,
        counts: list[int],
        out: np.ndarray,
        slices: list[tuple[int, int]] | None = None,
        priority: int = 0,
        shape: tuple[int, ...] | None = None,
        meta: str | None = None,
        dtype: object = None,
        members: list[int] | None = None,
        partition_bytes: int = 0,
    ) -> Handle:
        """Concatenate every worker's `array` (flattened), in rank order, on the servers.

        `counts[r]` is the number of elements worker r contributes (this worker's must be `array.size`). The result
        has sum(counts) elements; worker r receives `slices[r]` = (first, count) of them into its `out` (None: all
        of them). So a broadcast is a gather to which only the root contributes, and an alltoall is one gather per
        destination that only the destination pulls. Every worker passes the same `counts` and `slices`. `shape` is
        what the tensor is declared as (checked across workers); it defaults to (sum(counts),). `dtype` overrides the
        wire dtype's name (bfloat16 held as uint16). `partition_bytes`: the tensor's own partition size (0: the
        worker's).
        """
        self.state.check_usable()
        counts = self._gather_counts(name, counts, array.size)
        total = sum(counts)
        first, count = slices[self.rank] if slices is not None else (0, total)
        self._check_output(f"gather of {name!r}", name, out, count, array.dtype)
        src = np.ascontiguousarray(array).reshape(-1)
        if single.applies(self.state, operations.GATHER, members):
            return single.answered(name, out, src[first : first + count])
        tensor = self.declaring.declare(
            name,
            shape or (total,),
            dtype or src.dtype,
            "gather",
            slices,
            meta,
            wait=False,
            members=members,
            partition_bytes=partition_bytes,
        )
        return self.launch(tensor, out, Transfer(src, sum(counts[: self.rank]), out.reshape(-1), first, 1, priority))

    def _gather_counts(self, name: str, counts: list[int], own: int) -> list[int]:
        """A gather's `counts` as ints, checked: one per worker, this worker's its own `own` elements, none negative."""
        counts = [int(c) for c in counts]
        if len(counts) != self.size or counts[self.rank] != own or min(counts) < 0:
            raise TensorError(
                f"worker {self.rank}: gather of {name!r} got counts {counts} for {self.size} workers and "
                f"{own} elements of its own",
                tensor=name,
                rank=self.rank,
            )
        return counts

    def _output(self, src: np.ndarray, out: np.ndarray | None, name: str) -> np.ndarray:
        """Where push_pull's sum of `src` lands: `out`, checked (the input's shape and dtype, C-contiguous), or new."""
        if out is None:
            return np.empty_like(src)
        if out.shape != src.shape or out.dtype != src.dtype:
            raise TensorError(
                f"worker {self.rank}: push_pull of {name!r} got an input of {src.dtype}{list(src.shape)} but an "
                f"output of {out.dtype}{list(out.shape)}; pass an output of the input's shape and dtype",
                tensor=name,
                rank=self.rank,
            )
        if not out.flags.c_contiguous:
            raise TensorError(
                f"worker {self.rank}: the output of push_pull {name!r} must be C-contiguous (got strides "
                f"{out.strides}); pass np.ascontiguousarray(out) or no output",
                tensor=name,
                rank=self.rank,
            )
        return out

    def synchronize(self, handle: Handle) -> np.ndarray:
        """Wait for a handle; returns the output array, raises the error that failed it.

        Waiting for a tensor whose declaration is not complete (other workers have not called it yet) is said to the
        scheduler: if one of them is waiting in a barrier meanwhile, neither can go on, and the scheduler fails the
        declaration at once rather than both waiting until the timeout (a collective one worker skipped)."""
        if not handle.done():
            with self.state.lock:
                tensor = self.table.tensors.get(handle.waits_on or handle.name)
                pending = tensor is not None and not tensor.ready.is_set()
            if pending:
                self.control.send(messages.Blocked(tensor.name))
        return handle.wait(self.timeout, describe=lambda: self._describe_outstanding(handle.name))

    def push_pull(
        self,
        array: np.ndarray,
        name: str,
        average: bool = False,
        priority: int = 0,
        op: str = "sum",
        compression: object = None,
    ) -> np.ndarray:
        """Sum (or reduce by `op`) `array` across workers (blocking); returns a new array."""
        handle = self.push_pull_async(array, name, average, priority, op=op, compression=compression)
        return self.synchronize(handle)

    def push_pull_inplace(
        self, array: np.ndarray, name: str, average: bool = False, priority: int = 0, compression: object = None
    ) -> np.ndarray:
        """Sum `array` across workers into itself (blocking); returns `array`."""
        if not array.flags.c_contiguous:
            raise TensorError(f"in-place push_pull of {name!r} needs a C-contiguous array", tensor=name)
        handle = self.push_pull_async(array, name, average, priority, out=array, compression=compression)
        return self.synchronize(handle)

    def _describe_outstanding(self, name: str) -> str:
        links = self.state.links
        held = [f"server {link.server}" for link in links if name in link.held()]
        busy = [f"server {link.server} ({link.conn.peer})" for link in links if name in link.outstanding()]
        if self.state.native is not None:  # the native data path's calls (worker/native_path.py)
            busy += [f"server {s} ({links[s].conn.peer})" for s in self.state.native.outstanding(name)]
            held += [f"server {s}" for s in self.state.native.held(name)]
        out = f"; partitions still out on {', '.join(busy)}" if busy else ""
        if held:  # answered here; another worker has not said it has the sums (worker/holding.py)
            out += f"; sums held until every worker has them, from {', '.join(held)}"
        return out

    def join(self) -> int:
        """Horovod's join: this worker is out of data. Until every worker has joined, the others' allreduces go on
        with zeros in this worker's place (an average still divides by every worker, as Horovod's does; an
        allgather, broadcast, alltoall or reducescatter fails on them with TensorMismatch). Blocks until every worker
        has joined (no timeout: the others may train on for long; a lost worker still ends it, with WorkerLost), then
        returns the rank of the last to join, the same on every worker."""
        self.state.check_usable()
        with self.state.lock:
            rounds = self.table.rounds()
        request = self.control.request_async(messages.Join(rounds=rounds))
        request.wait()
        if request.reply is None:  # woken by an abort or a membership change
            self.state.check_usable()
            raise JobAborted(f"worker {self.rank}: join was cancelled", rank=self.rank)
        reply = request.reply
        with self.state.lock:  # rounds the others summed while this worker had joined: the next is after them
            self.table.skip_to(reply.get("rounds", {}))
        return int(reply["last"])
