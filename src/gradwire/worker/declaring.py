"""Declaring a tensor: its signature (shape, dtype, per-key operation, slices, meta, members, arguments) goes to the
scheduler, which completes the declaration once every worker has made it alike (scheduler/declarations.py) and answers
with the partition size and each partition's server. Calls on a tensor may start before that: they wait in the
tensor's `waiting` list and go out when it completes.
"""

from __future__ import annotations

import json
import logging

from gradwire.errors import GradwireError, GradwireTimeout, JobAborted, TensorError, TensorMismatch
from gradwire.protocol import dtypes, messages, operations, update
from gradwire.protocol.signature import Signature
from gradwire.worker.control import Control
from gradwire.worker.state import WorkerState
from gradwire.worker.tensors import Tensor, TensorTable

log = logging.getLogger("gradwire.worker")


class Declaring:
    def __init__(self, state: WorkerState, table: TensorTable, control: Control) -> None:
        self.state = state
        self.table = table
        self.control = control

    def declare(
        self,
        name: str,
        shape: tuple[int, ...] | list[int],
        dtype: object,
        key_op: str = "sum",
        slices: list[tuple[int, int]] | None = None,
        meta: str | None = None,
        wait: bool = True,
        members: list[int] | None = None,
        op_args: dict | None = None,
        partition_bytes: int = 0,
    ) -> Tensor:
        """Declare a tensor (idempotent). Every worker must declare `name` with the same shape and dtype.

        A declaration completes when every worker has made it: the scheduler compares them all first, so a worker
        that disagrees (another shape, dtype or collective) fails it on every worker at once with a TensorMismatch
        naming each worker's call, before any byte moves, and the job goes on. With `wait` False this returns at
        once; calls on the tensor then wait for the declaration and go out when it completes.

        A name used again with another shape or dtype (two models whose parameters share names, a metric whose
        length changes) is a new declaration: each (name, shape, dtype) is its own tensor on the servers, numbered
        in the order this worker first used it (`name`, then `name#1`, `name#2`, ...). Workers running the same
        program number them alike, and the scheduler checks each number's shape across workers as for any name.

        `key_op` is what the servers compute over its rounds (server/ops.py: sum, min, max, product, gather), and
        `slices`, per rank, the (first element, count) of the result that rank pulls (None: all of it). `meta` is
        anything else every worker must agree on (a broadcast's root rank), checked like the shape. `members` are
        the ranks that call it (a process set; None: every worker): only they declare it, and its rounds are theirs.
        `op_args` configure a built operation (`optimizer`: protocol/update.py; `compressed`: protocol/compression.py),
        checked across workers like the shape.
        `partition_bytes`: cut into partitions of this size, not the worker's (local aggregation's tensors on one host).
        """
        shape = tuple(int(d) for d in shape)
        wire = dtypes.from_numpy(dtype)
        cut = tuple((int(a), int(b)) for a, b in slices) if slices is not None else None
        ranks = tuple(sorted(members)) if members is not None else None
        args = operations.encode_args(key_op, op_args) if op_args is not None else None
        signature = Signature(key_op, wire.name, shape, cut, meta, ranks, args)
        with self.state.lock:
            tensor, new = self.table.entry(name, shape, wire, signature)
        if new:
            tensor.partition_bytes = partition_bytes
            self.send(tensor)
        if wait:
            self._wait(tensor)
        return tensor

    def _wait(self, tensor: Tensor) -> None:
        """Until `tensor`'s declaration completes (at most GRADWIRE_TIMEOUT); raises the error that failed it."""
        timeout = self.state.config.timeout
        if not tensor.ready.wait(timeout):
            raise GradwireTimeout(
                f"worker {self.state.rank}: the declaration of {tensor.name!r} did not complete in {timeout}s: "
                "every worker must declare it (call the same collective on it)",
                tensor=tensor.name,
            )
        if tensor.error is not None:
            raise tensor.error

    def send(self, tensor: Tensor) -> None:
        """Ask the scheduler to declare `tensor` as its signature says; `completed` runs with the answer."""
        body = self.body(tensor)
        if body.key_op == "optimizer":
            tensor.stateful = True
        try:
            self.state.check_usable()
            self.control.request_async(body, lambda reply: self.completed(tensor, reply))
        except GradwireError as e:
            self.completed(tensor, None, e)

    def body(self, tensor: Tensor) -> messages.Declare:
        """The declaration of `tensor` as its signature says (also what this worker reports of it to a resuming
        scheduler: worker/report.py)."""
        assert tensor.signature is not None
        key_op, _, _, slices, meta, members, args = tensor.signature
        # a server-side update's pushes carry a trailer after each partition's data: partitions leave room for it
        trailer = update.TRAILER_BYTES if key_op == "optimizer" else 0
        return messages.Declare(
            name=tensor.name,
            shape=list(tensor.shape),
            dtype=tensor.dtype.name,
            partition_bytes=(tensor.partition_bytes or self.state.partition_bytes) - trailer,
            key_op=key_op,
            op_args=None if args is None else json.loads(args),
            slices=None if slices is None else [list(s) for s in slices],
            meta=meta,
            members=None if members is None else list(members),
        )

    def completed(self, tensor: Tensor, reply: dict | None, error: GradwireError | None = None) -> None:
        """The scheduler answered a declaration (on the control thread; `reply` None: cancelled by `error`, or by
        an abort or a membership change): complete the tensor, and send or fail the calls that waited for it."""
        state = self.state
        if reply is None:
            error = error or state.abort or state.membership_error or JobAborted(f"worker {state.rank}: cancelled")
        elif "error" in reply:
            kind = TensorMismatch if reply.get("mismatch") else TensorError
            error = kind(f"worker {state.rank}: {reply['error']}", tensor=tensor.name, rank=state.rank)
        with state.lock:
            if error is None:
                assert reply is not None
                # the job's partition size (the scheduler's answer), so every worker cuts the tensor the same way
                pbytes, servers = int(reply["partition_bytes"]), reply["servers"]
                self.table.placed(tensor, pbytes, servers, reply.get("replicated"), bool(reply.get("held")))
            else:
                tensor.error = error
                self.table.forget(tensor)
            waiting, tensor.waiting = tensor.waiting, []
            tensor.ready.set()
        for fn in waiting:
            fn(error)
