"""Control messages from the scheduler to a server: the keys it owns (KEYS), a standby's promotion (PROMOTE), the
workers that joined (JOINED) or left (DEPARTED). Registered, parsed and re-exported with every other message by
protocol/messages.py (`messages.Keys`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gradwire.protocol.message import Message, Request


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
