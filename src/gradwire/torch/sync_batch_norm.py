"""Horovod's SyncBatchNorm: batch normalization whose statistics are those of the whole batch across workers.

In training mode each forward pass sums, over every worker, the per-channel count and sum of its batch, then the sum
of squared deviations from the global mean (two passes: steadier than E[x^2] - E[x]^2 in float32). The sums are
differentiable allreduces (their gradient is the allreduce of the gradients), so autograd gives the exact gradient
of the global normalization, with no hand-written backward. In eval mode it is a plain BatchNorm with the running
statistics, which every worker keeps identical (they are updated from the same global statistics).
"""

from __future__ import annotations

from typing import Any

from torch.nn.modules.batchnorm import _BatchNorm

import torch

from .collectives import Sum, allreduce


class SyncBatchNorm(_BatchNorm):
    """Drop-in for torch.nn.BatchNorm1d/2d/3d (and Horovod's `hvd.SyncBatchNorm`): inputs of shape (N, C, ...)."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return super().forward(input)
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        count = torch.tensor([input.numel() / input.shape[1]], dtype=input.dtype)
        sums = allreduce(torch.cat([count, input.sum(dims)]), op=Sum, process_set=self.process_set)
        total, mean = sums[0], sums[1:] / sums[0]
        centered = input - mean.view(shape)
        squares = allreduce(centered.pow(2).sum(dims), op=Sum, process_set=self.process_set)
        var = squares / total
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                unbiased = var * (total / (total - 1)) if total > 1 else var
                self.running_mean.mul_(1 - factor).add_(mean.detach() * factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach() * factor)
        return out
