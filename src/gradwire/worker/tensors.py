"""The worker's tensor table: each tensor it declared (`Tensor`: partitions, keys, servers, round), by name and by
version of a name (`TensorTable`), and the server that owns each key (which a failover changes).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from gradwire import partition
from gradwire.errors import GradwireError
from gradwire.protocol import dtypes
from gradwire.protocol.signature import Signature
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
    signature: Signature | None = None  # what every worker declared it as
    stateful: bool = False  # its servers hold state (parameter-server mode): seeded to a new server after a failover
    # re-cut with another partition size while the job runs (scheduler/adapt.py): from round `successor[0]` on, the
    # tensor's rounds are those of `successor[1]`, declared as `root~n` (n: the re-cut's number; new keys)
    successor: tuple[int, Tensor] | None = field(default=None, repr=False)
    root: str = ""  # the name the calls use (this tensor's, unless it is a re-cut's successor)
    partition_bytes: int = 0  # the partition size it is declared with (0: the worker's; local aggregation's own)
    # per key, whether a replica server keeps its last answered round (then this worker keeps no copy for failover)
    replicated: list[bool] = field(default_factory=list)
    # each round's sums are held in the call's output until every worker has them (no copy: worker/holding.py)
    held: bool = False
    cut_bytes: int = 0  # the partition size the job cut it with (the declaration's answer)

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
        return self.ready.is_set() and self.error is None and self.signature is not None and self.signature.plain_sum

    def fits_one(self, partition_bytes: int) -> bool:
        """It is one partition, and would be one at `partition_bytes` too (nothing to re-cut)."""
        return len(self.parts) == 1 and self.dtype.itemsize * int(np.prod(self.shape)) <= partition_bytes


class TensorTable:
    """The tensors by name (a re-cut's successors too), each user name's versions, each key's server, and the moves
    a failover announced. Every method is called with the worker's lock held (`WorkerState.lock`)."""

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}
        self._versions: dict[str, list[Signature]] = {}  # user name -> its signatures, in order of first use
        self.owner: dict[int, int] = {}  # key -> its server's index
        self._moves: dict[str, list[int]] = {}  # tensor -> a server per partition, as a failover moved them
        self._round_floor: dict[str, int] = {}  # tensors others summed while this worker had joined: their rounds
        self.replicas_lost = False  # a server died: every sum is copied from now on (`unreplicate`)

    def entry(
        self, name: str, shape: tuple[int, ...], dtype: dtypes.DType, signature: Signature
    ) -> tuple[Tensor, bool]:
        """The tensor that `name` with `signature` names, and whether it is new (to be declared). A name used again
        with another signature is another tensor: `name#1`, `name#2`, ... in the order of first use (the same on
        every worker running the same program); a process set's tensor is its own (`@ranks...`)."""
        versions = self._versions.setdefault(name, [])
        if signature not in versions:
            versions.append(signature)
        version = versions.index(signature)
        internal = name if version == 0 else f"{name}#{version}"
        ranks = signature.members
        if ranks is not None:  # a process set's tensor is its own, whatever other sets call theirs
            internal += "@ranks" + "-".join(map(str, ranks))
        tensor = self.tensors.get(internal)
        if tensor is not None:
            return tensor, False
        tensor = self.tensors[internal] = Tensor(
            internal, shape, dtype, user_name=name, signature=signature, root=internal
        )
        tensor.round = self._round_floor.pop(internal, 0)  # rounds others summed while this worker had joined
        return tensor, True

    def placed(
        self,
        tensor: Tensor,
        partition_bytes: int,
        servers: list[int],
        replicated: list[bool] | None = None,
        held: bool = False,
    ) -> None:
        """The declaration completed: cut the tensor as the job does (the scheduler's partition size), and record
        its keys' servers (a failover may have moved it since the scheduler answered), which have a replica (none
        once a server has died: `unreplicate`), and whether its sums are `held` (every worker is told the same, and
        it stays so: docs/faults.md)."""
        num = int(np.prod(tensor.shape, dtype=np.int64))
        tensor.cut_bytes = partition_bytes
        tensor.parts = partition.split(num, tensor.dtype.itemsize, partition_bytes)
        tensor.keys = [partition.key_of(tensor.name, p.index) for p in tensor.parts]
        tensor.servers = list(self._moves.get(tensor.name, servers))
        self.owner.update(zip(tensor.keys, tensor.servers, strict=True))
        tensor.replicated = [bool(r) for r in replicated or []] if not self.replicas_lost else []
        tensor.held = held

    def forget(self, tensor: Tensor) -> None:
        """The declaration failed: forget it, so that the name may be declared again (with the shapes the workers
        agree on)."""
        if self.tensors.get(tensor.name) is tensor:
            del self.tensors[tensor.name]
        versions = self._versions.get(tensor.user_name, [])
        if tensor.signature in versions and versions.index(tensor.signature) == len(versions) - 1:
            versions.pop()

    def unreplicate(self) -> None:
        """A server died: keys moved to their replicas have none now, and the dead server's own replicas are gone.
        From now on this worker keeps a copy of every sum (as with GRADWIRE_FAILOVER_COPIES=worker)."""
        self.replicas_lost = True
        for tensor in self.tensors.values():
            tensor.replicated = []

    def move(self, moved: dict[str, list[int]], dead: int) -> list[int]:
        """Record the tensors' new servers (`moved`: name -> a server per partition); the keys whose server changed,
        or was `dead` (kept by a standby at its index)."""
        owner = dict(self.owner)
        for name, servers in moved.items():
            self._moves[name] = servers
            tensor = self.tensors.get(name)
            if tensor is not None and tensor.keys:  # (one still being declared takes `_moves` then)
                owner.update(zip(tensor.keys, servers, strict=True))
                tensor.servers = servers
        moved_keys = [k for k, s in owner.items() if s == dead or s != self.owner.get(k)]
        self.owner = owner
        return moved_keys

    def rounds(self) -> dict[str, int]:
        return {t.name: t.round for t in self.tensors.values()}

    def skip_to(self, rounds: dict[str, int]) -> None:
        """After hvd.join: the rounds others summed while this worker had joined; its next round is after them."""
        for name, rnd in rounds.items():
            tensor = self.tensors.get(name)
            if tensor is not None:
                tensor.round = max(tensor.round, int(rnd))
            else:
                self._round_floor[name] = max(self._round_floor.get(name, 0), int(rnd))

    def restart(self) -> None:
        """An elastic reset: every tensor's rounds start afresh, on its first cut (a joiner knows no other)."""
        for tensor in self.tensors.values():
            tensor.round, tensor.in_flight = 0, None
            tensor.successor = None
        self._round_floor.clear()

    def stateful_keys(self) -> set[int]:
        """The keys whose servers hold state (parameter-server mode)."""
        return {k for t in self.tensors.values() if t.stateful for k in t.keys}
