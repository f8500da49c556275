"""Per-key operations: what a key's rounds compute (the engine's one extension point, docs/architecture.md).

A key is declared with one operation, and the engine runs it with the machinery every key shares (the ring, the
double-buffered rounds, the rank order of deterministic sums, the staging of early contributions, validation,
failover seeds, metrics). An operation only says how a contribution goes into the round's accumulator:

- `Reduce(ufunc)`: elementwise sum, min, max or product, in the accumulator's precision (float16 and bfloat16 in
  float32). Sum is the default of every key.
- `Gather`: contributions are concatenated in rank order; each may be shorter than the key, or empty. Allgather is a
  gather whose partitions each rank fills with the part of its tensor that falls in them; a broadcast is a gather
  to which only the root contributes.

What each rank pulls is the key's, not the operation's: the whole result, or a slice of it per rank (`slices`,
declared with the key): reducescatter is a sum with slices, and a rank whose slice misses a key pulls nothing.
New operations subclass `KeyOp` and are added to `OPS`, or built from declared arguments by `build` (the optimizer
update of parameter-server mode, server/optimizer_op.py, which also keeps per-key state and handles some pushes itself).
"""

from __future__ import annotations

import numpy as np

from gradwire.errors import TensorError
from gradwire.protocol import dtypes, operations
from gradwire.server.rounds import KeyOp, KeyState, Round


class Reduce(KeyOp):
    """An elementwise reduction by a numpy ufunc."""

    reduction = True
    lendable = True

    def __init__(self, name: str, ufunc: np.ufunc) -> None:
        self.name = name  # type: ignore[misc]
        self.ufunc = ufunc

    def landing(self, state: KeyState, r: Round) -> np.ndarray | None:
        return None if state.narrow else r.acc  # the first contribution is the accumulator's start

    def add(self, state: KeyState, r: Round, dtype: dtypes.DType, wire: np.ndarray, first: bool) -> None:
        acc = r.acc
        if first:
            state.sums.widen(dtype, wire, acc)
        elif self.ufunc is np.add:
            state.sums.add_into(dtype, acc, wire, state.scratch)
        elif dtype.accumulate != dtype.wire:  # float16 and bfloat16: widened first
            state.sums.widen(dtype, wire, state.scratch)
            self.ufunc(acc, state.scratch, out=acc)
        else:
            self.ufunc(acc, wire, out=acc, casting="unsafe")


class Gather(KeyOp):
    """Concatenation in rank order (allgather, broadcast); a round's `filled` is how many elements are in."""

    name = "gather"
    ordered = True
    variable = True
    lendable = True

    def add(self, state: KeyState, r: Round, dtype: dtypes.DType, wire: np.ndarray, first: bool) -> None:
        start = 0 if first else r.filled
        end = start + len(wire)
        if end > len(r.acc):
            raise TensorError(f"gather {state.name!r}: contributions of {end} elements overflow the key's {len(r.acc)}")
        if len(wire):
            state.sums.widen(dtype, wire, r.acc[start:end])
        r.filled = end

    def check(self, state: KeyState, r: Round) -> None:
        if r.filled != len(r.acc):
            raise TensorError(
                f"gather {state.name!r}: the workers' contributions fill {r.filled} of the key's {len(r.acc)} "
                "elements (their sizes disagree)"
            )


UFUNCS = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}
OPS: dict[str, KeyOp] = {name: Reduce(name, UFUNCS[name]) for name in operations.REDUCTIONS} | {"gather": Gather()}
SUM = OPS["sum"]


def build(name: str, args: dict | None) -> KeyOp:
    """The operation `name` (protocol/operations.py) with its declared arguments; TensorError saying what is wrong."""
    try:
        checked = operations.check_args(name, args)
    except ValueError as e:
        raise TensorError(str(e)) from None
    if name == "optimizer":
        from gradwire.server.optimizer_op import ServerUpdate

        return ServerUpdate(checked or {})
    if name == "compressed":
        from gradwire.server.compressed import Compressed

        return Compressed(checked or {})
    return OPS[name]
