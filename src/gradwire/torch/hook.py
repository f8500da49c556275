"""A DDP communication hook: `ddp.register_comm_hook(gradwire.torch.PushPullHookState(ddp), push_pull_hook)`.

DDP hands the hook a bucket of flattened gradients and expects a Future of the reduced bucket. DDP rebuilds its
buckets after the first iteration, so a bucket's index is not a stable name: the hook names each bucket by its
parameters' names (given through `PushPullHookState`), so every worker's push_pull of a bucket meets the same
tensor on the servers.

A bucket reaches the hook only when its last gradient is ready, and DDP's buckets are large (25 MB): on a model of
a few tens of MB nearly all of it waits for the end of backward. Given the DDP module itself, the state therefore
overlaps: once DDP's bucket layout is final (DDP rebuilds it once, at the second iteration), it pushes each
gradient the moment autograd has accumulated it (gradients.py), in sub-buckets of at most the job's fusion bytes
cut inside DDP's buckets, and the hook only waits for its bucket's sums. Every worker sees the same layouts in the
same iterations, so all switch together. `no_sync()` is read at each forward, as DDP reads it. Given the inner
module (or `overlap=False`), every bucket is pushed whole when the hook is called.
"""

# No `from __future__ import annotations`: DDP checks `bucket: dist.GradBucket` at runtime.
import hashlib
import threading
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gradwire
import torch
from gradwire.errors import TensorError
from gradwire.worker import Worker

from .compression import Compressor, DefaultCompressor, configured
from .fusion import FusionGroup
from .gradients import GradientSync
from .ops import TorchHandle, push_pull_async
from .powersgd import PowerSGD


class PushPullHookState:
    """What the hook needs: parameter names (by identity), compression, the worker, and (given the DDP module) what
    overlapping the backward pass needs: DDP's bucket layout and the gradients' push_pulls."""

    __slots__ = ("compression", "ddp", "layout", "names", "params", "planned", "previous", "sync", "worker")

    def __init__(
        self,
        model: torch.nn.Module,
        compression: type[Compressor] = DefaultCompressor,
        worker: "Worker | None" = None,
        overlap: bool = True,
    ) -> None:
        if isinstance(compression, PowerSGD):
            raise ValueError(
                "PowerSGD needs each gradient's matrix, which DDP's flat buckets do not keep: use gradwire's "
                "DistributedOptimizer with Compression.powersgd(), or torch's own powerSGD_hook in place of this hook"
            )
        named = list(model.named_parameters())
        self.names = {id(p): n for n, p in named}
        self.params = [p for _, p in named]
        self.compression = compression
        self.worker = worker or gradwire.current_worker()
        self.ddp = model if overlap and isinstance(model, DistributedDataParallel) else None
        self.layout: list[tuple[int, ...]] = []  # this backward's buckets, as parameter ids, in DDP's order
        self.previous: list[tuple[int, ...]] | None = None
        self.planned: list[tuple[int, ...]] = []  # the layout the sub-buckets were cut in
        self.sync: GradientSync | None = None
        if self.ddp is not None:
            self.ddp.register_forward_pre_hook(self._forward)

    def _forward(self, module: Any, _inputs: Any) -> None:
        if self.sync is not None:  # DDP decides at forward time whether this backward synchronizes
            self.sync.enabled = bool(module.require_backward_grad_sync) and torch.is_grad_enabled()

    def learn(self, bucket: dist.GradBucket) -> None:
        """Record the bucket's place in DDP's layout; at the last bucket, start overlapping if it held steady."""
        if self.ddp is None:
            return
        self.layout.append(tuple(id(p) for p in bucket.parameters()))
        if not bucket.is_last():
            return
        # DDP rebuilds its buckets once, at the second forward (torch 2.x says so in `_has_rebuilt_buckets`); where
        # that flag is missing, a layout seen twice in a row is taken as final
        if getattr(self.ddp, "_has_rebuilt_buckets", False) or self.layout == self.previous:
            self.overlap(self.layout)
        self.previous, self.layout = self.layout, []

    def overlap(self, layout: list[tuple[int, ...]]) -> None:
        """Push gradients as they are accumulated from the next backward on, in sub-buckets cut inside DDP's."""
        by_id = {id(p): p for p in self.params}
        cap = self.worker.config.fusion_bytes
        groups = [group for ids in layout for group in sub_buckets([by_id[i] for i in ids], cap)]
        self.sync = GradientSync(
            self.params, self.names, self.compression, prefix="ddp.", owner="push_pull_hook", groups=groups
        )
        self.sync._bound = self.worker
        self.planned = layout


def sub_buckets(params: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """Consecutive parameters of one dtype, up to `cap` bytes together (a larger one alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > cap or out[-1][0].dtype != p.dtype:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


def push_pull_hook(state: PushPullHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over all workers through the summation servers; returns a Future of the bucket."""
    if state.sync is not None:
        return _overlapped(state, state.sync, bucket)
    state.learn(bucket)
    names = sorted(state.names[id(p)] for p in bucket.parameters())
    digest = hashlib.blake2b("\n".join(names).encode(), digest_size=8).hexdigest()
    buffer = bucket.buffer()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    handle = push_pull_async(
        buffer,
        average=True,
        name=f"ddp.{digest}",
        compression=configured(state.compression, state.worker.state.config),
        worker=state.worker,
    )

    def complete(_: object) -> None:
        try:
            future.set_result(handle.result(state.worker))
        except Exception as e:  # noqa: BLE001 - delivered to DDP through the future
            future.set_exception(e)

    handle.handle.add_done_callback(complete)
    return future


def _overlapped(
    state: PushPullHookState, sync: GradientSync, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The bucket's gradients are on their way already: wait for their sums and hand DDP the bucket."""
    params = bucket.parameters()
    ids = tuple(id(p) for p in params)
    if bucket.index() >= len(state.planned) or state.planned[bucket.index()] != ids:
        raise TensorError(
            f"worker {state.worker.rank}: DDP's bucket {bucket.index()} changed its parameters after gradwire's "
            "hook cut its sub-buckets; build the PushPullHookState after DDP's first iteration, or pass "
            "overlap=False",
            rank=state.worker.rank,
        )
    # unused in this forward (find_unused_parameters): zeros take its place in the sum, and its gradient is left to
    # DDP (which leaves a parameter no rank used without one)
    absent = [p for p in params if id(p) not in sync.handles and p.grad is None]
    for p in absent:
        p.grad = torch.zeros_like(p)
    for p in params:
        if id(p) not in sync.handles:
            sync.push(p)
    taken = sync.take(params)
    views = bucket.gradients()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    pending = [len(taken)]
    lock = threading.Lock()

    def complete(_: object) -> None:
        with lock:
            pending[0] -= 1
            if pending[0]:
                return
        try:
            _gather(state.worker, taken, params, views)
            for p in absent:
                p.grad = None
            future.set_result(bucket.buffer())
        except Exception as e:  # noqa: BLE001 - delivered to DDP through the future
            future.set_exception(e)

    for handle, _group in taken:
        handle.handle.add_done_callback(complete)
    return future


def _gather(
    worker: Worker,
    taken: list[tuple[TorchHandle, FusionGroup | None]],
    params: list[torch.Tensor],
    views: list[torch.Tensor],
) -> None:
    """The sums into the parameters' gradients, and from there into DDP's bucket."""
    for handle, group in taken:
        handle.result(worker)
        if group is not None:
            group.scatter()
    with torch.no_grad():
        for p, view in zip(params, views, strict=True):
            assert p.grad is not None
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.view_as(view))
