"""Elastic training with Keras 3 on any backend, in the shape of Horovod's (horovod.tensorflow.keras.elastic):

    state = gw.elastic.KerasState(model, batch=0, epoch=0)

    @gw.elastic.run
    def train(state):
        model.fit(x, y, epochs=EPOCHS - state.epoch, callbacks=[
            gw.elastic.UpdateEpochStateCallback(state),
            gw.elastic.UpdateBatchStateCallback(state),
            gw.elastic.CommitStateCallback(state, batches_per_commit=10),
        ])

The state holds the model's variables and its optimizer's (once built); commits copy their values, restores assign
them back, syncs broadcast rank 0's (gradwire/elastic.py, docs/faults.md).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from gradwire import elastic
from gradwire.elastic import ObjectState, State

from .exchange import broadcast_variables, to_numpy

__all__ = [
    "CommitStateCallback",
    "KerasState",
    "ObjectState",
    "State",
    "TensorFlowKerasState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]


class KerasState(ObjectState):
    """A Keras model, its optimizer (the model's own by default) and picklable attributes."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._values: list[np.ndarray] = []
        super().__init__(**kwargs)

    def _variables(self) -> list:
        variables = list(self.model.variables)
        if self.optimizer is not None and getattr(self.optimizer, "built", False):
            variables += list(self.optimizer.variables)
        return variables

    def save(self) -> None:
        self._values = [np.array(to_numpy(v)) for v in self._variables()]
        super().save()

    def restore(self) -> None:
        variables = self._variables()
        if len(variables) == len(self._values):  # (an optimizer built after the commit keeps its fresh state)
            for variable, value in zip(variables, self._values, strict=True):
                variable.assign(value)
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self._variables(), 0, "elastic.keras")
        super().sync()


TensorFlowKerasState = KerasState  # Horovod's name in horovod.tensorflow.elastic


class CommitStateCallback(keras.callbacks.Callback):
    """Commit the state every `batches_per_commit` batches and at the end of every epoch."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state, self.batches_per_commit = state, batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep `state.batch` at the batch just done (0 at an epoch's end)."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep `state.epoch` at the epochs done (for `fit(epochs=EPOCHS - state.epoch)`)."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1


def run(func: Any) -> Any:
    """Run `func(state, ...)` elastically (gradwire.elastic.run); on TensorFlow also when the membership change reached
    it inside a compiled step."""
    if keras.backend.backend() == "tensorflow":
        from gradwire.tensorflow.bridge import original_error

        return elastic.run(func, membership_error=original_error)
    return elastic.run(func)
