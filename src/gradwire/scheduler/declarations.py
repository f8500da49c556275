"""The job's tensors, as the scheduler keeps them (`Declarations`): each tensor's first declaration, its partitions,
keys and servers (`Declaration`), and each worker's declaration waiting for the others' (`Call`). What every worker
must agree on: protocol/signature.py.

The first worker to declare a tensor fixes its shape, dtype and partitioning for the job; its partitions are
placed on servers (placement.py), and each owning server is told its keys (so it allocates their accumulators then,
off the data path) before the declarer gets its answer. Later declarers of the same name wait on that registration
and get the same answer, or an error naming both ranks if they disagree.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gradwire import partition
from gradwire.config import Config
from gradwire.errors import TensorError
from gradwire.placement import Placement
from gradwire.protocol import dtypes, messages, operations
from gradwire.protocol.signature import Signature
from gradwire.scheduler.server_requests import ServerRequests

log = logging.getLogger("gradwire.scheduler")

HOLDABLE_OPS = frozenset({"sum", "min", "max", "product"})


@dataclass
class Declaration:
    """The first declaration of a tensor, against which every other worker's is checked."""

    shape: list[int]
    dtype: str
    rank: int
    servers: list[int]
    partition_bytes: int
    keys: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    key_op: str = "sum"  # what its keys compute (server/ops.py)
    slices: list[list[int]] | None = None  # per rank, the [first element, count] of the result it pulls
    meta: str | None = None  # anything else the workers must agree on (a broadcast's root)
    members: list[int] | None = None  # the ranks that take part (a process set); None: every worker
    op_args: str | None = None  # the operation's declared arguments (canonical JSON: a server-side optimizer's)
    replicas: list[int | None] | None = None  # per key, the server holding a replica of its state (server/replica.py)
    # its workers hold each round's sum in their outputs until every one has it, in place of a copy or a replica
    # (docs/faults.md, "Held keys"; server/receipts.py)
    held: bool = False
    ready: threading.Event = field(default_factory=threading.Event)  # set once every owning server knows its keys
    error: str | None = None

    @property
    def signature(self) -> Signature:
        return Signature(self.key_op, self.dtype, self.shape, self.slices, self.meta, self.members, self.op_args)

    def answer(self) -> dict:
        """What every declarer of it is told."""
        if self.error:
            return {"error": self.error}
        # per key, whether a replica holds its last answered round (then workers keep no copy of it)
        # (a server-side optimizer's keys keep the workers' copies: the parameters they pulled seed a new server where
        # the replica is gone, docs/ps-mode.md)
        replicas = self.replicas if self.key_op != "optimizer" else None
        replicated = [r is not None for r in replicas] if replicas is not None else None
        return {
            "servers": self.servers,
            "partition_bytes": self.partition_bytes,
            "replicated": replicated,
            "held": self.held,
        }

    @property
    def holdable(self) -> bool:
        """Its workers may hold its sums in their outputs for a failover (`held`): a reduction whose every worker
        pulls the whole result, as it is (a compressed key's workers get a decoded block, which is not what a seed
        must carry; a sliced key's hold only their slice; a server-side optimizer's keep the parameters)."""
        return self.key_op in HOLDABLE_OPS and self.slices is None


@dataclass
class Call:
    """One worker's declaration of a tensor, waiting for the others'."""

    rank: int
    signature: Signature
    partition_bytes: int
    answer: Callable[[dict], None]


