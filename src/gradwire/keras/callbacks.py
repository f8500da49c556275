"""Horovod's Keras callbacks, for Keras 3 on any backend.

- `BroadcastGlobalVariablesCallback(root_rank)`: every worker starts from the root's model and optimizer variables.
  Keras 3 builds the model and its optimizer before `on_train_begin`, so the broadcast happens there, before the first
  step (Horovod's broadcasts after the first batch, since Keras 2 built the optimizer lazily); a model still unbuilt
  then is broadcast after its first batch.
- `MetricAverageCallback()`: the epoch's logs (loss, metrics) averaged over the workers at the end of each epoch.
- `LearningRateScheduleCallback(initial_lr, multiplier, ...)` and `LearningRateWarmupCallback(initial_lr, ...)`:
  Horovod's schedules (Goyal et al.'s gradual warm-up from lr / size to lr). `momentum_correction` is accepted but
  not applied: a Keras 3 optimizer's momentum is a constant of its compiled step, not a variable a callback can change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from gradwire import grouped
from gradwire.session import current_worker

from .exchange import broadcast_variables, to_numpy


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Assign worker `root_rank`'s model and optimizer variables to every worker before training, but
    `local_variables` (and those given to `register_local_var`), which each worker keeps."""

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: list | None = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local: set[int] = {id(v) for v in local_variables or []}

    def register_local_var(self, var: Any) -> None:
        """Leave `var` out of the broadcast (a worker-local variable)."""
        self._local.add(id(var))

    def _broadcast(self) -> None:
        model = self.model
        variables = [v for v in model.variables if id(v) not in self._local]
        if not variables:
            return
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "built", False):
            variables += [v for v in optimizer.variables if id(v) not in self._local]
        broadcast_variables(variables, self.root_rank, "keras.BroadcastGlobalVariablesCallback")
        self.broadcast_done = True

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.broadcast_done:
            self._broadcast()

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's logs over the workers at the end of each epoch (put it before callbacks that read them:
    ReduceLROnPlateau, ModelCheckpoint, TensorBoard)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = np.array([float(logs[k]) for k in keys], np.float64)
        name = "keras.MetricAverageCallback." + ",".join(keys)
        (mean,) = grouped.exchange(current_worker(), [values], name, average=True)
        for key, value in zip(keys, mean.tolist(), strict=True):
            logs[key] = value


def _learning_rate(optimizer: Any) -> float:
    return float(to_numpy(optimizer.learning_rate))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to `initial_lr * multiplier(epoch)` from `start_epoch` to `end_epoch` (exclusive), at
    each epoch's start (`staircase`) or each batch's (epoch fractional). `multiplier`: a function of the epoch, or a
    number m for m ** (epoch - start_epoch)."""

    def __init__(
        self,
        initial_lr: float,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch, self.end_epoch, self.staircase = start_epoch, end_epoch, staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ValueError(
                    f"{type(self).__name__}: the number of steps per epoch is unknown to Keras; pass steps_per_epoch"
                )
            self.steps_per_epoch = steps

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch

    def on_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._set(epoch)
        elif not self.staircase:
            self._set(epoch + batch / self.steps_per_epoch)

    def _set(self, epoch: float) -> None:
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = _learning_rate(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's gradual warm-up: from `initial_lr / size` to `initial_lr` over `warmup_epochs`, batch by batch."""

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        def multiplier(epoch: float) -> float:
            epoch += 1.0 / self.steps_per_epoch
            n = current_worker().size
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, 0, warmup_epochs, False, momentum_correction, steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and current_worker().rank == 0:
            lr = _learning_rate(self.model.optimizer)
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")
