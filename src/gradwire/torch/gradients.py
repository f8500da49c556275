"""Gradients pushed as backward produces them, and waited for: what DistributedOptimizer, BytePS's
DistributedDataParallel and CrossBarrier share.

A post-accumulate-grad hook on every parameter starts that gradient's push_pull the moment autograd has accumulated
it (after `passes` backward passes), so communication overlaps the rest of the backward pass. Priority follows layer
order: the first layers' gradients leave first, since the next forward pass needs them first (and backward produces
them last). Small gradients travel fused (fusion.py).
"""

from __future__ import annotations

from collections.abc import Callable

import gradwire
import torch
from gradwire.config import Config
from gradwire.errors import TensorError
from gradwire.session import current_worker, use_worker
from gradwire.worker import Worker

from . import fusion
from .collectives import Average, Sum
from .compression import Compressor, configured
from .exchange import sparse_allreduce_async
from .ops import TorchHandle, push_pull_async
from .powersgd import PowerSGD


class GradientSync:
    """The push_pulls of one set of parameters' gradients. Not thread-safe: hooks run on the backward thread.

    `params` in model order, `names` by parameter id (the same on every worker). The worker is bound at the first
    push, so this may be built before `gradwire.init()`. `fusion_bytes` None: the job's GRADWIRE_FUSION_BYTES.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        names: dict[int, str],
        compression: type[Compressor],
        average: bool = True,
        passes: int = 1,
        fusion_bytes: int | None = None,
        predivide: float = 1.0,
        sparse_as_dense: bool = False,
        groups: list[list[torch.Tensor]] | None = None,
        prefix: str = "grad.",
        owner: str = "DistributedOptimizer",
        members: list[int] | None = None,
    ) -> None:
        self.members = members  # a process set's ranks (None: every worker)
        self.resparse: set[int] = set()  # sparse gradients summed dense this step
        self._bound: Worker | None = current_worker_or_none()
        self.names = names
        self.compression = compression
        self.average = average
        self.passes = passes
        self.predivide = predivide
        self.sparse_as_dense = sparse_as_dense
        self.prefix, self.owner = prefix, owner
        self.priority = {id(p): len(params) - i for i, p in enumerate(params)}  # first layers first
        self.params = [p for p in params if p.requires_grad]
        self.by_id = {id(p): p for p in self.params}
        config = self._bound.config if self._bound is not None else Config.from_env()
        if fusion_bytes is None:
            fusion_bytes = config.fusion_bytes
        compressor = configured(compression, config)  # PowerSGD's matrices (a sum over every worker) travel apart
        alone = compressor if isinstance(compressor, PowerSGD) and members is None else None
        self.groups = fusion.plan(self.params, names, fusion_bytes, groups, alone)
        self.handles: dict[int, TorchHandle | None] = {}  # None: in flight inside its fusion group
        self.group_handles: dict[str, tuple[fusion.FusionGroup, TorchHandle]] = {}
        self.counts: dict[int, int] = {}
        self.enabled = True  # off inside DDP's no_sync(): gradients accumulate locally
        self.on_all_pushed: Callable[[], None] | None = None
        self.hooks = [p.register_post_accumulate_grad_hook(self.on_grad) for p in self.params]

    @property
    def worker(self) -> Worker:
        if self._bound is None:
            self._bound = current_worker()
        return self._bound

    @property
    def excluded(self) -> bool:
        """This worker is not in the process set: its optimizer steps alone (as Horovod's does)."""
        return self.members is not None and self.worker.rank not in self.members

    def on_grad(self, param: torch.Tensor) -> None:
        if not self.enabled or self.excluded:
            return
        pid = id(param)
        if pid in self.handles:
            raise TensorError(
                f"worker {self.worker.rank}: the gradient of {self.names[pid]!r} was computed more times than "
                f"backward_passes_per_step={self.passes} before step(): call step() (or synchronize()) after every "
                f"{self.passes} backward passes, or raise backward_passes_per_step",
                tensor=self.names[pid],
                rank=self.worker.rank,
            )
        self.counts[pid] = self.counts.get(pid, 0) + 1
        if self.counts[pid] == self.passes:
            self.push(param)
            if self.on_all_pushed is not None and len(self.handles) == len(self.params):
                self.on_all_pushed()

    def push(self, param: torch.Tensor) -> None:
        """Start the push_pull of `param`'s gradient (or add it to its fusion group, which leaves when full)."""
        pid = id(param)
        grad = param.grad
        assert grad is not None
        scale = 1.0 / self.passes / self.predivide  # Horovod's prescale: 1/predivide; the postscale undoes it
        if grad.is_sparse:
            if not self.sparse_as_dense and pid not in self.groups:
                # as Horovod: an allgather of its indices and values (a fused one is summed dense: it is small)
                source = grad * scale if scale != 1.0 else grad
                name = f"{self.prefix}{self.names[pid]}"
                op = Average if self.average else Sum
                with use_worker(self.worker):
                    gather = sparse_allreduce_async(source, name, op, _Ranks(self.members))
                self.handles[pid] = _SparseSum(param, gather, self.predivide)  # type: ignore[assignment]
                return
            grad = param.grad = grad.to_dense()
            self.resparse.add(pid)  # made sparse again once summed (SparseAdam wants sparse gradients)
        if scale != 1.0:
            grad.mul_(scale)
        group = self.groups.get(pid)
        if group is None:
            self.handles[pid] = self._start(grad, self.names[pid], self.priority[pid])
            return
        self.handles[pid] = None
        if group.add(param, grad):
            priority = max(self.priority[id(p)] for p in group.params)
            self.group_handles[group.name] = (group, self._start(group.buffer, group.name, priority))

    def _start(self, tensor: torch.Tensor, name: str, priority: int) -> TorchHandle:
        handle = push_pull_async(
            tensor,
            self.average,
            f"{self.prefix}{name}",
            priority,
            configured(self.compression, self.worker.state.config),
            worker=self.worker,
            members=self.members,
        )
        handle.scale = self.predivide
        return handle

    def push_missing(self) -> None:
        """Push every gradient not pushed yet: a parameter with no gradient on this rank this step (or fewer passes
        than expected) still takes part in the sum, as zeros if need be, or every other rank would wait for it."""
        for p in self.params:
            if id(p) not in self.handles:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self.push(p)

    def wait(self, params: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Wait for the sums of `params` (all pushed ones if None) and put them into their gradients; returns the
        parameters whose sums arrived (a fused group's members arrive together)."""
        ids = set(self.handles) if params is None else {id(p) for p in params} & set(self.handles)
        for pid in ids:  # what starts only when waited for (PowerSGD's batch) starts before anything is waited for
            start = getattr(self.handles[pid], "start", None)
            if start is not None:
                start()
        arrived: list[torch.Tensor] = []
        for pid in ids:
            handle = self.handles.pop(pid, None)
            if handle is not None:
                handle.result(self.worker)
                arrived.append(self.by_id[pid])
                continue
            group = self.groups[pid]
            entry = self.group_handles.pop(group.name, None)
            if entry is None:  # its group is not full (or was waited for already)
                continue
            entry[1].result(self.worker)
            group.scatter()
            for member in group.params:
                self.handles.pop(id(member), None)
            arrived.extend(group.params)
        for p in arrived:
            self.counts.pop(id(p), None)
            if id(p) in self.resparse and p.grad is not None:
                self.resparse.discard(id(p))
                p.grad = p.grad.to_sparse()
        return arrived

    def take(self, params: list[torch.Tensor]) -> list[tuple[TorchHandle, fusion.FusionGroup | None]]:
        """Hand over the push_pulls in flight of `params`, every one pushed and its fusion groups within `params`:
        each handle with the group whose members it carries (None: one parameter's own)."""
        taken: list[tuple[TorchHandle, fusion.FusionGroup | None]] = []
        seen: set[str] = set()
        for p in params:
            pid = id(p)
            handle = self.handles.pop(pid)
            self.counts.pop(pid, None)
            if handle is not None:
                taken.append((handle, None))
                continue
            group = self.groups[pid]
            if group.name in seen:
                continue
            seen.add(group.name)
            entry = self.group_handles.pop(group.name, None)
            if entry is not None:
                taken.append((entry[1], group))
            else:
                raise TensorError(
                    f"worker {self.worker.rank}: fusion group {group.name!r} is not complete",
                    tensor=group.name,
                    rank=self.worker.rank,
                )
        return taken

    def synchronize(self) -> None:
        """Push what is missing, then wait for every sum."""
        if self.excluded:
            return
        self.push_missing()
        self.wait()
        self.handles.clear()
        self.counts.clear()

    def clear(self) -> None:
        """Forget push_pulls cancelled by a membership change (elastic) without waiting for them."""
        self.handles.clear()
        self.group_handles.clear()
        self.counts.clear()
        for group in set(self.groups.values()):
            group.ready.clear()


def current_worker_or_none() -> Worker | None:
    try:
        return current_worker()
    except gradwire.ConfigError:
        return None


class _Ranks:
    """A process set's ranks, in the shape the torch collectives take them."""

    def __init__(self, ranks: list[int] | None) -> None:
        self.ranks = ranks

    def included(self) -> bool:
        return True


class _SparseSum:
    """A sparse gradient's allgathered sum: `result` puts it into the parameter's gradient."""

    def __init__(self, param: torch.Tensor, gather: Callable[[], torch.Tensor], postscale: float) -> None:
        self.param, self.gather, self.postscale = param, gather, postscale

    def result(self, worker: Worker) -> torch.Tensor:
        with use_worker(worker):
            summed = self.gather()
        self.param.grad = summed * self.postscale if self.postscale != 1.0 else summed
        return self.param.grad
