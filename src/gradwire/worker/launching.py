"""A call's round on the worker: the tensor it goes to (itself, or its re-cut's successor), the round numbered in call
order with a handle to wait on, its partitions cut (a `Work` each, by the call's `Transfer`) and submitted to their
servers' links, at once or when the tensor's declaration completes."""

from __future__ import annotations

import logging
import time

import numpy as np

from gradwire.errors import GradwireError, GradwireTimeout, TensorError
from gradwire.worker.handle import Handle
from gradwire.worker.recut import Recutting
from gradwire.worker.state import WorkerState
from gradwire.worker.tensors import Tensor, TensorTable
from gradwire.worker.work import Transfer, Work

log = logging.getLogger("gradwire.worker")


class Launching:
    """Launches calls' rounds (`launch`); what every kind of call shares once it has its tensor and its transfer."""

    def __init__(self, state: WorkerState, table: TensorTable, recut: Recutting) -> None:
        self.state, self.table, self.recut = state, table, recut

    rank = property(lambda self: self.state.rank)
    timeout = property(lambda self: self.state.config.timeout)

    def launch(self, tensor: Tensor, out: np.ndarray, transfer: Transfer) -> Handle:
        """Push every partition of `tensor`'s next round as `transfer` says; the handle completes into `out`."""
        tensor = self._follow(tensor)
        handle, rnd = self._begin(tensor, out, transfer.same_round)

        def submit(error: GradwireError | None) -> None:
            if error is not None:
                handle.fail(error)
                return
            with self.state.lock:
                servers = list(tensor.servers)
            if self.state.native is not None:  # the native data path completes the declaration's part
                self.state.native.submit(tensor, rnd, transfer, handle, servers)
                return
            handle.add_parts(len(tensor.parts))
            per_link: dict[int, list[Work]] = {}
            for server, work in zip(servers, transfer.works(tensor, rnd, handle), strict=True):
                per_link.setdefault(server, []).append(work)
            links = self.state.links
            for server, works in per_link.items():
                links[server].submit_all(works, transfer.priority)
            handle.part_done()  # the declaration's part

        with self.state.lock:
            declared = tensor.ready.is_set()
            if not declared:
                tensor.waiting.append(submit)
        if declared:
            submit(tensor.error)
        return handle

    def _follow(self, tensor: Tensor) -> Tensor:
        """The tensor whose keys take `tensor`'s next round: itself, or its re-cut's successor from the round the
        scheduler chose (worker/tensors.py). Waits while a re-cut's step 1 holds the round, and for the successor's
        declaration (neither waits for the data path); a successor the scheduler refused is dropped on every worker
        alike, and the tensor keeps its partitions."""
        if tensor.successor is None and not self.recut.holds:
            return tensor
        deadline = time.monotonic() + self.timeout
        with self.state.lock:
            current = self.recut.wait_turn(tensor, self.timeout, f"worker {self.rank}")
            previous = [t for t in tensor.chain() if t is not current and t.in_flight is not None]
        if previous:  # what _begin checks, across the re-cut
            raise self._in_flight_error(previous[0])
        if current is not tensor and not current.ready.wait(max(0.0, deadline - time.monotonic())):
            raise GradwireTimeout(
                f"worker {self.rank}: the re-cut of {tensor.root!r} was not declared in {self.timeout}s",
                tensor=current.name,
            )
        if current.error is not None:
            with self.state.lock:
                for t in tensor.chain():
                    if t.successor is not None and t.successor[1] is current:
                        t.successor = None
            log.warning("worker %d: %r keeps its partitions: %s", self.rank, tensor.root, current.error)
            return self._follow(tensor)
        return current

    def _begin(self, tensor: Tensor, out: np.ndarray, same_round: bool = False) -> tuple[Handle, int]:
        """A handle for the tensor's next round, and that round (numbered here, in call order; `same_round`: the
        last one again). The handle counts one part for the declaration, and the partitions once they are known."""
        self.state.check_usable()
        with self.state.lock:
            if tensor.in_flight is not None:
                raise self._in_flight_error(tensor)
            tensor.round += 0 if same_round else 1
            if self.state.active == 0 and self.state.timeline:
                self.state.timeline.new_step()  # a step: from no push_pull in flight to one
            self.state.active += 1
            handle = Handle(tensor.name, out, 1, self._finished)
            tensor.in_flight = handle
        return handle, tensor.round

    def _in_flight_error(self, tensor: Tensor) -> TensorError:
        return TensorError(
            f"a push_pull of {tensor.root or tensor.name!r} is already in flight on worker {self.rank}: synchronize "
            "its handle before pushing the tensor again, or give each concurrent tensor its own name (two "
            "models whose parameters share names: pass named_parameters with a prefix per model)",
            tensor=tensor.name,
            rank=self.rank,
        )

    def _finished(self, handle: Handle) -> None:
        self.state.metrics.round_done()
        with self.state.lock:
            self.state.active -= 1
            tensor = self.table.tensors.get(handle.name)
            if tensor is not None and tensor.in_flight is handle:
                tensor.in_flight = None
