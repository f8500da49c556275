"""A compressed key's rounds (docs/compression.md): every push is a block of the key's compressor
(protocol/compression.py), decoded into the float32 accumulator in rank order; the sum is encoded once, after adding
the key's own error-feedback residual, and every worker pulls the same block.

The residual (what encoding the sum dropped, carried into the next round's sum, as BytePS's servers do) is the key's
state on this server. A failover does not move it: the key's new server starts with a zero residual (what is lost is
at most one round's compression error of that key, which error feedback would have sent later). Every worker still
receives the same bytes, so their parameters stay identical.
"""

from __future__ import annotations

import numpy as np

from gradwire.errors import TensorError
from gradwire.protocol import compression, dtypes
from gradwire.server.rounds import KeyOp, KeyState, Round


class _Held:
    """A compressed key's own: its partition's codec, its residual (None without error feedback) and a scratch."""

    __slots__ = ("codec", "residual", "scratch")

    def __init__(self, codec: compression.Codec, n: int, feedback: bool) -> None:
        self.codec = codec
        self.residual = np.zeros(n, np.float32) if feedback else None
        self.scratch = np.empty(n, np.float32) if feedback else None


class Compressed(KeyOp):
    """A sum of compressed contributions (a reduction: a joined worker's zeros, an all-zero block, stand in for it)."""

    name = "compressed"
    reduction = True

    def __init__(self, args: dict) -> None:
        self.args = args
        self.codec = compression.codec(args)

    def lengths(self, nbytes: int, itemsize: int) -> tuple[int, int]:
        if itemsize != 4:
            raise TensorError(f"compressed keys are float32, not {itemsize}-byte elements")
        n = nbytes // 4
        return compression.for_partition(self.codec, n).wire_bytes(n), n

    def setup(self, state: KeyState, previous: KeyState | None = None) -> None:
        n = len(state.rounds[0].acc)
        codec = compression.for_partition(self.codec, n)
        state.held = _Held(codec, n, bool(self.args["ef"]) and not codec.lossless_sum)

    def landing(self, state: KeyState, r: Round) -> np.ndarray | None:
        return None  # a block is decoded, never received into the accumulator

    def add(self, state: KeyState, r: Round, dtype: dtypes.DType, wire: np.ndarray, first: bool) -> None:
        held: _Held = state.held
        held.codec.decode(wire.view(np.uint8), r.acc, state.key, r.number, add=not first)

    def finish(self, state: KeyState, r: Round) -> None:
        held: _Held = state.held
        total, block = r.acc, r.out.view(np.uint8)
        if held.residual is None:
            held.codec.encode(total, block, state.key, r.number, -1)
            return
        total += held.residual
        held.codec.encode(total, block, state.key, r.number, -1)
        held.codec.decode(block, held.scratch, state.key, r.number, add=False)
        np.subtract(total, held.scratch, out=held.residual)
