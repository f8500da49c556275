"""`DistributedOptimizer`: Horovod's wrapper, pushing each gradient as soon as backward produces it.

A post-accumulate-grad hook on every parameter starts that gradient's push_pull the moment autograd has
accumulated it, so communication overlaps the rest of the backward pass. Priority follows layer order: the
first layers' gradients leave first, since the next forward pass needs them first (and backward produces them
last). `step()` waits for every push_pull, then steps the wrapped optimizer on the averaged gradients.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import gradwire
import torch
from gradwire.errors import TensorError

from . import fusion
from .compression import Compression, Compressor
from .ops import TorchHandle, push_pull_async

Average = "average"
Sum = "sum"


class _DistributedOptimizer:
    """Mixed into the wrapped optimizer's class, as Horovod does, so isinstance checks still hold."""

    def _gradwire_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: str,
        fusion_bytes: int,
    ) -> None:
        self._worker = gradwire.current_worker()
        params = [p for group in self.param_groups for p in group["params"]]  # type: ignore[attr-defined]
        if named_parameters is not None:
            named = list(named_parameters)
            names = [n for n, _ in named]
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ValueError(f"named_parameters has duplicate names: {', '.join(duplicates)}")
            by_id = {id(p): n for n, p in named}
            missing = [i for i, p in enumerate(params) if id(p) not in by_id]
            if missing:
                raise ValueError(
                    f"named_parameters lacks {len(missing)} of the optimizer's parameters (positions {missing[:5]}): "
                    "pass model.named_parameters() of the model whose parameters the optimizer holds"
                )
        else:
            by_id = {id(p): f"param.{i}" for i, p in enumerate(params)}
        if op not in (Average, Sum):
            raise ValueError(f"op must be gradwire.torch.Average or Sum, got {op!r}")
        self._names = by_id
        self._compression = compression
        self._passes = backward_passes_per_step
        self._average = op == Average
        self._handles: dict[int, TorchHandle | None] = {}  # None: in flight inside its fusion group
        self._counts: dict[int, int] = {}
        self._synchronized = False
        self._skip = False
        order = {id(p): i for i, p in enumerate(params)}
        self._priority = {pid: len(params) - i for pid, i in order.items()}  # first layers first
        self._params = [p for p in params if p.requires_grad]
        self._groups = fusion.plan(self._params, by_id, fusion_bytes)
        self._group_handles: dict[str, tuple[fusion.FusionGroup, TorchHandle]] = {}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]

    def _on_grad(self, param: torch.Tensor) -> None:
        pid = id(param)
        count = self._counts.get(pid, 0) + 1
        if pid in self._handles:
            raise TensorError(
                f"gradient of {self._names[pid]!r} was computed more times than backward_passes_per_step="
                f"{self._passes} before step(): call step() (or synchronize()) after every "
                f"{self._passes} backward passes, or raise backward_passes_per_step"
            )
        self._counts[pid] = count
        if count == self._passes:
            self._push(param)

    def _push(self, param: torch.Tensor) -> None:
        pid = id(param)
        grad = param.grad
        assert grad is not None
        if self._passes > 1:
            grad.div_(self._passes)
        group = self._groups.get(pid)
        if group is not None:
            self._handles[pid] = None
            if group.add(param, grad):
                priority = max(self._priority[id(p)] for p in group.params)
                handle = push_pull_async(
                    group.buffer,
                    average=self._average,
                    name=f"grad.{group.name}",
                    priority=priority,
                    compression=self._compression,
                    worker=self._worker,
                )
                self._group_handles[group.name] = (group, handle)
            return
        self._handles[pid] = push_pull_async(
            grad,
            average=self._average,
            name=f"grad.{self._names[pid]}",
            priority=self._priority[pid],
            compression=self._compression,
            worker=self._worker,
        )

    def synchronize(self) -> None:
        """Wait for every gradient's push_pull (before clipping, say); then call step() within skip_synchronize()."""
        for p in self._params:
            if id(p) not in self._handles:
                # no gradient on this rank this step (or fewer passes than expected): it still takes part in
                # the sum, as zeros if need be, or every other rank would wait for it
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._push(p)
        for handle in self._handles.values():
            if handle is not None:
                handle.result(self._worker)
        for group, handle in self._group_handles.values():
            handle.result(self._worker)
            group.scatter()
        self._handles.clear()
        self._group_handles.clear()
        self._counts.clear()
        self._synchronized = True

    def _elastic_clear(self) -> None:
        """Forget push_pulls cancelled by a membership change (elastic.run calls it before the job re-forms)."""
        self._handles.clear()
        self._group_handles.clear()
        self._counts.clear()
        for group in set(self._groups.values()):
            group.ready.clear()
        self._synchronized = False

    def skip_synchronize(self) -> _SkipSynchronize:
        """A context manager in which step() does not synchronize (it was done by hand)."""
        return _SkipSynchronize(self)

    def step(self, closure: Any = None) -> Any:
        if not self._skip:
            self.synchronize()
        elif not self._synchronized:
            raise TensorError("step() inside skip_synchronize() without a synchronize() call first")
        self._synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise TensorError(
                f"zero_grad() called with {len(self._handles)} push_pulls pending: call step() or synchronize() "
                "first, or the gradients being summed would be zeroed under the transfer"
            )
        return super().zero_grad(set_to_none)  # type: ignore[misc]


class _SkipSynchronize:
    def __init__(self, optimizer: _DistributedOptimizer) -> None:
        self.optimizer = optimizer

    def __enter__(self) -> None:
        self.optimizer._skip = True

    def __exit__(self, *exc: object) -> None:
        self.optimizer._skip = False


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: str = Average,
    fusion_bytes: int | None = None,
) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that step() uses gradients averaged (or summed) over all workers.

    Parameters under 64 KiB are fused into groups of up to `fusion_bytes` (default GRADWIRE_FUSION_BYTES, 1 MiB;
    0 turns fusion off) that travel as one message.
    """
    if fusion_bytes is None:
        fusion_bytes = gradwire.current_worker().config.fusion_bytes
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._gradwire_setup(named_parameters, compression, backward_passes_per_step, op, fusion_bytes)
    return wrapped
