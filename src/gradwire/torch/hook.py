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

PowerSGD (`compression=Compression.powersgd(...)`, docs/compression.md) needs each gradient's matrix, which DDP's
bucket still names: `bucket.gradients()` are views of its flat buffer in their parameters' shapes, as torch's own
`powerSGD_hook` reads them. The matrices PowerSGD compresses travel alone (never fused into a sub-bucket), as P's and
Q's sums; the rest of the bucket travels plain. The matrices a worker has started when a bucket's hook runs leave in
one batch there (the same on every worker: DDP calls its hooks at the same points of every worker's backward), and a
thread of the state's waits for P's sum, computes Q, waits for Q's sum and completes DDP's future: the second sum
needs the first, and neither may hold up the backward pass.
"""

# No `from __future__ import annotations`: DDP checks `bucket: dist.GradBucket` at runtime.
import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torch
from gradwire.errors import TensorError
from gradwire.session import current_worker
from gradwire.worker import Worker

from .compression import Compression, Compressor, DefaultCompressor, configured
from .fusion import FusionGroup
from .gradients import GradientSync
from .ops import TorchHandle, push_pull_async
from .powersgd import PowerSGD


class PushPullHookState:
    """What the hook needs: parameter names (by identity), compression, the worker, and (given the DDP module) what
    overlapping the backward pass needs: DDP's bucket layout and the gradients' push_pulls."""

    __slots__ = (
        "compression",
        "ddp",
        "layout",
        "names",
        "params",
        "planned",
        "previous",
        "sync",
        "waiter",
        "worker",
    )

    def __init__(
        self,
        model: torch.nn.Module,
        compression: type[Compressor] = DefaultCompressor,
        worker: "Worker | None" = None,
        overlap: bool = True,
    ) -> None:
        named = list(model.named_parameters())
        self.names = {id(p): n for n, p in named}
        self.params = [p for _, p in named]
        self.compression = compression
        self.worker = worker or current_worker()
        self.ddp = model if overlap and isinstance(model, DistributedDataParallel) else None
        self.layout: list[tuple[int, ...]] = []  # this backward's buckets, as parameter ids, in DDP's order
        self.previous: list[tuple[int, ...]] | None = None
        self.planned: list[tuple[int, ...]] = []  # the layout the sub-buckets were cut in
        self.sync: GradientSync | None = None
        self.waiter: ThreadPoolExecutor | None = None  # completes the buckets PowerSGD carries
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
        cap, alone = self.worker.config.fusion_bytes, self.powersgd()
        groups = [group for ids in layout for group in sub_buckets([by_id[i] for i in ids], cap, alone)]
        self.sync = GradientSync(
            self.params, self.names, self.compression, prefix="ddp.", owner="push_pull_hook", groups=groups
        )
        self.sync._bound = self.worker
        self.planned = layout

    def powersgd(self) -> PowerSGD | None:
        """The PowerSGD compressor this hook runs (named, or GRADWIRE_COMPRESSOR's), or None."""
        found = configured(self.compression, self.worker.state.config)
        return found if isinstance(found, PowerSGD) else None

    def complete_later(self, finish: Callable[[], None]) -> None:
        """Run `finish` on the state's waiting thread (one: buckets complete in the order DDP called the hook)."""
        if self.waiter is None:
            self.waiter = ThreadPoolExecutor(1, thread_name_prefix="gw-ddp-powersgd")
        self.waiter.submit(finish)


def sub_buckets(params: list[torch.Tensor], cap: int, alone: PowerSGD | None = None) -> list[list[torch.Tensor]]:
    """Parameters of one dtype in bucket order, up to `cap` bytes together (a larger one alone). Each matrix `alone`
    compresses travels apart as P and Q, and the parameters around it still go together (fusion.plan's rule): the
    biases between a model's matrices are one sum, not one each, and every sum waits for the slowest worker."""
    out: list[list[torch.Tensor]] = []
    open_group: list[torch.Tensor] | None = None  # the group that takes the next small parameter
    size = 0
    for p in params:
        if alone is not None and alone.carries(p):
            out.append([p])
            continue
        nbytes = p.numel() * p.element_size()
        if open_group is None or size + nbytes > cap or open_group[0].dtype != p.dtype:
            open_group, size = [], 0
            out.append(open_group)
        open_group.append(p)
        size += nbytes
    return out


def push_pull_hook(state: PushPullHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over all workers through the summation servers; returns a Future of the bucket."""
    if state.sync is not None:
        return _overlapped(state, state.sync, bucket)
    state.learn(bucket)
    powersgd = state.powersgd()
    if powersgd is not None:
        return _powersgd_bucket(state, powersgd, bucket)
    buffer = bucket.buffer()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    handle = push_pull_async(
        buffer,
        average=True,
        name=_bucket_name(sorted(state.names[id(p)] for p in bucket.parameters())),
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


def _bucket_name(names: list[str]) -> str:
    """The name of a sum of these parameters' gradients: the same on every worker (DDP's bucket indices are not)."""
    digest = hashlib.blake2b("\n".join(names).encode(), digest_size=8).hexdigest()
    return f"ddp.{digest}"


def _overlapped(
    state: PushPullHookState, sync: GradientSync, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The bucket's gradients are on their way already: wait for their sums and hand DDP the bucket."""
    params = bucket.parameters()
    _check_planned(state, bucket, params)
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

    def finish() -> None:
        try:
            _gather(state.worker, taken, params, views)
            for p in absent:
                p.grad = None
            future.set_result(bucket.buffer())
        except Exception as e:  # noqa: BLE001 - delivered to DDP through the future
            future.set_exception(e)

    def complete(_: object) -> None:
        with lock:
            pending[0] -= 1
            if pending[0]:
                return
        finish()

    if any(not isinstance(handle, TorchHandle) for handle, _ in taken):  # PowerSGD's: P's sum, then Q's
        for handle, _group in taken:
            getattr(handle, "start", lambda: None)()  # the open batch leaves here, at the same point on every worker
        state.complete_later(finish)
        return future
    for handle, _group in taken:
        handle.handle.add_done_callback(complete)
    return future


def _check_planned(state: PushPullHookState, bucket: dist.GradBucket, params: list[torch.Tensor]) -> None:
    """The bucket holds the parameters the hook cut its sub-buckets for (DDP may rebuild buckets after its first
    iteration)."""
    ids = tuple(id(p) for p in params)
    if bucket.index() >= len(state.planned) or state.planned[bucket.index()] != ids:
        raise TensorError(
            f"worker {state.worker.rank}: DDP's bucket {bucket.index()} changed its parameters after gradwire's "
            "hook cut its sub-buckets; build the PushPullHookState after DDP's first iteration, or pass "
            "overlap=False",
            rank=state.worker.rank,
        )


def _powersgd_bucket(
    state: PushPullHookState, powersgd: PowerSGD, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A whole bucket through PowerSGD: each matrix it compresses as P's and Q's sums (into its view of the bucket),
    the rest of the bucket as one plain sum."""
    worker, calls, rest, names = state.worker, [], [], []
    for p, view in zip(bucket.parameters(), bucket.gradients(), strict=True):
        name = f"ddp.{state.names[id(p)]}"
        call = powersgd.push_pull_async(view, True, name, 0, worker, True, "sum", None)
        if call is None:  # a vector, a small matrix, or its first steps
            rest.append(view)
            names.append(name)
        else:
            calls.append(call)
    plain = None
    if rest:
        flat = torch.cat([v.reshape(-1) for v in rest])
        plain = push_pull_async(flat, True, _bucket_name(names), compression=Compression.none, worker=worker)
    for call in calls:
        call.start()  # the open batch leaves here, at the same point on every worker
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def finish() -> None:
        try:
            for call in calls:  # first: see _gather
                call.result(worker)
            if plain is not None:
                summed, at = plain.result(worker), 0
                with torch.no_grad():
                    for view in rest:
                        view.copy_(summed[at : at + view.numel()].view_as(view))
                        at += view.numel()
            future.set_result(bucket.buffer())
        except Exception as e:  # noqa: BLE001 - delivered to DDP through the future
            future.set_exception(e)

    state.complete_later(finish)
    return future


def _gather(
    worker: Worker,
    taken: list[tuple[TorchHandle, FusionGroup | None]],
    params: list[torch.Tensor],
    views: list[torch.Tensor],
) -> None:
    """The sums into the parameters' gradients, and from there into DDP's bucket. PowerSGD's first: their sums come
    first in the job-wide order (worker/flow.py), and Q's is computed only once P's has been waited for."""
    taken = sorted(taken, key=lambda entry: isinstance(entry[0], TorchHandle))
    for handle, group in taken:
        handle.result(worker)
        if group is not None:
            group.scatter()
    with torch.no_grad():
        for p, view in zip(params, views, strict=True):
            assert p.grad is not None
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.view_as(view))