class Declarations:
    """Every tensor of the job. Thread-safe: declarations arrive on every worker's connection thread.

    `send(server_rank, body)` delivers a control message to a server; the server's reply comes back by `ack`. A server
    that dies is `abandon`ed at once: nothing waits for its replies, nor sends it keys, until a standby takes its place
    (`revive`); its keys are moved by the failover (scheduler/moves.py), also those of a declaration that was being
    registered as it died.
    """

    def __init__(
        self,
        config: Config,
        slot_bytes: Sequence[int],
        send: Callable[[int, messages.Message], None],
        weights: Sequence[float] | None = None,
        num_workers: int = 0,
        address_of: Callable[[int], dict] | None = None,
        local_servers: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        self.config = config
        # the servers on the one host a process set's members share (local aggregation: worker/aggregation.py), its
        # keys' place; [] where its members are on several hosts, or theirs has no colocated server
        self.local_servers = local_servers
        self.address_of = address_of  # how a server reaches another (for replicas); None: no replicas
        self.copied_bytes = 0  # bytes of the tensors whose sums the workers copy for a failover (no replicas)
        self.num_workers = num_workers  # whose slices a declaration may give
        self.slot_bytes = min(slot_bytes)
        self.placement = Placement(len(slot_bytes), weights)
        self.tensors: dict[str, Declaration] = {}
        self.declared_bytes = 0
        self._keys: dict[int, str] = {}
        self.requests = ServerRequests(send, config.timeout)
        self.call, self.ack = self.requests.call, self.requests.ack  # (server_requests.py)
        self.abandon, self.revive = self.requests.abandon, self.requests.revive
        # held by a failover while it moves keys and registers them on their new servers: a declaration's answer is
        # taken either before (the workers then learn the move from the failover) or after (its servers have the keys)
        self.moving = threading.Lock()
        self.lock = threading.Lock()
        self._pending: dict[str, dict[int, Call]] = {}  # declarations waiting for the other workers', by rank
        self._since: dict[str, float] = {}  # when each pending declaration's first call came (time.monotonic)
        self._blocked: dict[str, set[int]] = {}  # pending declarations some worker waits for (synchronize)
        self.joined: set[int] = set()  # workers that have joined (hvd.join): declarations do not wait for them
        self.departed: dict[int, str] = {}  # workers that left the job (shutdown()), and why

    def declare(self, rank: int, body: messages.Declare, answer: Callable[[dict], None]) -> None:
        """A worker's declaration; `answer(reply)` is called (maybe later, from another worker's thread) with
        {servers, partition_bytes} or {error}: with abort=False if only the declarer's request is wrong, mismatch=True
        if the workers disagree (then every one of them gets it, and the name is free again), neither if the job
        cannot go on (a late worker disagrees with a tensor the others already use).

        A new tensor is placed once every worker has declared it, so a disagreement is found before any byte moves.
        """
        name = body.name
        try:
            signature = self._signature(rank, name, body)
        except _Refused as e:
            answer({"error": f"tensor {name!r}: {e}", "abort": False})
            return
        call = Call(rank, signature, body.partition_bytes, answer)
        refusal = self._joined_refusal(name, signature)
        if refusal is not None:  # at once: the joined ranks will not call it, and the others may not under this name
            answer(refusal)
            return
        gone = [r for r in self._ranks(signature) if r in self.departed]
        if gone and name not in self.tensors:  # a worker it needs has left already: it would wait for ever
            answer({"error": f"tensor {name!r} cannot be declared: {self.departed[gone[0]]}", "abort": False})
            return
        with self.lock:
            known = self.tensors.get(name)
            if known is None:
                calls = self._pending.setdefault(name, {})
                self._since.setdefault(name, time.monotonic())
                calls[rank] = call
                if not set(self._expected(calls)) <= set(calls):
                    return  # answered when the last worker (of its process set) declares it
                self._take_pending(name)
        if known is not None:
            self._answer_late(name, known, call)
            return
        self._complete(name, sorted(calls.values(), key=lambda c: c.rank))

    def _signature(self, rank: int, name: str, body: messages.Declare) -> Signature:
        """What worker `rank` declared `name` as, checked on its own; raises _Refused where only it is wrong."""
        shape, dtype, key_op, slices = [int(d) for d in body.shape], body.dtype, body.key_op, body.slices
        meta = None if body.meta is None else str(body.meta)
        members = body.members
        if members is not None:
            members = sorted({int(r) for r in members})
            if not members or members[0] < 0 or members[-1] >= self.num_workers or rank not in members:
                raise _Refused(f"worker {rank} declared it for ranks {members}")
        if dtype not in dtypes.BY_NAME or any(d < 0 for d in shape) or len(shape) > 32 or not operations.known(key_op):
            raise _Refused(f"bad declaration {key_op} of {dtype}{shape}")
        op_args = body.op_args
        if op_args is not None or key_op in operations.BUILT:
            try:
                op_args = operations.encode_args(key_op, op_args)
            except (TensorError, ValueError) as e:
                raise _Refused(str(e)) from None
        if key_op == "compressed" and (dtype != "float32" or slices is not None):
            raise _Refused(f"a compressed sum is of a whole float32 tensor, not {dtype}{shape} with slices {slices}")
        if slices is not None:
            slices = [[int(a), int(b)] for a, b in slices]
            num = int(np.prod(shape, dtype=np.int64))
            if len(slices) != self.num_workers or any(a < 0 or b < 0 or a + b > num for a, b in slices):
                raise _Refused(f"bad slices {slices} of {num} elements")
        return Signature(key_op, dtype, shape, slices, meta, members, op_args)

    def restore(
        self,
        rank: int,
        body: messages.Declare,
        pbytes: int,
        servers: list[int],
        kept: dict[int, int],
        held: bool = False,
    ) -> None:
        """A tensor as worker `rank` reports it to a recovering scheduler (scheduler/recovery.py): placed already, its
        keys on their servers, and on `kept`'s replicas (key -> the server that keeps its answered rounds), or its
        sums `held` in the workers' outputs."""
        try:
            signature = self._signature(rank, body.name, body)
        except _Refused as e:
            log.error("recovery: worker %d reported tensor %r as %s; not recovered", rank, body.name, e)
            return
        key_op, dtype, shape, slices, meta, members, op_args = signature
        sizes, keys, total = _cut(body.name, shape, dtype, pbytes)
        local = members is not None and self.local_servers is not None and bool(self.local_servers(members))
        with self.lock:
            if body.name in self.tensors:
                return
            for key, server, size in zip(keys, servers, sizes, strict=True):
                self._keys[key] = body.name
                (self.placement.local_loads if local else self.placement.loads)[server] += size
            self.declared_bytes += total
            decl = Declaration(shape, dtype, rank, servers, pbytes, keys, sizes, key_op, slices, meta, members, op_args)
            decl.held = held
            if any(k in kept for k in keys):
                decl.replicas = [kept.get(k) for k in keys]
            elif key_op != "optimizer" and not local and not held:
                self.copied_bytes += total
            decl.ready.set()
            self.tensors[body.name] = decl

    def _complete(self, name: str, calls: list[Call]) -> None:
        """Every worker has declared `name`: if they agree, place it, register its keys and answer all; else tell
        every one of them how they differ."""
        first = calls[0]
        differ = [c for c in calls if c.signature != first.signature]
        if differ:
            ways = "; ".join(f"worker {c.rank}: {c.signature}" for c in calls)
            reply = {
                "error": f"tensor {name!r} was declared differently by the workers ({ways}): every worker must call "
                "the same collective with the same shape and dtype",
                "mismatch": True,
            }
            for c in calls:
                c.answer(reply)
            return
        key_op, dtype, shape, slices, meta, members, op_args = first.signature
        refusal = self._joined_refusal(name, first.signature)
        if refusal is not None:
            for c in calls:
                c.answer(refusal)
            return
        with self.lock:
            try:
                among = self.local_servers(members) if members is not None and self.local_servers else []
                decl = self._place(name, shape, dtype, first.rank, min(c.partition_bytes for c in calls), among)
            except TensorError as e:
                decl = None
                error = str(e)
            else:
                decl.key_op, decl.slices, decl.meta, decl.members = key_op, slices, meta, members
                decl.op_args = op_args
                if self._replicated(op_args, among, sum(decl.sizes)):
                    if decl.holdable and self.config.failover_hold:
                        decl.held = True  # past the workers' copies: its sums are held in their outputs instead
                    else:
                        decl.replicas = [self._replica_of(s) for s in decl.servers]
        if decl is None:
            for c in calls:
                c.answer({"error": error, "abort": False})
            return
        self.register_keys(name, decl)
        with self.moving:  # one answer for all, never one taken while a failover moves the tensor's keys
            reply = decl.answer()
        for c in calls:
            c.answer(reply)

    def _answer_late(self, name: str, known: Declaration, call: Call) -> None:
        """A declaration of a tensor the job already has (a worker that joined later, or declares again)."""
        if call.signature != known.signature:
            call.answer(
                {
                    "error": f"tensor {name!r} declared as {call.signature} by worker {call.rank} but as "
                    f"{known.signature} by the job's other workers: every worker must call the same collective "
                    "with the same shape and dtype"
                }
            )
            return
        if not known.ready.wait(self.config.timeout):
            known.error = known.error or f"servers did not confirm the keys of {name!r} in {self.config.timeout}s"
        with self.moving:
            reply = known.answer()
        call.answer(reply)

    def stalled(self, threshold: float, now: float | None = None) -> list[str]:
        """One line per declaration that has waited more than `threshold` seconds for some workers'."""
        now = time.monotonic() if now is None else now
        with self.lock:
            waiting = [(n, c, now - self._since[n]) for n, c in self._pending.items()]
        lines = []
        for name, calls, waited in waiting:
            if waited > threshold:
                missing = [r for r in self._expected(calls) if r not in calls]
                lines.append(
                    f"tensor {name!r} has waited {waited:.1f}s for worker(s) {missing} to call it; "
                    f"called by {sorted(calls)}"
                )
        return lines

    def _ranks(self, signature: Signature) -> list[int] | range:
        """The ranks that call a tensor: its process set's, or every worker."""
        return range(self.num_workers) if signature.members is None else signature.members

    def _expected(self, calls: dict[int, Call]) -> list[int]:
        """The ranks that must declare a pending tensor: its process set's, or every worker; not those that have
        joined (hvd.join: they are out of data, and an allreduce goes on with zeros in their place)."""
        return [r for r in self._ranks(next(iter(calls.values())).signature) if r not in self.joined]

    def _take_pending(self, name: str) -> dict[int, Call]:
        """Take a pending declaration off the books (it completes, or fails); its calls. Under the lock."""
        self._since.pop(name, None)
        self._blocked.pop(name, None)
        return self._pending.pop(name)

    def _joined_refusal(self, name: str, signature: Signature) -> dict | None:
        """The answer to a collective that cannot go on while some of its ranks have joined (all but the whole
        elementwise reductions: allgather, broadcast, alltoall, reducescatter, a server-side optimizer); None if it
        can (the engine stands zeros in for joined ranks in the same reductions)."""
        absent = sorted(self.joined & set(self._ranks(signature)))
        reduction = operations.is_reduction(signature.key_op) and signature.slices is None
        if not absent or reduction:
            return None
        return {
            "error": f"tensor {name!r} ({signature.key_op}): worker(s) {absent} have joined (hvd.join), and only an "
            "allreduce goes on without them (their contributions count as zeros)",
            "mismatch": True,
        }

    def set_joined(self, ranks: set[int]) -> None:
        """The workers that have joined now: declarations that waited only for them complete (an allreduce), or
        fail on every caller (a collective that cannot go on without a rank: allgather, broadcast, ...)."""
        with self.lock:
            self.joined = set(ranks)
            refused = {}
            for name, calls in list(self._pending.items()):
                refusal = self._joined_refusal(name, next(iter(calls.values())).signature)
                if refusal is not None:  # it would wait for a joined rank, under a name the others may never use
                    refused[name] = (self._take_pending(name), refusal)
            ready = [name for name, calls in self._pending.items() if set(self._expected(calls)) <= set(calls)]
            completed = {name: self._take_pending(name) for name in ready}
        for calls, refusal in refused.values():
            for c in calls.values():
                c.answer(refusal)
        for name, calls in completed.items():
            self._complete(name, sorted(calls.values(), key=lambda c: c.rank))

    def blocked(self, name: str, rank: int) -> None:
        """Worker `rank` waits (synchronize) for `name`, whose declaration is not complete."""
        with self.lock:
            if name in self._pending:
                self._blocked.setdefault(name, set()).add(rank)

    def leave(self, rank: int, why: str) -> None:
        """Worker `rank` left the job (shutdown()): fail what waits for it, and what will (a declaration whose
        message reaches the scheduler after the departed worker's own)."""
        with self.lock:
            self.departed[rank] = why
        self.cancel(why, rank=rank)

    def cancel(self, why: str, rank: int | None = None, blocked_only: bool = False) -> None:
        """Fail the declarations still waiting: those waiting for worker `rank`, which will never make them (it
        shut down, or waits in a barrier: then, with `blocked_only`, only those some worker is blocked on), or all
        (the workers changed)."""
        with self.lock:
            dropped = {}
            for name, calls in self._pending.items():
                waits_for_rank = rank is None or (rank not in calls and rank in self._expected(calls))
                if waits_for_rank and (not blocked_only or self._blocked.get(name)):
                    dropped[name] = calls
            for name in dropped:
                self._take_pending(name)
        for name, calls in dropped.items():
            for c in calls.values():
                c.answer({"error": f"tensor {name!r} cannot be declared: {why}", "abort": False})

    def _replicated(self, op_args: str | None, among: list[int], nbytes: int) -> bool:
        """Whether a tensor's keys have a replica on another server, when the job fails servers over: a synchronous
        server-side optimizer's state always; any other tensor's last answered rounds once the workers' copies would
        pass GRADWIRE_FAILOVER_COPY_BYTES (the tensors declared first are copied on the workers, which costs the
        servers nothing). Never a host's own keys (local aggregation's, on its colocated servers): their replica
        would put the host's traffic on the network, and they are small."""
        if self.address_of is None or not self.config.server_failover or among:
            return False
        args = json.loads(op_args) if op_args is not None else {}
        if args.get("algorithm"):  # a server-side optimizer
            return args.get("staleness") == 0
        if self.copied_bytes + nbytes <= self.config.failover_copy_bytes:
            self.copied_bytes += nbytes
            return False
        return True

    def _replica_of(self, server: int) -> int | None:
        """The live server after `server` in rank order (cyclically): where its stateful keys are replicated."""
        live = [s for s in range(len(self.placement.loads)) if s not in self.placement.dead]
        after = [s for s in live if s > server] + [s for s in live if s < server]
        return after[0] if after else None

    def register_keys(self, name: str, decl: Declaration, only: set[int] | None = None) -> None:
        """Tell each owning server (or those in `only`) its keys and wait for every answer (server_requests.py
        carries each request)."""
        requests, address_of = self.requests, self.address_of
        wire = dtypes.BY_NAME[decl.dtype]
        cuts = key_slices(decl.sizes, decl.slices, wire.itemsize) if decl.slices is not None else None
        waits = []
        bodies = []
        replicas = decl.replicas or [None] * len(decl.keys)
        for server in sorted({r for r in replicas if r is not None} if only is None else set()):
            held = [
                [k, wire.code, n] for k, n, r in zip(decl.keys, decl.sizes, replicas, strict=True) if r == server
            ]  # keys whose state this server replicates: declared as any key, fed by their primaries
            bodies.append((server, messages.Keys(keys=held, name=name, key_op=decl.key_op, kept=True)))
        for server in sorted(set(decl.servers) if only is None else only):
            owned = [
                [k, wire.code, n] for k, n, s in zip(decl.keys, decl.sizes, decl.servers, strict=True) if s == server
            ]
            body = messages.Keys(keys=owned, name=name, key_op=decl.key_op)
            pairs = zip(decl.keys, decl.servers, replicas, strict=True)
            targets = {str(k): r for k, s, r in pairs if s == server and r is not None}
            if targets and address_of is not None:
                body.replicas = targets
                body.addresses = {str(r): address_of(r) for r in set(targets.values())}
            bodies.append((server, body))
        for server, body in bodies:
            body.members = decl.members
            if decl.op_args is not None:
                body.op_args = json.loads(decl.op_args)
            if cuts is not None:
                body.slices = {str(k): cuts[decl.keys.index(k)] for k, _, _ in body.keys}
            request = requests.request(server, body)
            if request is not None:
                waits.append((server, *request))
        for server, rid, event in waits:
            if not requests.answered(server, rid, event) and server not in requests.dead:
                decl.error = f"server {server} did not confirm the keys of {name!r} in {requests.timeout}s"
        decl.ready.set()

    def _place(self, name: str, shape: list[int], dtype: str, rank: int, pbytes: int, among: list[int]) -> Declaration:
        itemsize = dtypes.BY_NAME[dtype].itemsize  # our own table, not the peer's word
        if not itemsize <= pbytes <= self.slot_bytes:
            raise TensorError(
                f"tensor {name!r}: partitions of {pbytes} bytes do not fit the servers' {self.slot_bytes}-byte slots"
            )
        sizes, keys, total = _cut(name, shape, dtype, pbytes)
        if self.declared_bytes + total > self.config.max_declared_bytes:
            raise TensorError(
                f"tensor {name!r} of {total} bytes would take the job past GRADWIRE_MAX_DECLARED_BYTES="
                f"{self.config.max_declared_bytes} ({self.declared_bytes} declared so far)"
            )
        for key in keys:
            if key in self._keys:
                raise TensorError(f"key collision between {name!r} and {self._keys[key]!r}; rename one")
        servers = self.placement.assign(sizes, among)
        for key in keys:
            self._keys[key] = name
        self.declared_bytes += total
        decl = self.tensors[name] = Declaration(shape, dtype, rank, servers, pbytes, keys, sizes)
        return decl


def _cut(name: str, shape: list[int], dtype: str, pbytes: int) -> tuple[list[int], list[int], int]:
    """A tensor cut into partitions of `pbytes`: each partition's bytes, each one's key, and the tensor's bytes."""
    itemsize = dtypes.BY_NAME[dtype].itemsize  # our own table, not the peer's word
    num = 1
    for d in shape:
        num *= d
    parts = partition.split(num, itemsize, pbytes)
    return [p.count * itemsize for p in parts], [partition.key_of(name, p.index) for p in parts], num * itemsize


class _Refused(Exception):
    """A declaration wrong on its own (whatever the other workers declare): only its declarer is told."""


def key_slices(sizes: list[int], slices: list[list[int]], itemsize: int) -> list[list[list[int]]]:
    """Per key (partitions of `sizes` bytes, in order), per rank: the [start byte, bytes] of the key that falls in
    the rank's slice [first element, count] of the tensor (empty where they miss)."""
    out, start = [], 0
    for nbytes in sizes:
        end = start + nbytes
        per_rank = []
        for first, count in slices:
            lo, hi = max(start, first * itemsize), min(end, (first + count) * itemsize)
            per_rank.append([lo - start, hi - lo] if hi > lo else [0, 0])
        out.append(per_rank)
        start = end
    return out
