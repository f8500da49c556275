"""Elastic training with TensorFlow, in the shape of Horovod's `hvd.elastic` (horovod.tensorflow.elastic):

    state = gw.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)   # or TensorFlowState(variables)

    @gw.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, EPOCHS):
            for state.batch in range(state.batch, BATCHES):
                training_step(...)
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0

A worker lost mid-step fails the step's exchange on every survivor with MembershipChanged; inside `tf.function`
TensorFlow hands it on as an OpError, and `run` finds the gradwire error behind it (tensorflow/bridge.py), restores
the last commit, re-forms the job and syncs rank 0's state (gradwire/elastic.py, docs/faults.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradwire import elastic
from gradwire.elastic import ObjectState, State
from gradwire.keras.elastic import KerasState, TensorFlowKerasState

from .bridge import original_error
from .collectives import broadcast_variables

__all__ = ["KerasState", "ObjectState", "State", "TensorFlowKerasState", "TensorFlowState", "run"]


class TensorFlowState(ObjectState):
    """TensorFlow variables and picklable attributes: commits copy the variables' values (host memory equal to
    them), restores assign them back, syncs broadcast rank 0's."""

    def __init__(self, variables: list | None = None, session: Any = None, **kwargs: Any) -> None:
        self.variables = list(variables or [])
        self._values: list[np.ndarray] = []
        super().__init__(**kwargs)

    def save(self) -> None:
        self._values = [np.array(v.numpy()) for v in self.variables]
        super().save()

    def restore(self) -> None:
        for variable, value in zip(self.variables, self._values, strict=True):
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        if self.variables:
            broadcast_variables(self.variables, root_rank=0)
        super().sync()


def run(func: Any) -> Any:
    """Run `func(state, ...)` elastically (gradwire.elastic.run), also when the membership change reached it inside
    `tf.function`."""
    return elastic.run(func, membership_error=original_error)
