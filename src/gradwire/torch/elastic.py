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
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import gradwire
import torch
from gradwire.errors import MembershipChanged, WorkersJoining

from .broadcast import broadcast_object, broadcast_optimizer_state, broadcast_parameters

F = TypeVar("F", bound=Callable[..., Any])


class State:
    """What `run` needs of a state: save/restore/sync; `commit` = save + a check for joining workers."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions called after every re-forming of the job (e.g. to scale the learning rate by size())."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save a copy to roll back to, then re-form the job if workers are waiting to join."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise WorkersJoining if workers wait to join (Horovod's name for the check)."""
        joining = gradwire.current_worker().joining
        if joining:
            raise WorkersJoining(f"{joining} worker(s) waiting to join")

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Picklable attributes (epoch, batch, ...): saved by deep copy, synced by a broadcast from rank 0."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved: dict[str, Any] = {}
        self.save()

    def save(self) -> None:
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._names}

    def restore(self) -> None:
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self) -> None:
        values = broadcast_object({name: getattr(self, name) for name in self._names}, 0, name="elastic.state")
        for name, value in values.items():
            setattr(self, name, value)
        self.save()


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


def run(func: F) -> F:
    """Run `func(state, ...)` elastically: on MembershipChanged restore the last commit, re-form, sync, call again;
    on WorkersJoining (raised by commit) re-form, sync, call again."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        reset_required = False
        while True:
            if reset_required:
                optimizer = getattr(state, "optimizer", None)
                if hasattr(optimizer, "_elastic_clear"):
                    optimizer._elastic_clear()  # type: ignore[union-attr]
                gradwire.current_worker().reset()
                state.on_reset()
            state.sync()
            try:
                return func(state, *args, **kwargs)
            except MembershipChanged:
                state.restore()
                reset_required = True
            except WorkersJoining:
                reset_required = True

    return wrapper  # type: ignore[return-value]
