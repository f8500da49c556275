"""BytePS's CrossBarrier: the next forward pass starts before this step's sums are all back.

    optimizer = gw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    optimizer = gw.cross_barrier.CrossBarrier(model, optimizer, num_steps=len(loader) * epochs)

or, as BytePS's examples do, the module in place of the whole API and a plain torch optimizer:

    import gradwire.torch.cross_barrier as bps        # was: import byteps.torch.cross_barrier as bps
    bps.init()
    optimizer = bps.CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), num_steps=steps)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)

Every name of `gradwire.torch` is a name of this module too (init, rank, push_pull, broadcast_parameters, ...; set
by gradwire.torch once it is imported).

`step()` returns at once: it only starts the push_pulls still missing. Each layer's parameters are updated just
before that layer's next forward (a forward pre-hook waits for their sums and applies the wrapped optimizer's update
to them alone), so the first layers compute while the sums of the last layers are still on the wire: the barrier
between one step's communication and the next step's computation is crossed (ByteScheduler, SOSP'19). Since
gradients leave first-layer-first (priority), the first layers' sums tend to be back first.

Any torch optimizer whose state is kept per parameter works (all of torch.optim's, where BytePS's supports SGD, Adam
and RMSprop): an update of a subset of the parameters is the wrapped optimizer's own step on its param_groups cut
down to that subset. `zero_grad()` leaves alone the gradients still being summed (each is zeroed once its update is
applied). At `num_steps` and on `synchronize()`, every update is applied before returning.
"""

from __future__ import annotations

from typing import Any

import torch

from .optimizer import DistributedOptimizer, _DistributedOptimizer


class CrossBarrier:
    """Wraps a DistributedOptimizer of `model`'s parameters (or, as BytePS's, a torch optimizer that it first wraps in
    one with `named_parameters`, `compression` or `compression_params` and `backward_passes_per_step`); behaves as
    that optimizer otherwise."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        named_parameters: Any = None,
        compression: Any = None,
        compression_params: dict | None = None,
        backward_passes_per_step: int = 1,
        num_steps: int = 10**6,
    ) -> None:
        if not isinstance(optimizer, _DistributedOptimizer):
            wrap: dict[str, Any] = {"backward_passes_per_step": backward_passes_per_step}
            if compression is not None:
                wrap["compression"] = compression
            optimizer = DistributedOptimizer(optimizer, named_parameters, compression_params=compression_params, **wrap)
        elif named_parameters is not None or compression is not None or compression_params is not None:
            raise TypeError("CrossBarrier: the optimizer is a DistributedOptimizer already; give its arguments there")
        self._opt = optimizer
        self._model = model
        self._final_step = num_steps
        self._step = 0
        self._pending: set[int] = set()  # parameters (by id) whose update waits for their sums
        self._hooks = [
            module.register_forward_pre_hook(self._before_forward)
            for module in model.modules()
            if any(True for _ in module.parameters(recurse=False))
        ]

    def __getattr__(self, item: str) -> Any:
        return getattr(self._opt, item)

    def step(self, closure: Any = None) -> Any:
        """Start the missing push_pulls and return; updates are applied as the next forward reaches each layer."""
        loss = closure() if closure is not None else None
        self._flush()  # parameters no forward reached since the last step: apply their updates now
        sync = self._opt._sync
        sync.push_missing()
        self._pending = {id(p) for p in sync.params}
        self._step += 1
        if self._step >= self._final_step:
            self.synchronize()
        return loss

    def synchronize(self) -> None:
        """Wait for every sum in flight and apply every pending update."""
        self._flush()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients that are not being summed; the others are zeroed as their updates are applied."""
        for group in self._opt.param_groups:
            for p in group["params"]:
                if id(p) not in self._pending and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()

    def _before_forward(self, module: torch.nn.Module, inputs: Any) -> None:
        waiting = [p for p in module.parameters(recurse=False) if id(p) in self._pending]
        if waiting:
            self._apply(waiting)

    def _flush(self) -> None:
        sync = self._opt._sync
        self._apply([p for p in sync.params if id(p) in self._pending])

    def _apply(self, params: list[torch.Tensor]) -> None:
        """Wait for these parameters' sums (a fused group's members arrive together) and update them alone."""
        arrived = self._opt._sync.wait(params)
        arrived = [p for p in arrived if id(p) in self._pending]
        if not arrived:
            return
        self._pending.difference_update(id(p) for p in arrived)
        self._update(arrived)
        for p in arrived:
            p.grad = None

    def _update(self, params: list[torch.Tensor]) -> None:
        """The wrapped optimizer's step on these parameters only (its param_groups cut down, then restored)."""
        chosen = {id(p) for p in params}
        opt = self._opt
        full = opt.param_groups
        cut = [g | {"params": [p for p in g["params"] if id(p) in chosen]} for g in full]
        opt.param_groups = [g for g in cut if g["params"]]
        try:
            with torch.no_grad():
                super(_DistributedOptimizer, opt).step()  # the torch optimizer's own step, not the synchronizing one
        finally:
            opt.param_groups = full
