"""Many arrays in one exchange: the adapters' way (JAX, TensorFlow, Keras) to send a step's gradients.

An adapter hands over a list of numpy arrays (a pytree's leaves, a tape's gradients, a Keras optimizer's gradients);
they are fused, one flat buffer per dtype they travel as (an array alone keeps its shape, so that workers whose
shapes differ get a TensorMismatch), and each buffer is one push_pull (or one broadcast), cut
into partitions and spread over the servers like any tensor: not one message per array. The results are cut back
into arrays of the inputs' shapes and dtypes. Types numpy does not sum (bfloat16 from ml_dtypes) travel as float32
and are narrowed back after.

Every worker passes arrays of the same shapes and dtypes in the same order under the same name. The buffers are named
`name`, `name#1`, ... in order of their dtypes' first appearance, not by dtype: workers that pass other dtypes under
one name then meet on the same tensor and each gets a TensorMismatch naming every worker's call, where names by dtype
would wait for each other forever. A group of other contents under the same name later is a new tensor on the servers
(gradwire.Worker.declare), never mixed with the old one.
"""

from __future__ import annotations

import hashlib

import numpy as np

from gradwire import collectives
from gradwire.worker import Handle, Worker


def signature(described: list[tuple[str, list]]) -> str:
    """A short name for a group of arrays, from each one's (dtype name, shape): the same group has the same name on
    every worker and in every step, so a step's exchange reuses its keys."""
    text = ";".join(f"{dtype}{list(shape)}" for dtype, shape in described)
    return f"{len(described)}.{hashlib.blake2b(text.encode(), digest_size=6).hexdigest()}"


def wire_dtype(dtype: np.dtype) -> np.dtype:
    """How arrays of `dtype` travel: as they are, or (bfloat16 and other types numpy does not sum) as float32."""
    if dtype.kind in "fiub" and dtype.name != "bfloat16":
        return dtype
    return np.dtype(np.float32)


def by_wire_dtype(arrays: list[np.ndarray]) -> dict[np.dtype, list[int]]:
    """The arrays' indices by the dtype they travel as (one fused buffer each), in order of first appearance."""
    groups: dict[np.dtype, list[int]] = {}
    for i, array in enumerate(arrays):
        groups.setdefault(wire_dtype(np.dtype(array.dtype)), []).append(i)
    return groups


def exchange(
    worker: Worker,
    arrays: list[np.ndarray],
    name: str,
    average: bool = False,
    op: str = "sum",
    root: int | None = None,
    members: list[int] | None = None,
) -> list[np.ndarray]:
    """The sum (or average, or `op`) of each array over the workers (or `members`), or with `root` the root's
    arrays; new arrays of the inputs' shapes and dtypes, in their order. Blocks."""
    arrays = [np.asarray(a) for a in arrays]
    pending: list[tuple[list[int], Handle]] = []
    for group, (dtype, indices) in enumerate(by_wire_dtype(arrays).items()):
        if len(indices) == 1:  # alone, an array keeps its shape: workers whose shapes differ get a TensorMismatch
            fused = np.array(arrays[indices[0]], dtype=dtype)  # a copy: the result lands in it
        else:
            fused = np.concatenate([arrays[i].astype(dtype, copy=False).reshape(-1) for i in indices])
        # named by position, not dtype: workers whose dtypes differ meet on one tensor and get a TensorMismatch
        tag = name if group == 0 else f"{name}#{group}"
        if root is None:
            handle = worker.push_pull_async(fused, tag, average=average, out=fused, op=op, members=members)
        else:
            handle = collectives.broadcast_async(worker, fused, root, tag, out=fused, members=members)
        pending.append((indices, handle))
    out: list[np.ndarray] = [np.empty(0)] * len(arrays)
    for indices, handle in pending:
        fused = worker.synchronize(handle).reshape(-1)
        at = 0
        for i in indices:
            n = arrays[i].size
            out[i] = fused[at : at + n].reshape(arrays[i].shape).astype(arrays[i].dtype, copy=False)
            at += n
    return out
