"""Elastic training, in the shape of Horovod's `hvd.elastic`: the job goes on when a worker is lost, and new
workers join it, without restarting anyone.

    import gradwire.torch as gw
    gw.init()                                   # launched with: gradwire launch -n 4 --min-workers 2 --max-workers 4
    state = gw.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0)

    @gw.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, EPOCHS):
            for state.batch in range(state.batch, BATCHES):
                step(...)
                if state.batch % 10 == 0:
                    state.commit()              # a copy to roll back to; new workers join here
            state.batch = 0

    train(state)

How it behaves (docs/faults.md):
- A worker dies: every survivor's gradwire call in flight raises MembershipChanged. `run` restores the last commit,
  re-forms the job (`Worker.reset()`: the scheduler fixes the new ranks, servers start afresh), broadcasts rank 0's
  state to everyone (`state.sync()`) and calls `train(state)` again, which resumes from the restored counters.
- A worker joins (the launcher starts a replacement, or you start one with the job's settings): the workers are
  told, and the next `state.commit()` raises WorkersJoining after saving; `run` re-forms the job with the new
  worker, which receives the state by the same broadcast, and everyone goes on from that commit.
- Fewer than GRADWIRE_MIN_WORKERS left: the job aborts with WorkerLost naming the rank, as without elastic mode.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from gradwire import elastic
from gradwire.elastic import State, run

from .broadcast import broadcast_object, broadcast_optimizer_state, broadcast_parameters


class ObjectState(elastic.ObjectState):
    """Picklable attributes (epoch, batch, ...): saved by deep copy, synced by a broadcast from rank 0 (torch's
    broadcast_object: tensors among them travel with them)."""

    def _broadcast(self, values: dict[str, Any]) -> dict[str, Any]:
        return broadcast_object(values, 0, name="elastic.state")


class TorchState(ObjectState):
    """A model, an optimizer, and picklable attributes. Commits copy the model's and optimizer's state (host memory
    equal to both), restores load them back, syncs broadcast rank 0's."""

    def __init__(
        self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any
    ):
        self.model = model
        self.optimizer = optimizer
        self._model_saved: dict[str, torch.Tensor] = {}
        self._optimizer_saved: dict = {}
        super().__init__(**kwargs)

    def save(self) -> None:
        if self.model is not None:
            self._model_saved = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.optimizer is not None:
            self._optimizer_saved = copy.deepcopy(self.optimizer.state_dict())
        super().save()

    def restore(self) -> None:
        if self.model is not None:
            self.model.load_state_dict(self._model_saved)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(self._optimizer_saved))
        super().restore()

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        super().sync()


__all__ = ["ObjectState", "State", "TorchState", "run"]
