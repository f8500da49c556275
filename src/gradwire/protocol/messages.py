"""Control messages: JSON bodies of CONTROL frames, keyed by "op".

Node -> scheduler: register, declare, barrier, bye. Scheduler -> node: address_book, reply (to a
request id), abort, shutdown. Requests carry an "id"; the reply carries the same id and either the
result fields or "error".
"""

from __future__ import annotations

from gradwire.errors import RemoteProtocolError

REGISTER = "register"
ADDRESS_BOOK = "address_book"
DECLARE = "declare"
BARRIER = "barrier"
BYE = "bye"
REPLY = "reply"
ABORT = "abort"
SHUTDOWN = "shutdown"
HEARTBEAT = "heartbeat"  # node -> scheduler, every GRADWIRE_HEARTBEAT_INTERVAL: {stats} for /status
KEYS = "keys"  # scheduler -> server: the keys it owns, with dtype and bytes; the server replies when ready
SERVER_LOST = "server_lost"  # worker -> scheduler: my connection to this server died
PROMOTE = "promote"  # scheduler -> standby server: you are now server `rank`, in `epoch`
REPLACE = "replace"  # scheduler -> worker: server `server` is gone; its keys are on `standby` or `moved` tensors
RESET = "reset"  # elastic: scheduler -> worker: the workers changed, cancel and rejoin; -> server: start epoch afresh
REJOIN = "rejoin"  # elastic: worker -> scheduler (a request): ready for the new membership; the reply is the book
PROBE = "probe"  # scheduler -> node in rendezvous: send `send` PROBE frames of `bytes`, `report` the rate of ours,
# or answer a `ping` at once
PROBE_RESULT = "probe_result"  # node -> scheduler: the rate (bytes/s) at which our PROBE frames reached it (`down`),
# or `pong`
FAILOVER_STATE = "failover_state"  # worker -> scheduler: per moved key, [round of its saved sum, round it resends]
SEED = "seed"  # scheduler -> worker: resend the saved sums of these [key, round] (a round some worker still needs)
MEMBERS = "members"  # elastic: scheduler -> worker: `joining` workers wait to join (at the next commit)
BLOCKED = "blocked"  # worker -> scheduler: I wait (synchronize) for `name`, whose declaration is not complete
JOIN = "join"  # worker -> scheduler (a request): I am out of data (hvd.join); `rounds`: my round of each tensor
JOINED = "joined"  # scheduler -> server: the workers that have joined now (`ranks`; empty once every worker has)
RECUT = "recut"  # scheduler -> worker: the partition size changes (`generation`): report your round of each tensor
RECUT_ROUNDS = "recut_rounds"  # worker -> scheduler: `rounds` {tensor: round}; `fixed`: my partition size is explicit
# a re-cut's first round of a tensor: the latest any worker reported plus this; a worker holds calls that far ahead
# until the RETUNE says where the new partitions begin (scheduler/adapt.py)
RECUT_AHEAD = 2
# a worker's heartbeat counters of its network links' use, which the scheduler's drift check reads (scheduler/adapt.py)
LINK_USE = ("link_busy_seconds", "link_bytes", "window_full_seconds")
RETUNE = "retune"  # scheduler -> worker: new `tuning`; `switch` {tensor: first round cut anew} for `generation`
DEPARTED = "departed"  # scheduler -> server: workers that left (shutdown()) while others go on (`ranks`, all so far)

_REQUIRED = {
    REGISTER: ("role", "host", "port"),
    ADDRESS_BOOK: ("rank", "epoch", "num_workers", "servers"),
    DECLARE: ("id", "name", "shape", "dtype"),
    BARRIER: ("id",),
    BYE: (),
    REPLY: ("id",),
    ABORT: ("message",),
    SHUTDOWN: (),
    KEYS: ("id", "keys"),
    HEARTBEAT: ("stats",),
    SERVER_LOST: ("server",),
    PROMOTE: ("rank", "epoch"),
    REPLACE: ("epoch", "server", "moved"),
    RESET: ("epoch",),
    REJOIN: ("id",),
    MEMBERS: ("joining",),
    BLOCKED: ("name",),
    JOIN: ("id", "rounds"),
    JOINED: ("id", "ranks"),
    FAILOVER_STATE: ("epoch", "keys"),
    SEED: ("epoch", "keys"),
    RECUT: ("generation",),
    RECUT_ROUNDS: ("generation", "rounds"),
    RETUNE: ("tuning",),
    DEPARTED: ("ranks",),
    PROBE: (),
    PROBE_RESULT: (),  # `down` or `pong`: checked where it is read (probe.py)
}


def check(body: dict) -> str:
    """Validate a control body's op and required fields; return the op."""
    op = body.get("op")
    if op not in _REQUIRED:
        raise RemoteProtocolError(f"unknown control op {op!r}")
    missing = [f for f in _REQUIRED[op] if f not in body]
    if missing:
        raise RemoteProtocolError(f"control op {op!r} lacks {', '.join(missing)}")
    return op
