"""Control messages: the JSON bodies of CONTROL frames, one typed message per op.

Each op is a `Message`: a dataclass whose fields and their types are the message's whole vocabulary. `parse` checks a
received body (a known op, every required field, no unknown field, each value of its type: `decode` against the
class) and returns the message; `Message.encode` makes the body to send. Receivers dispatch by the message's type.

Node -> scheduler: register, declare, barrier, bye, ... Scheduler -> node: address_book, reply (to a request id),
abort, shutdown, ... Scheduler -> server: the keys it owns (KEYS), a standby's promotion (PROMOTE), the workers that
joined (JOINED) or left (DEPARTED). Requests carry an `id`; the reply carries the same id and either the result's
fields or `error`.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gradwire.errors import RemoteProtocolError


@dataclass
class Message:
    """A control message; subclasses name their `op` and declare their fields."""

    op: ClassVar[str]
    # fields sent even at their default (the rest are left out of the body then)
    always: ClassVar[tuple[str, ...]] = ()

    def fields(self) -> dict:
        """Its fields as the body has them, without the op (a reply's result may be another message's fields)."""
        return {k: v for k, v in self.encode().items() if k != "op"}

    def encode(self) -> dict:
        """The body to send."""
        body: dict = {"op": self.op}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in self.always or not _is_default(f, value):
                body[f.name] = value
        return body


@dataclass
class Request(Message):
    """A message the sender waits on: the answer is a `Reply` with the same `id` (given as the request is sent)."""

    id: int = -1

    def encode(self) -> dict:
        return super().encode() | {"id": self.id}


def _is_default(f: dataclasses.Field, value: object) -> bool:
    if f.default is not dataclasses.MISSING:
        return value == f.default
    if f.default_factory is not dataclasses.MISSING:
        return value == f.default_factory()
    return False


def decode(cls: type[Message], body: dict) -> Message:
    """The message of `cls` that `body` holds; RemoteProtocolError saying what is wrong with it."""
    op, types = cls.op, _types(cls)
    unknown = sorted(set(body) - types.keys() - {"op"})
    if unknown:
        raise RemoteProtocolError(f"control op {op!r} has unknown field(s) {', '.join(unknown)}")
    missing = [f for f in (*cls.always, *(("id",) if issubclass(cls, Request) else ())) if f not in body]
    if missing:
        raise RemoteProtocolError(f"control op {op!r} lacks {', '.join(missing)}")
    return cls(**{k: typed(op, k, v, types[k]) for k, v in body.items() if k != "op"})


@functools.cache
def _types(cls: type[Message]) -> dict[str, object]:
    """Each field's type, from the class's annotations."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def typed(op: str, name: str, value: object, kind: object) -> object:
    """`value` as the field's type: numbers converted (JSON has one kind), anything else checked."""
    allowed = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, _UnionType) else (kind,)
    if value is None and type(None) in allowed:
        return None
    for t in allowed:
        if t is Any:
            return value
        if t is bool and isinstance(value, bool):
            return value
        if t in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
            if t is int and value != int(value):
                break
            return t(value)
        if t in (str, list, dict) and isinstance(value, t):
            return value
    raise RemoteProtocolError(f"control op {op!r}: field {name} is {value!r}, not {kind}")


_UnionType = type(int | None)


@dataclass
class Keys(Request):
    """The keys a server owns, with dtype and bytes (and how they are summed); it replies once they are ready."""

    op = "keys"
    always = ("keys",)
    keys: list = field(default_factory=list)
    name: str = "?"
    key_op: str = "sum"
    op_args: dict | None = None
    slices: dict | None = None
    replicas: dict | None = None
    addresses: dict | None = None
    members: list | None = None
    kept: bool = False  # keys this server keeps for their own server (a replica), not owns


@dataclass
class Promote(Request):
    """To a standby: you are now server `rank`, in `epoch`."""

    op = "promote"
    always = ("rank", "epoch")
    rank: int = 0
    epoch: int = 0


@dataclass
class Joined(Request):
    """The workers that have joined now (hvd.join; empty once every worker has)."""

    op = "joined"
    always = ("ranks",)
    ranks: list = field(default_factory=list)


@dataclass
class Departed(Message):
    """Workers that left (shutdown()) while others go on: all so far."""

    op = "departed"
    always = ("ranks",)
    ranks: list = field(default_factory=list)


# a re-cut's first round of a tensor: the latest any worker reported plus this; a worker holds calls that far ahead
# until the RETUNE says where the new partitions begin (scheduler/adapt.py)
RECUT_AHEAD = 2
# a worker's heartbeat counters of its network links' use, which the scheduler's drift check reads (scheduler/adapt.py)
LINK_USE = ("link_busy_seconds", "link_bytes", "window_full_seconds")


# -- node -> scheduler ----------------------------------------------------------------------------


