"""Delay compensation (DC-ASGD: Zheng et al., ICML 2017), as BytePS's torch ops spell it.

A gradient g computed at parameters w_old and applied at w_now is stale by w_now - w_old. The first-order correction,
with the Hessian approximated by its diagonal lambda * g * g, is

    g + lambda * g * g * (w_now - w_old)      (elementwise)

`delay_compensation_` corrects lists of gradients in place and remembers the parameters for the next call;
`dc_adam_` does that and then Adam's update, in one pass per tensor. Both compute in float32 whatever the tensors'
dtype (float16 tensors are read widened and written back narrowed, as BytePS's tests expect), in the reference
formulas' order of operations, so float32 results are identical to them bit for bit.

The server-side counterpart, which corrects every gradient an asynchronous parameter server applies, is
`ServerOptimizer(..., delay_compensation=lambda)` (docs/ps-mode.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def _lists(params: Sequence, grads: Sequence, prev_params: Sequence) -> None:
    for what, value in (("params", params), ("grads", grads), ("prev_params", prev_params)):
        if not isinstance(value, list | tuple):
            raise TypeError(f"{what} must be a list of tensors, got {type(value).__name__}")
    if not len(params) == len(grads) == len(prev_params):
        raise ValueError(f"{len(params)} params, {len(grads)} grads and {len(prev_params)} prev_params: one of each")


def _wide(t: torch.Tensor) -> torch.Tensor:
    """The tensor in float32 (itself if it is float32: then updates in place are updates of the tensor)."""
    return t if t.dtype == torch.float32 else t.float()


@torch.no_grad()
def delay_compensation_(
    params: list[torch.Tensor], grads: list[torch.Tensor], prev_params: list[torch.Tensor], dc_lambda: float
) -> int:
    """Correct each gradient in place for the parameters' move since `prev_params` (module docstring), then copy the
    parameters into `prev_params` for the next call. `params` are not modified. Returns 0, as BytePS's."""
    _lists(params, grads, prev_params)
    for p, g, prev in zip(params, grads, prev_params, strict=True):
        wide = _wide(g)
        corrected = wide + dc_lambda * wide * wide * (_wide(p) - _wide(prev))
        g.copy_(corrected)
        prev.copy_(p)
    return 0


@torch.no_grad()
def dc_adam_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    prev_params: list[torch.Tensor],
    dc_lambda: float,
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: Sequence[int],
    lr: float,
    eps: float,
    weight_decay: float,
    beta1: float,
    beta2: float,
) -> int:
    """Delay-compensate each gradient (as `delay_compensation_`), then apply Adam with it: the moments in
    `exp_avgs`/`exp_avg_sqs` (float32), the bias correction of step `steps[i]` (counted by the caller), weight decay
    as a decoupled shrink of the parameter. Everything is updated in place: params, grads (the corrected gradient),
    prev_params (the parameters before this update), the moments. Returns 0, as BytePS's."""
    _lists(params, grads, prev_params)
    if not len(params) == len(exp_avgs) == len(exp_avg_sqs) == len(steps):
        raise ValueError("dc_adam_ needs one exp_avg, exp_avg_sq and step per parameter")
    for i, param in enumerate(params):
        p, prev, g = _wide(param).clone(), _wide(prev_params[i]).clone(), _wide(grads[i]).clone()
        prev_params[i].copy_(param)
        g += dc_lambda * g * g * (p - prev)
        exp_avg = exp_avgs[i] * beta1 + (1 - beta1) * g
        exp_avg_sq = exp_avg_sqs[i] * beta2 + (1 - beta2) * g * g
        denom = torch.sqrt(exp_avg_sq) + eps
        step_size = lr * math.sqrt(1 - math.pow(beta2, steps[i])) / (1 - math.pow(beta1, steps[i]))
        if weight_decay != 0.0:
            p -= weight_decay * lr * p
        p -= step_size * exp_avg / denom
        param.copy_(p)
        grads[i].copy_(g)
        exp_avgs[i].copy_(exp_avg)
        exp_avg_sqs[i].copy_(exp_avg_sq)
    return 0
