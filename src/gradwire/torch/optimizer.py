"""`DistributedOptimizer`: Horovod's wrapper, pushing each gradient as soon as backward produces it.

A post-accumulate-grad hook on every parameter starts that gradient's push_pull the moment autograd has
accumulated it, so communication overlaps the rest of the backward pass. Priority follows layer order: the
first layers' gradients leave first, since the next forward pass needs them first (and backward produces them
last). `step()` waits for every push_pull, then steps the wrapped optimizer on the averaged gradients.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from gradwire import compression as _servers
from gradwire.errors import TensorError

from .collectives import Average, Sum
from .compression import Compressor, DefaultCompressor, configured
from .gradients import GradientSync

STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(). This can "
    "cause training slowdown. You may want to consider using optimizer.skip_synchronize() context if you use "
    "optimizer.synchronize() in your code."
)  # Horovod's words, so searches for them find the fix


class _DistributedOptimizer:
    """Mixed into the wrapped optimizer's class, as Horovod does, so isinstance checks still hold."""

    def _gradwire_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: str,
        fusion_bytes: int | None,
        predivide: float = 1.0,
        sparse_as_dense: bool = False,
        groups: list[list[torch.Tensor]] | None = None,
        members: list[int] | None = None,
    ) -> None:
        params = [p for group in self.param_groups for p in group["params"]]  # type: ignore[attr-defined]
        by_id = parameter_names(params, named_parameters)
        self._parameter_names = {p: by_id[id(p)] for p in params}  # Horovod's attribute: parameter -> its name
        if op not in (Average, Sum):
            raise ValueError(
                f"op must be gradwire.torch.Average or Sum, got {op!r}: the summation servers compute sums "
                "(Adasum is not supported; docs/horovod.md)"
            )
        if predivide != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        self._sync = GradientSync(
            params,
            by_id,
            compression,
            average=op == Average,
            passes=backward_passes_per_step,
            fusion_bytes=fusion_bytes,
            predivide=predivide,
            sparse_as_dense=sparse_as_dense,
            groups=groups,
            members=members,
        )
        self._synchronized = False
        self._skip = False
        self._feedback: bool | None = None  # residuals to rescale as the lr changes (known once the worker is)
        self._lr: float | None = None

    def _follow_lr(self) -> None:
        """A changed learning rate rescales the residuals of error feedback by old/new (as BytePS does), so that what
        they carry moves the parameters as far as when it was dropped."""
        lr = float(self.param_groups[0].get("lr", 0.0))  # type: ignore[attr-defined]
        if self._lr and lr and lr != self._lr:
            worker = self._sync.worker
            worker.calls.compressing.rescale(self._lr / lr)
        self._lr = lr

    @property
    def _handles(self) -> dict:
        return self._sync.handles

    @property
    def _groups(self) -> dict:
        return self._sync.groups

    def synchronize(self) -> None:
        """Wait for every gradient's push_pull (before clipping, say); then call step() within skip_synchronize()."""
        self._sync.synchronize()
        self._synchronized = True

    def _elastic_clear(self) -> None:
        """Forget push_pulls cancelled by a membership change (elastic.run calls it before the job re-forms)."""
        self._sync.clear()
        self._synchronized = False

    def skip_synchronize(self) -> _SkipSynchronize:
        """A context manager in which step() does not synchronize (it was done by hand)."""
        return _SkipSynchronize(self)

    def step(self, closure: Any = None) -> Any:
        if not self._skip:
            if self._synchronized:  # Horovod warns, then synchronizes again (pushing the averaged gradients)
                warnings.warn(STEP_AFTER_SYNCHRONIZE, stacklevel=2)
            self.synchronize()
        elif not self._synchronized:
            raise TensorError("step() inside skip_synchronize() without a synchronize() call first")
        self._synchronized = False
        if self._feedback is None:
            compressor = configured(self._sync.compression, self._sync.worker.state.config)
            self._feedback = bool(getattr(compressor, "args", {}).get("ef"))
        if self._feedback:
            self._follow_lr()
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._sync.handles:
            raise TensorError(
                f"zero_grad() called with {len(self._sync.handles)} push_pulls pending: call step() or synchronize() "
                "first, or the gradients being summed would be zeroed under the transfer"
            )
        return super().zero_grad(set_to_none)  # type: ignore[misc]


