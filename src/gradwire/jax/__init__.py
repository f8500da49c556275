"""gradwire for JAX: pytrees summed through the servers, inside `jax.jit` or outside it, and an optax transformation
that averages gradients across workers.

    import gradwire.jax as gw
    gw.init()
    params = gw.broadcast(params, root_rank=0)                  # every worker starts from rank 0's parameters
    tx = gw.DistributedOptimizer(optax.adam(1e-3))              # or optax.chain(gw.distributed(), optax.adam(1e-3))

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(loss)(params, x, y)
        updates, state = tx.update(grads, state, params)        # the average over the workers, then Adam
        return optax.apply_updates(params, updates), state

Why an optax transformation: optax's way to change gradients is a `GradientTransformation`, so averaging is one link
of the chain, placed first (before clipping, weight decay, the optimizer's own moments) the way Horovod's and
BytePS's DistributedOptimizer wrap a torch optimizer. `DistributedOptimizer(inner)` is that chain for users who know
Horovod's name; `distributed()` is the link, for users who build their own chain. Neither keeps state of its own.

How a pytree travels: its leaves are fused, one flat buffer per dtype, and each buffer is one push_pull (cut into
partitions and spread over the servers like any tensor), not one message per leaf. Under `jax.jit` the exchange is an
ordered `io_callback`: the host side runs once per call of the compiled function, in program order, so every worker
makes the same calls in the same order. Names are fixed when a function is traced (a tree's name, or a counter per
call site in tracing order, the same on every worker), so the compiled step reuses the same keys every step.
Leaves travel in their own dtype where numpy has it (float16 included); bfloat16 ones as float32, narrowed back after.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import gradwire
from gradwire import grouped, init, is_initialized, local_rank, local_size, rank, shutdown, size
from gradwire.session import current_worker

__all__ = [
    "DistributedOptimizer",
    "allreduce",
    "barrier",
    "broadcast",
    "distributed",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "push_pull",
    "rank",
    "shutdown",
    "size",
]

_counters: dict[str, itertools.count] = {}
_lock = threading.Lock()


def _auto(kind: str) -> str:
    """A name for an unnamed call: the kind and how many such calls were made before it (in tracing order)."""
    with _lock:
        return f"jax.{kind}.{next(_counters.setdefault(kind, itertools.count()))}"


def _exchange_host(worker: gradwire.Worker, name: str, average: bool, root: int | None, *arrays: Any) -> list:
    """The host side: the leaves fused per dtype, summed (or broadcast), cut back (gradwire/grouped.py)."""
    return grouped.exchange(worker, [np.asarray(a) for a in arrays], name, average=average, root=root)


def _exchange(tree: Any, name: str, average: bool, root: int | None) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    worker = current_worker()  # taken when traced: the callback may run on another thread

    def host(*arrays: Any) -> list:
        return _exchange_host(worker, name, average, root, *arrays)

    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        shapes = [jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf)) for leaf in leaves]
        results = io_callback(host, shapes, *leaves, ordered=True)
    else:
        results = [jnp.asarray(r) for r in host(*leaves)]
    return jax.tree_util.tree_unflatten(treedef, results)


def allreduce(tree: Any, average: bool = True, name: str | None = None) -> Any:
    """The sum (or, by default, the average) of `tree` over all workers: a pytree of the same structure, shapes and
    dtypes. Every worker passes a tree of the same structure under the same name. Inside or outside `jax.jit`."""
    return _exchange(tree, name or _auto("allreduce"), average, None)


def push_pull(tree: Any, average: bool = False, name: str | None = None) -> Any:
    """BytePS's name: the sum (`average=False`, BytePS's own default is True) of `tree` over all workers."""
    return _exchange(tree, name or _auto("push_pull"), average, None)


def broadcast(tree: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Worker `root_rank`'s `tree`, on every worker (parameters at the start, so every worker starts alike)."""
    if not 0 <= root_rank < size():
        raise ValueError(f"root_rank {root_rank} is not a worker (0..{size() - 1})")
    return _exchange(tree, name or _auto("broadcast"), False, root_rank)


def barrier() -> None:
    """Block until every worker has entered the barrier (outside `jax.jit`)."""
    current_worker().barrier()


def distributed(average: bool = True, name: str = "grads") -> Any:
    """An optax transformation that replaces the updates (the gradients, placed first in a chain) by their average
    over the workers (or their sum). Stateless."""
    import optax

    def init_fn(params: Any) -> Any:
        return optax.EmptyState()

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return allreduce(updates, average=average, name=name), state

    return optax.GradientTransformation(init_fn, update_fn)


def DistributedOptimizer(optimizer: Any, average: bool = True, name: str = "grads") -> Any:  # noqa: N802 - Horovod's
    """`optimizer` (an optax GradientTransformation) applied to the gradients averaged over the workers: the chain
    `optax.chain(distributed(), optimizer)`. Its state is `optimizer`'s, wrapped in the chain's tuple."""
    import optax

    return optax.chain(distributed(average, name), optimizer)
