"""The per-key operations a declaration may name: the wire's vocabulary, which the scheduler checks before any server
sees a declaration and the servers implement (server/ops.py, server/optim.py)."""

from __future__ import annotations

from gradwire.protocol import update

REDUCTIONS = ("sum", "min", "max", "product")  # elementwise: a joined rank's zeros stand in for its contribution
GATHER = "gather"  # concatenation in rank order (allgather, broadcast, alltoall)
BUILT = ("optimizer",)  # configured by their declaration's arguments (protocol/update.py)
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
    if name == "optimizer":
        try:
            return update.check_args(args or {})
        except ValueError as e:
            raise ValueError(f"optimizer: {e}") from None
    if args:
        raise ValueError(f"per-key operation {name!r} takes no arguments, got {args}")
    return None
