"""`horovod.common.util`'s helpers that mean something here, so that code which imports them from Horovod runs with
the import changed (docs/horovod.md). What reports Horovod's build (`mpi_built`, `nccl_built`, ...) answers for
gradwire, as its adapters do (gradwire.introspection).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

from gradwire.introspection import ccl_built, ddl_built, gloo_built, mpi_built, nccl_built

__all__ = [
    "ccl_built",
    "ddl_built",
    "env",
    "gloo_built",
    "gpu_available",
    "is_iterable",
    "is_version_greater_equal_than",
    "mpi_built",
    "nccl_built",
    "num_rank_is_power_2",
    "split_list",
]


@contextmanager
def env(**values: str | None) -> Iterator[None]:
    """Set these environment variables for the `with` block (a None value is left as it is), then put back what was
    there before."""
    chosen = {name: value for name, value in values.items() if value is not None}
    before = {name: os.environ.get(name) for name in chosen}
    os.environ.update(chosen)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)(.*)$")


def _version_key(text: str) -> tuple[tuple[int, ...], int]:
    """(release numbers, 1 for a final release or 0 for anything after them: 2.16.0rc1 comes before 2.16.0)."""
    found = _RELEASE.match(text)
    if found is None:
        raise ValueError(f"not a version: {text!r}")
    numbers = tuple(int(n) for n in found.group(1).split("."))
    while len(numbers) > 1 and numbers[-1] == 0:  # 2.16 and 2.16.0 are one version
        numbers = numbers[:-1]
    rest = found.group(2).strip().lower()
    return numbers, 0 if rest and not rest.startswith(("+", ".post", "post")) else 1


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """Whether version `ver` is at least `target` (given as major.minor.patch), as Horovod's helper answers."""
    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError(
            f"versions are strings, got {type(ver).__name__} {ver!r} and {type(target).__name__} {target!r}"
        )
    if len(target.split(".")) != 3:
        raise ValueError(f"the target version is major.minor.patch, got {target!r}")
    return _version_key(ver) >= _version_key(target)


def split_list(items: list, n: int) -> list[list]:
    """`items` in `n` consecutive chunks whose lengths differ by at most one, the longer ones first."""
    size, extra = divmod(len(items), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(n)]


def num_rank_is_power_2(num_rank: int) -> bool:
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def is_iterable(x: object) -> bool:
    try:
        iter(x)  # type: ignore[call-overload]
    except TypeError:
        return False
    return True


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether that framework sees a GPU here (gradwire copies device tensors through host memory to the servers)."""
    if ext_base_name.endswith("torch"):
        import torch

        return torch.cuda.is_available()
    if ext_base_name.endswith("tensorflow"):
        import tensorflow as tf

        return bool(tf.config.list_physical_devices("GPU"))
    return False
