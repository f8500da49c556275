"""Elastic training for every framework, in the shape of Horovod's `hvd.elastic`: the state a job rolls back to and
syncs, and `run`, which re-forms the job when a worker is lost or joins. The frameworks' states (gradwire.torch.elastic,
gradwire.tensorflow.elastic, gradwire.keras.elastic) add their models and optimizers; docs/faults.md says how it
behaves.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from gradwire.errors import MembershipChanged, WorkersJoining
from gradwire.objects import broadcast_object
from gradwire.session import current_worker

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
        joining = current_worker().joining
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
        values = self._broadcast({name: getattr(self, name) for name in self._names})
        for name, value in values.items():
            setattr(self, name, value)
        self.save()

    def _broadcast(self, values: dict[str, Any]) -> dict[str, Any]:
        """Rank 0's `values` on every worker (a framework's state may send them its own way)."""
        return broadcast_object(values, 0, name="elastic.state")


def run(func: F, membership_error: Callable[[BaseException], BaseException | None] | None = None) -> F:
    """Run `func(state, ...)` elastically: on MembershipChanged restore the last commit, re-form, sync, call again;
    on WorkersJoining (raised by commit) re-form, sync, call again. `membership_error` finds either inside a
    framework's own exception (TensorFlow wraps what a step's host call raised)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        reset_required = False
        while True:
            if reset_required:
                optimizer = getattr(state, "optimizer", None)
                if hasattr(optimizer, "_elastic_clear"):
                    optimizer._elastic_clear()  # type: ignore[union-attr]
                current_worker().reset()
                state.on_reset()
            state.sync()
            try:
                return func(state, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - sorted below; anything else is raised as it was
                error = membership_error(e) if membership_error is not None else e
                if isinstance(error, MembershipChanged):
                    state.restore()
                    reset_required = True
                elif isinstance(error, WorkersJoining):
                    reset_required = True
                else:
                    raise

    return wrapper  # type: ignore[return-value]
