"""A compressed key's rounds (docs/compression.md): every push is a block of the key's compressor
(protocol/compression.py), decoded into the float32 accumulator in rank order; the sum is encoded once, after adding
the key's own error-feedback residual, and every worker pulls the same block.

The residual (what encoding the sum dropped, carried into the next round's sum, as BytePS's servers do) is the key's
state on this server. A failover does not move it: the key's new server (or its replica) starts with a zero residual,
and counts it (`restarts`: the server's status and gradwire_server_compression_residual_restarts), as a server-side
optimizer's state restarted by a failover is counted (server/optimizer_op.py). What is lost is at most one round's
compression error of that key, which error feedback would have sent later. Every worker still receives the same
bytes, so their parameters stay identical.
"""

from __future__ import annotations

import logging

import numpy as np

from gradwire.errors import TensorError
from gradwire.protocol import compression, dtypes
from gradwire.server.rounds import KeyOp, KeyState, Round

log = logging.getLogger("gradwire.server")
FIRST_ROUND = 1  # workers number a tensor's rounds from 1 (worker/launching.py), afresh after an elastic reset


class _Held:
    """A compressed key's own: its partition's codec, its residual (None without error feedback), a scratch, the sums
    encoded here and the times its residual started from zero in mid-training (a failover)."""

    __slots__ = ("codec", "encoded", "residual", "restarts", "scratch")

    def __init__(self, codec: compression.Codec, n: int, feedback: bool) -> None:
        self.codec = codec
        self.residual = np.zeros(n, np.float32) if feedback else None
        self.scratch = np.empty(n, np.float32) if feedback else None
        self.encoded = 0
        self.restarts = 0


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
        if previous is not None and isinstance(previous.held, _Held) and previous.nbytes == state.nbytes:
            state.held = previous.held  # a reset (a failover elsewhere, an elastic change) keeps the residual
            return
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
        if held.encoded == 0 and r.number > FIRST_ROUND and held.residual is not None:
            held.restarts += 1  # another server encoded this key's earlier sums: its residual stayed there
            log.warning(
                "%r (a partition, key %016x): round %d is the first this server encodes; its error-feedback "
                "residual starts from zero (the key's server died: docs/compression.md)",
                state.name,
                state.key,
                r.number,
            )
        held.encoded += 1
        if held.residual is None:
            held.codec.encode(total, block, state.key, r.number, -1)
            return
        total += held.residual
        held.codec.encode(total, block, state.key, r.number, -1)
        held.codec.decode(block, held.scratch, state.key, r.number, add=False)
        np.subtract(total, held.scratch, out=held.residual)


def stats(states: list[KeyState]) -> dict:
    """The compressed keys of a server: their count, the residual bytes held, and residual restarts (failovers)."""
    held = [s.held for s in states if isinstance(s.held, _Held)]
    return {
        "keys": len(held),
        "residual_bytes": sum(h.residual.nbytes for h in held if h.residual is not None),
        "residual_restarts": sum(h.restarts for h in held),
    }
