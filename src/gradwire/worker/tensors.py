"""The worker's tensors: each one it declared (`Tensor`), and the versions a re-cut makes of one (`Recut`).

A re-cut gives the tensors already declared new partitions while the job runs (scheduler/adapt.py). Every worker must
make it at the same round of each tensor, or a round would wait for partitions another worker cuts differently. Step 1
(RECUT): the worker reports its round of each tensor and holds calls RECUT_AHEAD rounds past it. Step 2 (RETUNE): the
scheduler says, per tensor, the first round cut anew; the tensor gets a successor (`root~generation`, new keys) that
carries its rounds from then on, and the holds are released.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from gradwire import partition
from gradwire.errors import GradwireError, GradwireTimeout, RemoteProtocolError
from gradwire.protocol import dtypes, messages
from gradwire.worker.handle import Handle


@dataclass
class Tensor:
    """A tensor of the job: its partitions, their keys and servers (once every worker has declared it), and its
    round counter. Calls may start before the declaration completes: they wait in `waiting` and go out with it."""

    name: str
    shape: tuple[int, ...]
    dtype: dtypes.DType
    parts: list[partition.Partition] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    servers: list[int] = field(default_factory=list)
    round: int = 0
    in_flight: Handle | None = field(default=None, repr=False)
    ready: threading.Event = field(default_factory=threading.Event, repr=False)  # declared, or failed
    error: GradwireError | None = None  # why the declaration failed
    waiting: list = field(default_factory=list, repr=False)  # fn(error or None), run once it is ready
    user_name: str = ""
    signature: tuple = ()
    stateful: bool = False  # its servers hold state (parameter-server mode): seeded to a new server after a failover
    # re-cut with another partition size while the job runs (scheduler/adapt.py): from round `successor[0]` on, the
    # tensor's rounds are those of `successor[1]`, declared as `root~generation` (new keys)
    successor: tuple[int, Tensor] | None = field(default=None, repr=False)
    root: str = ""  # the name the calls use (this tensor's, unless it is a re-cut's successor)

    def current(self, next_round: bool = False) -> Tensor:
        """The tensor whose keys carry this one's rounds now (`next_round`: its next round), following re-cuts."""
        tensor = self
        while tensor.successor is not None and (not next_round or tensor.round + 1 >= tensor.successor[0]):
            tensor = tensor.successor[1]
        return tensor

    def chain(self) -> list[Tensor]:
        """This tensor and every re-cut of it, in order."""
        chain = [self]
        while chain[-1].successor is not None:
            chain.append(chain[-1].successor[1])
        return chain

    @property
    def recuttable(self) -> bool:
        """A re-cut may give it new partitions: a plain sum (no slices, process set, or server-side state) whose
        declaration has completed."""
        return self.ready.is_set() and self.error is None and self.signature[2:] == ("sum", None, None, None, None)

    def fits_one(self, partition_bytes: int) -> bool:
        """It is one partition, and would be one at `partition_bytes` too (nothing to re-cut)."""
        return len(self.parts) == 1 and self.dtype.itemsize * int(np.prod(self.shape)) <= partition_bytes


class Recut:
    """The worker's side of re-cuts (the module docstring). Every method is called with `lock` held, the lock that
    guards the worker's tensors; `wait_turn` waits on it."""

    def __init__(self, lock: threading.Lock) -> None:
        self.holds: dict[str, int] = {}  # root name -> the first round held until the RETUNE
        self.generation = 0  # of the re-cut in step 1
        self.released = threading.Condition(lock)
        self.history: list[dict] = []  # each re-cut: generation, tensors, the partition size, when told

    def hold(self, tensors: list[Tensor], generation: int) -> dict[str, int]:
        """Step 1: each re-cuttable tensor's round, reported; calls RECUT_AHEAD rounds past it wait from now on."""
        rounds = {}
        for tensor in tensors:
            current = tensor.current()
            # not one whose last re-cut is still ahead (its successor's round is not the calls' yet)
            if tensor.root == tensor.name and current is tensor.current(next_round=True) and current.recuttable:
                rounds[tensor.name] = current.round
        self.holds = {name: r + messages.RECUT_AHEAD for name, r in rounds.items()}
        self.generation = generation
        return rounds

    def cut(
        self, tensors: dict[str, Tensor], switch: dict, generation: int, partition_bytes: int, who: str
    ) -> list[Tensor]:
        """Step 2: a successor for each tensor in `switch` (name -> its first round cut anew) that partitions of
        `partition_bytes` cut otherwise, added to `tensors` and returned (to be declared); the holds of `generation`
        released. Raises RemoteProtocolError for a round this worker (`who`) has passed (the scheduler broke step
        1)."""
        successors = []
        for name, first in switch.items():
            tensor = tensors.get(name)
            if tensor is None:
                continue
            last = tensor.current()
            if last.successor is not None or last.round >= int(first):
                raise RemoteProtocolError(f"{who}: re-cut of {name!r} at round {first} came too late")
            if last.fits_one(partition_bytes):
                continue  # one partition before and after: nothing to re-cut (the same on every worker)
            new = Tensor(f"{name}~{generation}", last.shape, last.dtype, user_name=last.user_name, root=name)
            new.signature, new.round = last.signature, int(first) - 1
            tensors[new.name] = new
            last.successor = (int(first), new)
            successors.append(new)
        if generation == self.generation:
            self.release()
        if successors:
            record = {"generation": generation, "tensors": len(successors), "partition_bytes": partition_bytes}
            self.history.append(record | {"at": time.time()})  # when told: its new partitions start two rounds later
        return successors

    def release(self) -> None:
        """No call is held any more (the re-cut's RETUNE came, or the job re-formed)."""
        self.holds = {}
        self.released.notify_all()

    def wait_turn(self, tensor: Tensor, timeout: float, who: str) -> Tensor:
        """The tensor whose keys take `tensor`'s next round, once no re-cut holds that round (for at most `timeout`
        seconds; `who` names the worker in the error)."""
        deadline = time.monotonic() + timeout
        while True:
            current = tensor.current(next_round=True)
            hold = self.holds.get(tensor.root)
            if hold is None or current.round + 1 < hold:
                return current
            if not self.released.wait(max(0.0, deadline - time.monotonic())):
                raise GradwireTimeout(
                    f"{who}: the scheduler did not say where {tensor.root!r} is cut anew (re-cut {self.generation}) "
                    f"in {timeout}s",
                    tensor=tensor.root,
                )
