"""Partitions and keys: how a tensor is cut into units of transfer, and their stable ids.

A tensor of N elements is cut into P = ceil(N * itemsize / partition_bytes) contiguous partitions of
near-equal size (the first N % P get one element more). Equal pieces, rather than full pieces and a
small tail, keep the servers' loads even and the pipeline's stages the same length.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Partition:
    """Elements [start, start + count) of a tensor; `index` is its position in the tensor."""

    index: int
    start: int
    count: int


def split(num_elements: int, itemsize: int, partition_bytes: int) -> list[Partition]:
    """Cut `num_elements` into element-aligned partitions of at most `partition_bytes` each."""
    if itemsize < 1 or partition_bytes < itemsize:
        raise ValueError(f"partition_bytes={partition_bytes} cannot hold one {itemsize}-byte element")
    if num_elements == 0:
        return [Partition(0, 0, 0)]
    per_part = partition_bytes // itemsize
    parts = -(-num_elements // per_part)
    base, extra = divmod(num_elements, parts)
    out, start = [], 0
    for i in range(parts):
        count = base + (1 if i < extra else 0)
        out.append(Partition(i, start, count))
        start += count
    return out


def key_of(name: str, index: int) -> int:
    """The stable 64-bit key of partition `index` of tensor `name` (the same in every process)."""
    digest = hashlib.blake2b(f"{name}\0{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
