"""The per-key operations a declaration may name: the wire's vocabulary, which the scheduler checks before any server
sees a declaration and the servers implement (server/ops.py, server/optimizer_op.py)."""

from __future__ import annotations

import json

from gradwire.protocol import compression, update

REDUCTIONS = ("sum", "min", "max", "product")  # elementwise: a joined rank's zeros stand in for its contribution
GATHER = "gather"  # concatenation in rank order (allgather, broadcast, alltoall)
# configured by their declaration's arguments: a server-side optimizer (protocol/update.py), a sum of compressed
# contributions (protocol/compression.py)
BUILT = ("optimizer", "compressed")
NAMES = (*REDUCTIONS, GATHER, *BUILT)


def known(name: str) -> bool:
    return name in NAMES


def is_reduction(name: str) -> bool:
    """An elementwise reduction (sum, min, max, product)."""
    return name in REDUCTIONS


def check_args(name: str, args: dict | None) -> dict | None:
    """The operation's declared arguments, complete and canonical (None for an operation that takes none); ValueError
    saying what is wrong."""
    if name not in NAMES:
        raise ValueError(f"unknown per-key operation {name!r}; known: {', '.join(sorted(NAMES))}")
    if name in BUILT:
        try:
            return (update if name == "optimizer" else compression).check_args(args or {})
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    if args:
        raise ValueError(f"per-key operation {name!r} takes no arguments, got {args}")
    return None


def encode_args(name: str, args: dict) -> str:
    """The canonical text of a built operation's arguments (what workers must agree on); ValueError if wrong."""
    checked = check_args(name, args)
    return json.dumps(checked, sort_keys=True, separators=(",", ":"))
