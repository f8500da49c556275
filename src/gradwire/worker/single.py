"""The calls of a job of one worker that `init()` made itself (gradwire/standalone.py: `python train.py` with no
launcher), answered in place: with one worker, a reduction's result (its sum, average, min, max or product over one
contribution), a gather's and a reduce-scatter's slice are the worker's own input, so no frame is sent and no server
thread takes the training thread's interpreter. A launched job of one worker still goes through its servers."""

from __future__ import annotations

import numpy as np

from gradwire.errors import TensorError
from gradwire.protocol import operations
from gradwire.worker.handle import Handle
from gradwire.worker.state import WorkerState


def applies(state: WorkerState, op: str, members: list[int] | None) -> bool:
    """Whether a call may be answered in place: the worker is alone in a job `init()` made, and `op` is a reduction
    or a gather among every rank (that is, itself)."""
    return (
        state.standalone
        and state.size == 1
        and (operations.is_reduction(op) or op == operations.GATHER)
        and members in (None, [0])
    )


def answered(name: str, out: np.ndarray, result: np.ndarray) -> Handle:
    """A completed handle whose output `out` holds `result` (copied into it, unless it already lies there: a call in
    place)."""
    flat, source = out.reshape(-1), result.reshape(-1)
    if flat.size != source.size:  # a slice past the input's end (the usual path's declaration would refuse it)
        raise TensorError(f"{name!r}: {source.size} elements for an output of {flat.size}", tensor=name)
    if flat.size and flat.ctypes.data != source.ctypes.data:
        np.copyto(flat, source, casting="no")
    return Handle(name, out, 0, _answered)


def _answered(_: Handle) -> None:
    """A handle answered in place has no bookkeeping to finish."""
