"""Parameter-server mode's call on the worker (docs/ps-mode.md): `update_async`, the push of a tensor whose servers
hold its parameters and optimizer state, and the checks of its arrays. `Calls` (worker/calls.py) inherits it, as the
other calls a training process makes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gradwire.errors import TensorError
from gradwire.protocol import update
from gradwire.worker.compressing import CompressedGradient
from gradwire.worker.handle import Handle
from gradwire.worker.work import Transfer

if TYPE_CHECKING:
    from gradwire.worker.compressing import Compressing
    from gradwire.worker.declaring import Declaring
    from gradwire.worker.state import WorkerState
    from gradwire.worker.tensors import Tensor


class Updates:
    """What `Calls` does for the parameter-server mode; the state and the parts are the calls' own."""

    state: WorkerState
    declaring: Declaring
    compressing: Compressing
    rank: int

    def launch(self, tensor: Tensor, out: np.ndarray, transfer: Transfer) -> Handle:
        raise NotImplementedError

    def update_async(
        self,
        array: np.ndarray | None,
        name: str,
        out: np.ndarray,
        args: dict,
        kind: int = update.GRAD,
        hyper: list[float] | None = None,
        which: int = 0,
        priority: int = 0,
        members: list[int] | None = None,
    ) -> Handle:
        """Parameter-server mode (docs/ps-mode.md): tensor `name`'s servers hold its parameters and the state of the
        optimizer `args` (protocol/update.py). `kind` GRAD: push the gradients `array`; the new parameters land in
        `out` once every member's are in (or, asynchronous, once this worker is within the staleness bound). INIT
        (every member, once): the first member's parameters `array` are installed and land in `out` on every member.
        READ: tensor `which` of the servers' state lands in `out` (`array` None). WRITE: `array` becomes tensor
        `which` (-1: the parameters, with the optimizer's state afresh); the parameters land in `out`. Reads and
        writes go to the servers alone, outside the rounds (any worker, any time between its updates).
        `hyper`: the algorithm's hyper-parameters for this push, in the order of update.HYPER."""
        self.state.check_usable()
        self._check_parameters(array, out, name)
        send = np.ascontiguousarray(array).reshape(-1) if array is not None else out.reshape(-1)[:0]
        if args.get("compressor") and not self.compressing.applies(out, "sum", None):
            args = {k: v for k, v in args.items() if k != "compressor"}  # float64, or too small to gain
        tensor = self.declaring.declare(
            name, out.shape, out.dtype, "optimizer", wait=False, members=members, op_args=args
        )
        extra = update.trailer(kind, which, hyper)
        if kind == update.GRAD and args.get("compressor"):
            store = self.compressing
            transfer = CompressedGradient(
                send, 0, out.reshape(-1), 0, 1, priority, extra, args=args["compressor"], store=store
            )
            return self.launch(tensor, out, transfer)
        direct = kind in (update.READ, update.WRITE)
        transfer = Transfer(send, 0, out.reshape(-1), 0, 1, priority, extra, partial=direct, same_round=direct)
        return self.launch(tensor, out, transfer)

    def _check_parameters(self, array: np.ndarray | None, out: np.ndarray, name: str) -> None:
        """A server-side optimizer's tensor: C-contiguous float32 or float64 parameters, and an input like them."""
        if out.dtype.name not in update.DTYPES or not out.flags.c_contiguous:
            raise TensorError(
                f"worker {self.rank}: a server-side optimizer's tensor {name!r} must be C-contiguous float32 or "
                f"float64, got {out.dtype}",
                tensor=name,
                rank=self.rank,
            )
        if array is not None and (array.shape != out.shape or array.dtype != out.dtype):
            raise TensorError(
                f"worker {self.rank}: update of {name!r}: input {array.dtype}{list(array.shape)}, parameters "
                f"{out.dtype}{list(out.shape)}",
                tensor=name,
                rank=self.rank,
            )