def parameter_names(
    params: list[torch.Tensor], named_parameters: Iterable[tuple[str, torch.Tensor]] | None
) -> dict[int, str]:
    """Each parameter's name, by id: from `named_parameters` (checked: no duplicates, none missing), or by position."""
    if named_parameters is None:
        return {id(p): f"param.{i}" for i, p in enumerate(params)}
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
    return by_id


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
    compression: type[Compressor] = DefaultCompressor,
    backward_passes_per_step: int = 1,
    op: str = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: list[list[torch.Tensor]] | int | None = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    fusion_bytes: int | None = None,
    staleness: int = 0,
    pipesize: int = 1,
    compression_params: dict | None = None,
) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that step() uses gradients averaged (or summed) over all workers.

    Horovod's and BytePS's keywords, with their meaning:
    - `gradient_predivide_factor` f: each gradient is divided by f before the sum and the average multiplied by f
      after (the same average; f trades overflow against underflow in half precision). Average only.
    - `groups` (a list of lists of parameters) or `num_groups` (split the parameters into that many): each group
      travels as one fused message; without them, parameters under 64 KiB are fused into groups of up to
      `fusion_bytes` (default GRADWIRE_FUSION_BYTES, 1 MiB; 0 turns fusion off).
    - `sparse_as_dense`: sparse gradients (embeddings with sparse=True) are made dense and summed; without it a
      sparse gradient raises a TensorError saying so.
    - `process_set`: the gradients are averaged among its ranks only (each set trains its own replica).
      `staleness` (BytePS): only 0, synchronous training.
      `pipesize` (BytePS): accepted; gradwire pipelines every tensor by partitions already.
    - `compression` (Horovod's `Compression.fp16`, or one the servers run) or BytePS's `compression_params` dict:
      docs/compression.md (with it, error feedback follows the learning rate, and BytePS's momentum the optimizer's).
    Arguments are checked before anything else, so a wrong call fails the same way before or after `init()`.
    """
    _check_keywords(backward_passes_per_step, gradient_predivide_factor, staleness, process_set)
    groups = _fusion_groups(optimizer, groups, num_groups)
    if compression_params is not None:
        compression = _byteps_compression(optimizer, compression_params) or compression
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._gradwire_setup(
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        fusion_bytes,
        gradient_predivide_factor,
        sparse_as_dense,
        groups,
        getattr(process_set, "ranks", None),
    )
    return wrapped


def _byteps_compression(optimizer: torch.optim.Optimizer, params: dict) -> Any:
    """BytePS's `compression_params` as a compressor; its momentum takes the optimizer's, which is then set to 0."""
    momentum = next((g["momentum"] for g in optimizer.param_groups if g.get("momentum")), 0.9)
    found = _servers.from_byteps(params, momentum_mu=momentum)
    if found is not None and found.args["momentum"] > 0:
        for group in optimizer.param_groups:
            if "momentum" in group:
                group["momentum"] = 0.0
    return found


def _fusion_groups(optimizer: torch.optim.Optimizer, groups: Any, num_groups: int) -> Any:
    """Horovod's `groups` (lists of parameters fused together) or `num_groups` (that many groups of the parameters
    in order), checked; None: fused by size."""
    if isinstance(groups, int):  # Horovod accepted an int here before num_groups existed
        groups, num_groups = None, groups
    if groups is not None and num_groups:
        raise ValueError("pass groups or num_groups, not both")
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if num_groups:
        if num_groups < 0:
            raise ValueError(f"num_groups must be >= 0, got {num_groups}")
        size = -(-len(params) // num_groups)
        groups = [params[i : i + size] for i in range(0, len(params), size)]
    return groups


def _check_keywords(passes: int, predivide: float, staleness: int, process_set: Any) -> None:
    """Horovod's keywords, as Horovod checks them (ValueError)."""
    if passes < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
    if predivide <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {predivide}")
    if staleness != 0:
        raise ValueError(f"staleness={staleness}: gradwire's DistributedOptimizer is synchronous (staleness=0)")
    if getattr(process_set, "ranks", None) is not None and getattr(process_set, "process_set_id", None) is None:
        raise ValueError(f"{process_set!r} is not registered: call add_process_set first")