@dataclass
class Register(Message):
    """The first message of every node: who it is and where it is reached."""

    op = "register"
    always = ("role", "host", "port", "rank")
    role: str = ""
    host: str = ""
    port: int = 0
    rank: int | None = None  # None: the scheduler assigns one in order of arrival
    slot_bytes: int = 0  # shared-memory slots a server offers (0: none)
    unix: str = ""  # a server's Unix socket
    host_id: str = ""  # which nodes share a host (shared memory)
    admin: int = -1  # the node's admin port
    admin_host: str = ""
    standby: bool = False
    colocated: bool = False
    link_rate: float = 0.0  # GRADWIRE_LINK_RATE, bits/s (0: measure)


@dataclass
class Resume(Message):
    """The first message of a node to a scheduler that started into a running job (a restart, scheduler/recovery.py):
    who it is (`registration`: its REGISTER's fields), the scheduler term and epoch it knows, and what it knows of the
    job (`report`: a worker's tensors, barriers, lost servers and address book; a server's kept and replicated keys)."""

    op = "resume"
    always = ("role", "rank", "term", "epoch")
    role: str = ""
    rank: int = 0
    term: int = 0
    epoch: int = 0
    registration: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)

    @classmethod
    def of(cls, role: str, rank: int, host: str, state: tuple[int, int], registration: dict, report: dict) -> Resume:
        """A node's RESUME: what its REGISTER says (`role`, `rank`, `host`, `registration`), the (term, epoch) it
        knows, and its `report`."""
        register = Register(role=role, rank=rank, host=host, **registration)
        return cls(role, rank, *state, register.fields(), report)


@dataclass
class Declare(Request):
    """Declare a tensor (its signature); the reply places its partitions on servers."""

    op = "declare"
    always = ("name", "shape", "dtype")
    name: str = ""
    shape: list = field(default_factory=list)
    dtype: str = ""
    partition_bytes: int = 0
    key_op: str = "sum"
    op_args: dict | None = None
    slices: list | None = None
    meta: Any = None
    members: list | None = None  # a process set's ranks


@dataclass
class Barrier(Request):
    """`number`: the worker's count of barriers entered, this one included; a barrier the job has passed already
    (its answer lost with a scheduler that died, scheduler/recovery.py) is answered at once. 0: not counted."""

    op = "barrier"
    number: int = 0


@dataclass
class Bye(Message):
    """The node leaves (`final`: for good; else init() may follow); `error`: the script raised."""

    op = "bye"
    final: bool = True
    error: str | None = None


@dataclass
class Heartbeat(Message):
    """Every GRADWIRE_HEARTBEAT_INTERVAL: the node's counters, for /status and the drift check."""

    op = "heartbeat"
    always = ("stats",)
    stats: dict = field(default_factory=dict)


@dataclass
class ServerLost(Message):
    """Worker -> scheduler: my connection to this server died. Server -> scheduler: my replica server (this one)
    acknowledges no forwarded round (server/replica.py)."""

    op = "server_lost"
    always = ("server",)
    server: int = 0
    epoch: int = 0
    error: str = "?"


@dataclass
class Rejoin(Request):
    """Elastic: ready for the new membership; the reply is the address book."""

    op = "rejoin"


@dataclass
class Blocked(Message):
    """I wait (synchronize) for `name`, whose declaration is not complete."""

    op = "blocked"
    always = ("name",)
    name: str = ""


@dataclass
class Join(Request):
    """I am out of data (hvd.join); `rounds`: my round of each tensor."""

    op = "join"
    always = ("rounds",)
    rounds: dict = field(default_factory=dict)


@dataclass
class FailoverReport(Message):
    """Per moved key: [round of the sum I hold, round I resend, whether I hold it]."""

    op = "failover_state"
    always = ("epoch", "keys")
    epoch: int = 0
    keys: dict = field(default_factory=dict)


@dataclass
class RecutRounds(Message):
    """`rounds` {tensor: round}; `fixed`: my partition size is explicit."""

    op = "recut_rounds"
    always = ("number", "rounds")
    number: int = 0  # the re-cut's
    rounds: dict = field(default_factory=dict)
    largest_partition: int = 0
    fixed: bool = False


@dataclass
class ProbeResult(Message):
    """The rate (bytes/s) at which the scheduler's PROBE frames reached me (`down`), or `pong`."""

    op = "probe_result"
    pong: bool = False
    down: float | None = None


# -- scheduler -> node ----------------------------------------------------------------------------


@dataclass
class AddressBook(Message):
    """Where the servers are, and how (scheduler/roster.py `address_book`); also a REJOIN's reply's fields."""

    op = "address_book"
    always = ("rank", "epoch", "num_workers", "servers")
    rank: int = 0
    epoch: int = 0
    num_workers: int = 0
    servers: list = field(default_factory=list)
    standby: bool = False
    workers: list = field(default_factory=list)
    worker_hosts: list = field(default_factory=list)  # each worker's host, as the job groups them (host identity)
    placement: dict | None = None
    tuning: dict | None = None
    wall_time: float = 0.0
    term: int = 1  # the scheduler's term: a node follows no scheduler of an older one (scheduler/recovery.py)
    barriers: int = 0  # the barriers the job has passed: a worker numbers its next one after them


