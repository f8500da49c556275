"""Local aggregation: where several workers share each host, a host's sum crosses its link once each way.

BytePS's way (docs/local-aggregation.md says why), made of gradwire's own collectives, so every byte moves through the
links, flow control and servers that already carry the rest:
1. **Local reduce-scatter**: the host's workers reduce-scatter the tensor through their host's colocated server
   (shared memory, no network): local worker j receives slice j of the host's sum (`name@host`, a process set of
   the host's workers, placed on its colocated servers).
2. **Cross**: local worker j of every host sums its slice across the hosts (`name@cross<j>`, a process set of the
   j-th worker of each host, placed like any tensor). Each host's link carries its L slices: its sum once, each way.
3. **Local all-gather**: the host's workers gather the L slices of the total through the colocated server again
   (`name@gather`), each into the whole output.

Each stage starts when the one before completes, on this module's own thread (never the link loop). The sums are
deterministic (each server adds in rank order: the host's workers, then the hosts in order), not bit-identical to the
flat sum. On where it pays: at least two hosts, the same number (at least two) of workers on each, a colocated server
on every worker host, reductions of all the job's workers of at least LOCAL_MIN_BYTES (smaller ones go direct: three
stages' latency for little bandwidth). A compressed sum compresses only its cross stage: the host's sum is encoded
once, so a host's link carries one block each way however many workers share it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gradwire.errors import GradwireError
from gradwire.hosts import aggregation_groups
from gradwire.worker.calls import Calls
from gradwire.worker.handle import Handle
from gradwire.worker.work import Transfer, divisor

log = logging.getLogger("gradwire.worker")

LOCAL_MIN_BYTES = 64 << 10  # a tensor smaller than this goes direct (the same decision on every worker)
# the partition size of the stages on the host (shared memory: no link to fill, so partitions as large as the
# per-partition cost wants; not the network's, which cut a host's 16 MiB into 1,024 partitions at 100 Mbit/s)
LOCAL_PARTITION_BYTES = 1 << 20
# a tensor is cut into chunks of at least this much (at most MAX_CHUNKS) whose stages pipeline
CHUNK_BYTES, MAX_CHUNKS = 1 << 20, 16


class Hierarchy:
    """This worker's place in the hosts: the host's workers (`local`, by rank), its index among them, and the j-th
    worker of every host (`cross`, in host order)."""

    def __init__(self, rank: int, groups: list[list[int]]) -> None:
        mine = next(g for g in groups if rank in g)
        self.local = mine
        self.index = mine.index(rank)
        self.cross = [g[self.index] for g in groups]
        self.hosts = len(groups)

    @classmethod
    def of(cls, rank: int, worker_hosts: list[str], servers: list[dict], enabled: bool) -> Hierarchy | None:
        """The hierarchy where local aggregation applies (the module's docstring), else None."""
        if not enabled:
            return None
        colocated = {str(s.get("host_id")) for s in servers if s.get("colocated") and not s.get("lost")}
        groups, _ = aggregation_groups(worker_hosts, colocated)
        return cls(rank, groups) if groups else None

    def status(self) -> dict:
        return {"hosts": self.hosts, "local_workers": self.local, "index": self.index, "cross": self.cross}


class LocalAggregation:
    """Reductions of the whole job through the hierarchy (the module's docstring). Thread-safe."""

    def __init__(self, calls: Calls, hierarchy: Hierarchy) -> None:
        self.calls = calls
        self.hierarchy = hierarchy
        self.count = 0  # reductions that went through the hierarchy
        self.bytes = 0  # their bytes
        self._steps: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="gw-worker-aggregation", daemon=True)
        self._thread.start()

    def applies(self, array: np.ndarray, op: str, members: list[int] | None) -> bool:
        return members is None and op in ("sum", "min", "max", "product") and array.nbytes >= LOCAL_MIN_BYTES

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
    ) -> Handle:
        """The three stages for `src` (contiguous) into `out`, in chunks of CHUNK_BYTES or more (at most MAX_CHUNKS)
        that pipeline (one chunk's cross stage overlaps the next one's local stages); the handle completes with the last
        chunk. `compressor` (checked arguments): the cross stage's sum is compressed (each host's sum is encoded, with
        its worker's error feedback), the stages on the host are not."""
        flat, result = src.reshape(-1), out.reshape(-1)
        chunks = max(1, min(MAX_CHUNKS, src.nbytes // CHUNK_BYTES))
        call = _Call(name, average, priority, dtype, op, Handle(name, out, chunks, lambda _: None), compressor)
        self.count += 1
        self.bytes += src.nbytes
        cuts = [src.size * c // chunks for c in range(chunks + 1)]
        for c in range(chunks):
            a, b = cuts[c], cuts[c + 1]
            self._chunk(call, f"{name}@{c}" if chunks > 1 else name, flat[a:b], result[a:b])
        return call.handle

    def _chunk(self, call: _Call, name: str, src: np.ndarray, out: np.ndarray) -> None:
        """One chunk's three stages (tensors `name@host`, `name@cross<j>`, `name@gather`); the call's handle has one
        part done when the last completes."""
        h, calls, size, handle = self.hierarchy, self.calls, self.calls.size, call.handle
        bounds = [src.size * j // len(h.local) for j in range(len(h.local) + 1)]
        counts, slices = [0] * size, [(0, 0)] * size  # local worker j's slice of the chunk (others': none)
        for j, r in enumerate(h.local):
            counts[r] = bounds[j + 1] - bounds[j]
            slices[r] = (bounds[j], counts[r])
        part = np.empty(counts[calls.rank], src.dtype)
        # the host's shared memory carries larger partitions than the network's
        local = {"members": h.local, "partition_bytes": calls.state.local_partition_bytes, "dtype": call.dtype}

        def cross(_: Handle) -> None:  # an average divides by every worker of the job, not by the hosts
            crossing, divide_by = f"{name}@cross{h.index}", divisor(size, call.average)
            if call.compressor is not None:
                step = calls.compressed_async(part, crossing, divide_by, call.priority, part, h.cross, call.compressor)
                self._then(step, handle, gather)
                return
            tensor = calls.declaring.declare(
                crossing, part.shape, call.dtype or part.dtype, call.op, wait=False, members=h.cross
            )
            transfer = Transfer(part, 0, part, 0, divide_by, call.priority)
            self._then(calls.launch(tensor, part, transfer), handle, gather)

        def gather(_: Handle) -> None:
            step = calls.gather_async(part, f"{name}@gather", counts, out, priority=call.priority, **local)
            self._then(step, handle, lambda _: handle.part_done())

        first = calls.reduce_scatter_async(
            src, f"{name}@host", slices, part, priority=call.priority, op=call.op, **local
        )
        self._then(first, handle, cross)

    def _then(self, step: Handle, handle: Handle, after: Callable[[Handle], None]) -> None:
        """Run `after(step)` on this module's thread once `step` completes; a failure fails `handle`."""

        def done(finished: Handle) -> None:
            if finished.error is not None:
                handle.fail(finished.error)  # type: ignore[arg-type]
                return
            self._steps.put(lambda: self._guarded(handle, lambda: after(finished)))

        step.add_done_callback(done)

    @staticmethod
    def _guarded(handle: Handle, fn: Callable[[], None]) -> None:
        try:
            fn()
        except GradwireError as e:
            handle.fail(e)
        except Exception as e:  # noqa: BLE001 - the caller waits on the handle: it must complete, with the error
            log.exception("local aggregation of %r", handle.name)
            handle.fail(GradwireError(f"local aggregation of {handle.name!r} failed: {e}"))

    def _run(self) -> None:
        while (step := self._steps.get()) is not None:
            step()

    def status(self) -> dict:
        """For the worker's /status: its place in the hosts, and what went this way."""
        return self.hierarchy.status() | {"reductions": self.count, "bytes": self.bytes}

    def close(self) -> None:
        self._steps.put(None)


@dataclass(frozen=True)
class _Call:
    """One push_pull through the hierarchy: what every chunk's stages share."""

    name: str
    average: bool
    priority: int
    dtype: object
    op: str
    handle: Handle
    compressor: dict | None = None  # the cross stage's (checked arguments), or None
