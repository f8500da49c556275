"""A tensor's signature: what every worker must declare alike (pure data)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Signature(NamedTuple):
    """What every worker must agree on about a tensor: what its keys compute, its dtype's name and shape, the slice of
    the result each rank pulls, anything else (a broadcast's root), the ranks that take part (None: every worker),
    and a built operation's arguments (canonical JSON). A worker numbers the versions of a name by it
    (worker/tensors.py), the scheduler checks every worker's against the others' (scheduler/declarations.py)."""

    key_op: str
    dtype: str
    shape: Sequence[int]
    slices: Sequence[Sequence[int]] | None
    meta: str | None
    members: Sequence[int] | None
    op_args: str | None = None

    @property
    def plain_sum(self) -> bool:
        """A sum of the whole tensor by every worker, nothing else to agree on."""
        return self.key_op == "sum" and self.slices is self.meta is self.members is self.op_args is None

    def __str__(self) -> str:
        extra = (("slices", self.slices), ("meta", self.meta), ("ranks", self.members), ("arguments", self.op_args))
        return f"{self.key_op} of {self.dtype}{list(self.shape)}" + "".join(
            f", {k} {v}" for k, v in extra if v is not None
        )