@dataclass
class Resumed(Message):
    """A recovering scheduler has every node's report: its term (higher than any before; nodes refuse an older
    term's scheduler from now on) and the epoch. Nodes then send again what they were waiting on."""

    op = "resumed"
    always = ("term", "epoch")
    term: int = 0
    epoch: int = 0


@dataclass
class Beat(Message):
    """Scheduler -> node, every beat interval of a job with standby schedulers; the node answers with the same beat at
    once. A majority's answers to beats sent in the last half of GRADWIRE_HEARTBEAT_TIMEOUT are the scheduler's lease
    to act for the job (scheduler/lease.py)."""

    op = "beat"
    always = ("seq",)
    seq: int = 0


@dataclass
class Reply(Message):
    """The answer to a request `id`: the result's fields (`result`, sent flat beside the id), or `error`."""

    op = "reply"
    always = ("id",)
    id: int = 0
    result: dict = field(default_factory=dict)

    def encode(self) -> dict:
        if "op" in self.result or "id" in self.result:
            raise ValueError(f"a reply's result may not set op or id: {sorted(self.result)}")
        return {"op": self.op, "id": self.id} | self.result

    @property
    def error(self) -> str | None:
        return self.result.get("error")


@dataclass
class Abort(Message):
    op = "abort"
    always = ("message",)
    message: str = ""
    lost_role: str | None = None  # the node whose loss ended the job
    lost_rank: int | None = None


@dataclass
class Shutdown(Message):
    op = "shutdown"


@dataclass
class Probe(Message):
    """In the rendezvous: send `send` PROBE frames of `bytes`, `report` the rate of the scheduler's, or answer a
    `ping` at once."""

    op = "probe"
    ping: bool = False
    report: bool = False
    send: int = 0
    bytes: int = 0


@dataclass
class Replace(Message):
    """Server `server` is gone: its keys are on `standby`, or the `moved` tensors' keys on other servers."""

    op = "replace"
    always = ("epoch", "server", "moved")
    epoch: int = 0
    server: int = 0
    moved: dict = field(default_factory=dict)
    standby: dict | None = None
    tuning: dict | None = None


@dataclass
class Reseed(Message):
    """Resend the sums I hold of these [key, round] (a round some worker still needs, after a failover). Every worker
    gets one (most with no keys) when the failover of `epoch` is over."""

    op = "seed"
    always = ("epoch", "keys")
    epoch: int = 0
    keys: list = field(default_factory=list)


@dataclass
class Members(Message):
    """Elastic: `joining` workers wait to join (at the next commit)."""

    op = "members"
    always = ("joining",)
    joining: int = 0


@dataclass
class Reset(Message):
    """Elastic (or a new generation): the workers changed. To a worker: cancel and rejoin; to a server (a request):
    start the epoch afresh for `num_workers` (`forget`: drop every key)."""

    op = "reset"
    always = ("epoch",)
    epoch: int = 0
    num_workers: int = 0
    forget: bool = False
    message: str = "?"
    lost_rank: int | None = None
    id: int = -1  # to a server: a request (scheduler/server_requests.py `call`)


@dataclass
class Recut(Message):
    """The partition size changes (re-cut `number`): report your round of each tensor."""

    op = "recut"
    always = ("number",)
    number: int = 0


@dataclass
class Retune(Message):
    """New `tuning`; `switch` {tensor: first round cut anew} for re-cut `recut` (0: none)."""

    op = "retune"
    always = ("tuning",)
    tuning: dict | None = None
    switch: dict = field(default_factory=dict)
    recut: int = 0


MESSAGES: dict[str, type[Message]] = {
    m.op: m
    for m in (
        Register,
        Resume,
        Declare,
        Barrier,
        Bye,
        Heartbeat,
        Beat,
        ServerLost,
        Rejoin,
        Blocked,
        Join,
        FailoverReport,
        RecutRounds,
        ProbeResult,
        AddressBook,
        Resumed,
        Reply,
        Abort,
        Shutdown,
        Probe,
        Replace,
        Reseed,
        Members,
        Reset,
        Recut,
        Retune,
        Keys,
        Promote,
        Joined,
        Departed,
    )
}


def parse(body: dict) -> Message:
    """The message a received body holds; RemoteProtocolError saying what is wrong with it."""
    op = body.get("op")
    cls = MESSAGES.get(op) if isinstance(op, str) else None
    if cls is None:
        raise RemoteProtocolError(f"unknown control op {op!r}")
    if cls is Reply:
        if "id" not in body:
            raise RemoteProtocolError("control op 'reply' lacks id")
        return Reply(typed("reply", "id", body["id"], int), {k: v for k, v in body.items() if k not in ("op", "id")})
    return decode(cls, body)


def address_book(result: dict) -> AddressBook:
    """A reply's result read as an address book (a REJOIN's reply is one)."""
    book = parse(result | {"op": AddressBook.op})
    assert isinstance(book, AddressBook)
    return book


__all__ = ["MESSAGES", "Message", "Request", "address_book", "parse"]
