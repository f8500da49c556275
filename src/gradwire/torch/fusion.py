"""Fusion of small gradients: many small tensors travel as one, so per-message cost does not dominate.

Groups are fixed when the optimizer is built, from the parameter order alone: consecutive small parameters of one
dtype, taken in reverse order (the order backward produces them), up to `fusion_bytes` per group. Every worker
builds the same model, so every worker forms the same groups with no negotiation. A group's buffer is allocated
once; each member's gradient is copied in when ready (one small copy), and the group leaves when its last member is
in, with the priority of its earliest layer. The sum is copied back into each member's gradient.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .powersgd import PowerSGD

SMALL_BYTES = 64 << 10  # a parameter below this is fused; above it, its own message is already efficient


class FusionGroup:
    """A fixed set of small parameters that travel together in one buffer."""

    def __init__(self, params: list[torch.Tensor], names: list[str]) -> None:
        self.params = params
        # the members' names and shapes in the name: two models whose parameters share names (a GAN's generator
        # and discriminator) form groups of different contents, which must never meet on the servers
        members = "\n".join(f"{n}:{p.dtype}{list(p.shape)}" for n, p in zip(names, params, strict=True))
        digest = hashlib.blake2b(members.encode(), digest_size=4).hexdigest()
        self.name = f"fused.{names[0]}..{names[-1]}.{len(names)}.{digest}"
        self.offsets = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.buffer = torch.zeros(total, dtype=params[0].dtype)
        self.index = {id(p): i for i, p in enumerate(params)}
        self.ready: set[int] = set()

    def slice(self, param: torch.Tensor) -> torch.Tensor:
        i = self.index[id(param)]
        return self.buffer[self.offsets[i] : self.offsets[i] + param.numel()]

    def add(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        """Copy a member's gradient in; True when every member is in."""
        self.slice(param).copy_(grad.reshape(-1))
        self.ready.add(id(param))
        return len(self.ready) == len(self.params)

    def scatter(self) -> None:
        """Copy the summed buffer back into every member's gradient."""
        for p in self.params:
            assert p.grad is not None
            p.grad.copy_(self.slice(p).view_as(p.grad))
        self.ready.clear()


def plan(
    params: list[torch.Tensor],
    names: dict[int, str],
    fusion_bytes: int,
    explicit: list[list[torch.Tensor]] | None = None,
    alone: PowerSGD | None = None,
) -> dict[int, FusionGroup]:
    """Group small parameters; returns the group of each fused parameter (by id). Large ones are left alone, and the
    matrices `alone` carries as P and Q (fused, they would travel whole).

    With `explicit` groups (Horovod's `groups=`), those are the groups, whatever their sizes (split by dtype)."""
    groups: dict[int, FusionGroup] = {}
    if explicit is not None:
        trainable = {id(p) for p in params}
        for members in explicit:
            for dtype in dict.fromkeys(p.dtype for p in members):  # one buffer per dtype, in first-seen order
                same = [p for p in members if p.dtype == dtype and id(p) in trainable and id(p) not in groups]
                if len(same) > 1:
                    group = FusionGroup(same, [names[id(p)] for p in same])
                    groups.update((id(p), group) for p in same)
        return groups
    current: list[torch.Tensor] = []
    size = 0

    def close() -> None:
        nonlocal current, size
        if len(current) > 1:  # a group of one gains nothing
            group = FusionGroup(current, [names[id(p)] for p in current])
            for p in current:
                groups[id(p)] = group
        current, size = [], 0

    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if alone is not None and alone.carries(p):  # it travels apart; the small ones around it may still go together
            continue
        if nbytes >= SMALL_BYTES or fusion_bytes <= 0:
            close()
            continue
        if current and (current[-1].dtype != p.dtype or size + nbytes > fusion_bytes):
            close()
        current.append(p)
        size += nbytes
    close()
    return groups
