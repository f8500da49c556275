"""A key's rounds on a server, their buffers' life, and what a per-key operation does with them.

`Round`: one of a key's two rounds (double buffering: server/engine.py): the round number it holds, whose contributions
are in (rank order, staging, seeds: server/engine.py says why), and its accumulator with its result. `KeyState`: one
key's two rounds and who contributes to them; its buffers' life (`Lending`, which it inherits): lent by the engine's
pool while a round needs them, given back once its replies are sent, and a replica's one buffer for both rounds.
`KeyOp`: the interface of a per-key operation (the engine's one extension point; server/ops.py and
server/optimizer_op.py implement it). `Outbox`: what an operation may send, and nothing else of the engine's: the
engine hands it to the operation, which hands its replies on through it to the server's repliers (server/outgoing.py),
so the way runs one direction, engine -> operation -> outbox -> repliers, with no call back into the engine.

Why lend: a server held two round buffers per key, and a replica two per key it keeps; on a 1.2 GB tensor that was 5-6
copies of each server's share, and each of the first two calls paid for fresh pages. Lent, a server holds buffers for
the rounds in flight, and writes pages the pool has written before (server/staging.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

from gradwire.errors import TensorError
from gradwire.protocol import dtypes
from gradwire.protocol.frames import AVERAGED
from gradwire.server.sums import NUMPY, Sums
from gradwire.transport.shm import NO_SLOT

if TYPE_CHECKING:
    from gradwire.server.receipts import Receipts
    from gradwire.server.slot import Slot
    from gradwire.server.staging import BufferPool


class Round:
    """One of a key's two rounds (double buffering: server/engine.py): the round it holds, whose contributions are
    in, where each rank's answer goes, and the accumulator with its result (lent while needed: KeyState.lend)."""

    __slots__ = (
        "acc",
        "averaged",
        "count",
        "filled",
        "held",
        "index",
        "lends",
        "lengths",
        "number",
        "out",
        "pulls",
        "pushed",
        "result",
        "seeded",
        "stage",
        "staged",
        "started",
        "turn",
        "virtual",
    )

    def __init__(
        self, index: int, n: int, dtype: dtypes.DType, num_workers: int, first: int, wire: int = -1, lent: bool = False
    ) -> None:
        self.index = index  # 0 or 1: the round numbers it holds are this, modulo 2
        self.number = -1  # the round it holds
        self.count = 0  # contributions in
        self.pushed = 0  # bitmask of ranks that pushed it
        self.turn = first  # deterministic mode: the rank whose contribution is added next
        self.staged = 0  # bitmask of ranks whose early contributions wait in `stage`
        self.stage: list[np.ndarray | None] = [None] * num_workers  # their staging buffers, lent (server/staging.py)
        self.lengths = [0] * num_workers  # elements of each staged contribution (a gather's vary)
        self.seeded = False  # its sum came as a seed (a failover), not from contributions
        self.averaged = False  # that seed's sum was averaged already (a held key's: frames.AVERAGED)
        self.held = False  # its pushers hold its sum in their outputs until every one has it (server/receipts.py)
        self.virtual = 0  # ranks not answered: joined ones' zeros stood in, or they replayed (REPLAY)
        self.filled = 0  # a gather's elements in
        self.started = 0.0  # when it got its first contribution (the engine's clock)
        self.pulls = [NO_SLOT] * num_workers  # each worker's shared-memory pull slot
        self.lends = 0  # calls of KeyState.lend: a result's release once sent goes only if none came since
        if lent:  # lent by the engine's pool while the round needs it (KeyState.lend)
            self.acc = self.out = self.result = None  # type: ignore[assignment]
            return
        self.acc = np.empty(n, dtype.accumulate)
        # the result as it travels: narrowed (float16, bfloat16), or encoded (`wire` elements: a compressed key's)
        narrow = dtype.accumulate != dtype.wire or 0 <= wire != n
        self.out = np.empty(n if wire < 0 else wire, dtype.wire) if narrow else self.acc
        self.result: memoryview | list[memoryview] = memoryview(self.out).cast("B")  # KeyState makes it per rank

    def buffers_of(self, other: Round | None, acc: np.ndarray, slices: list[tuple[int, int]] | None) -> None:
        """Use `other`'s accumulator and result (a replica's two rounds share one: KeyState.keep), or, with None,
        `acc` as both (a buffer of its own, or lent: never a narrowed or encoded key's)."""
        if other is not None:
            self.acc, self.out, self.result = other.acc, other.out, other.result
            return
        whole = memoryview(acc).cast("B")
        self.result = whole if slices is None else [whole[a : a + b] for a, b in slices]
        self.acc = self.out = acc  # last: a reader that sees it sees its result too (KeyState.lend)

    def begin(self, number: int, first: int) -> None:
        """Take round `number` (the previous one here complete)."""
        self.number, self.count, self.pushed = number, 0, 0
        self.turn, self.staged, self.seeded, self.held = first, 0, False, False

    def seed(self, number: int, need: int, everyone: int, past: int) -> None:
        """Round `number` is complete with a seed's sum (`past`: a turn past every rank)."""
        self.number, self.count, self.pushed = number, need, everyone
        self.turn, self.staged, self.seeded, self.averaged = past, 0, True, False

    def fail(self, first: int) -> None:
        """Forget the contributions in (the round can never complete): it starts again with the next push."""
        self.count, self.pushed, self.staged, self.turn = 0, 0, 0, first

    def missing(self, members: list[int]) -> list[int]:
        """The members that have not pushed it."""
        return [r for r in members if not self.pushed >> r & 1]


class _Op(Protocol):
    intercepts: bool  # KeyOp's (below): it handles pushes itself, a replica applies every update


class Lending:
    """The buffer life cycle of a key (KeyState's state, declared here for the reader)."""

    __slots__ = ()
    dtype: dtypes.DType
    length: int
    slices: list[tuple[int, int]] | None
    first: int
    op: _Op
    held: object
    kept: bool
    lent: bool
    shared: bool
    kept_round: int
    pool: BufferPool | None
    rounds: tuple[Round, Round]

    def unfinished(self, r: Round) -> bool:
        raise NotImplementedError

    def keep(self, kept: bool) -> None:
        """This server keeps the key only as its replica (`kept`), or owns it (declared by its owner, or promoted by a
        failover). A replica keeps one round, the last its server answered, so its two rounds share one buffer: a
        forward of round r+1 comes only once every worker has pushed r+1, hence has round r, and nobody asks for r
        again (a forward cut off mid-frame leaves r+1 unanswered: the workers push it again to whoever owns the key
        next). Not a key whose operation keeps state of its own (a server-side optimizer's parameters), which applies
        every forwarded update. Called from the control thread, when the key is declared (before any traffic) or
        promoted: an owner's rounds get their own buffers again on the engine's thread (`own`)."""
        if kept and not self.kept and not self.op.intercepts and self.held is None:
            if self.lent:  # a replica's buffer is its own: it holds the key's last round for as long as it is kept
                self.rounds[0].buffers_of(None, self._buffer(), self.slices)
                self.lent = False
            self.rounds[1].buffers_of(self.rounds[0], self.rounds[0].acc, None)
            self.shared = True
        self.kept = kept

    def _buffer(self) -> np.ndarray:
        return np.empty(self.length // self.dtype.itemsize, self.dtype.accumulate)

    def lend(self, r: Round, pool: BufferPool) -> np.ndarray:
        """Round `r`'s accumulator (its result too), lent by `pool` if it has none (KeyOp.lendable, LEND_BYTES). A
        round holds its buffer from its first contribution added until every reply of its result has been sent
        (`release_when_sent`), or, where that is not known (a seeded round, a reply that was never sent), until the
        key's next round completes (`give_back`). So a server holds buffers for the rounds in flight, not one or two
        per key, and a round is written into pages the pool has written before rather than fresh ones (fresh ones cost a
        1.2 GB tensor's first two calls seconds of page faults for each server's round buffers). From the
        engine's thread and from a reader (the first rank's contribution received into it: Engine.landing)."""
        with pool.lock:
            r.lends += 1
            acc = r.acc
            if acc is None:
                acc = pool.take_locked(self.dtype.accumulate, self.length // self.dtype.itemsize)
                r.buffers_of(None, acc, self.slices)
        return acc

    def release_when_sent(self, r: Round) -> Callable[[], None] | None:
        """What the repliers call once every reply of round `r`'s result is sent (SendResult's `sent`): its lent buffer
        goes back to the pool. None for a round that keeps its result (not lent, or seeded: a worker the dead server
        never answered may still push it and be answered from here). Every worker that pushed the round had its
        reply; a replica had it before them (server/replica.py); so nothing needs the buffer once they are sent.
        Not if it was lent again meanwhile (`lends`: a reply thread that was slow to call back)."""
        pool = self.pool
        if not self.lent or r.seeded or pool is None:
            return None
        acc, lends = r.acc, r.lends

        def release() -> None:
            with pool.lock:
                if r.acc is acc and r.lends == lends:
                    r.acc = r.out = r.result = None  # type: ignore[assignment]
                    pool.give_locked(acc)

        return release

    def give_back(self, done: Round, pool: BufferPool) -> None:
        """Round `done` completed: the other round's lent buffer, if it still has one (its replies' `release` never
        came), goes back to the pool. Every worker pushed `done` after it had the other round's result, so no reply of
        it is still being sent, and no failover can ask for it (its forward to a replica was acknowledged before any
        worker had it)."""
        other = self.rounds[1 - done.index]
        with pool.lock:
            acc = other.acc
            if acc is None or other.number >= done.number or self.unfinished(other):
                return
            other.acc = other.out = other.result = None  # type: ignore[assignment]
            pool.give_locked(acc)

    def own(self) -> None:
        """An owned key whose rounds share a buffer (it was a replica): the round last received into it keeps it; the
        other gets a buffer of its own and holds no round (its bytes were overwritten by the later one). On the
        engine's thread, before it touches either round."""
        latest = self.rounds[self.kept_round & 1] if self.kept_round >= 0 else self.rounds[0]
        other = self.rounds[1 - latest.index]
        if latest.out is latest.acc:
            other.buffers_of(None, np.empty_like(latest.acc), self.slices)
        else:  # narrowed or encoded: an accumulator and a result of its own
            other.acc, other.out = np.empty_like(latest.acc), np.empty_like(latest.out)
            whole = memoryview(other.out).cast("B")
            other.result = whole if self.slices is None else [whole[a : a + b] for a, b in self.slices]
        other.begin(-1, self.first)
        self.shared = False


# Keys of at least this many bytes have their buffers lent by the engine's pool (KeyState.lend). Below it a key's
# own buffers cost little memory, and the pool's bookkeeping would cost more than the round's work is worth (measured
# at 16 KiB, 2 workers: 7.5 us of the engine's per round with buffers of its own, 11-15 us lent).
LEND_BYTES = 1 << 20

# what the engine sends through (the server's repliers): the callables it is given


class SendResult(Protocol):
    """reply(key, round, dtype code, payload, pull slot per rank, bitmask of ranks, sent, flags): queue the result for
    them; the payload is one view for all, or a list with each rank's view (a key declared with slices); `sent` (or
    None): called once every one of those replies has been handed to the kernel (or its worker's shared slot);
    `flags`: the RESULT frames' (frames.AVERAGED)."""

    def __call__(
        self,
        key: int,
        rnd: int,
        code: int,
        payload: memoryview | list[memoryview],
        pulls: list[int],
        ranks: int,
        sent: Callable[[], None] | None = None,
        flags: int = 0,
    ) -> None: ...


# fail(slot, message) -> None: send an ERROR for the slot's key to its sender
Fail = Callable[["Slot", str], None]
# ack(rank, key, round) -> None: tell one worker its contribution is in
Ack = Callable[[int, int, int], None]
# fail_rank(rank, key, message) -> None: send an ERROR for the key to that worker (a round that cannot complete)
FailRank = Callable[[int, int, str], None]
# forward(replica server, key, round, dtype code, payload parts, done) -> None: replicate an applied update; done()
# once the replica has it
Forward = Callable[[int, int, int, int, list, Callable[[], None]], None]


class Batching(Protocol):
    """Replies held over one batch of the engine's ring (server/replier.py `HeldReplies`)."""

    def begin(self) -> None:
        """The calling thread, the engine's, holds the replies it makes from now on, until each `flush`."""

    def flush(self) -> None:
        """The batch is done: send what is held."""


class Outbox:
    """What a per-key operation may send: a round's result, one push's answer, an acknowledgement, a payload of its
    own, an update forwarded to the key's replica (`forward`; None: no replicas). Each goes on to the server's
    repliers (the callables it is built with: server/outgoing.py's); a held round's answer first tells `receipts`
    whom to wait for."""

    def __init__(
        self,
        reply: SendResult,
        ack: Ack,
        num_workers: int,
        forward: Forward | None = None,
        receipts: Receipts | None = None,
    ) -> None:
        self._reply = reply
        self._ack = ack
        self.num_workers = num_workers  # the engine's, kept current across an elastic reset
        self.forward = forward
        self.receipts = receipts

    def answer_round(self, key: int, code: int, r: Round, ranks: int, sent: Callable[[], None] | None = None) -> None:
        """Send the result of round `r` to `ranks`: all of it, or each rank its slice (`sent`: SendResult's). A held
        round's receipts are waited for from them (server/receipts.py)."""
        if r.held and self.receipts is not None:
            self.receipts.expect(key, r.number, ranks)
        self._reply(key, r.number, code, r.result, r.pulls, ranks, sent, AVERAGED if r.seeded and r.averaged else 0)

    def answer_one(self, slot: Slot, payload: memoryview) -> None:
        """Answer one push alone (a key's operation handled it outside the rounds)."""
        self.answer_rank(slot.key, slot.round, slot.dtype, payload, slot.pull, slot.sender)

    def answer_rank(self, key: int, rnd: int, code: int, payload: memoryview, pull: int, rank: int) -> None:
        pulls = [NO_SLOT] * self.num_workers
        pulls[rank] = pull
        self._reply(key, rnd, code, payload, pulls, 1 << rank, None)

    def ack(self, rank: int, key: int, rnd: int) -> None:
        """Tell worker `rank` its contribution to round `rnd` of `key` is in."""
        self._ack(rank, key, rnd)

    def reply(
        self,
        key: int,
        rnd: int,
        code: int,
        payload: memoryview,
        pulls: list[int],
        ranks: int,
        sent: Callable[[], None] | None = None,
    ) -> None:
        """Send `payload` to `ranks` (from any thread: the repliers' queues are thread-safe)."""
        self._reply(key, rnd, code, payload, pulls, ranks, sent)


class KeyOp:
    """How a contribution goes into a round. Stateless: one instance serves every key of its kind."""

    name: ClassVar[str]
    ordered: ClassVar[bool] = False  # contributions must go in in rank order, even when sums need not be
    variable: ClassVar[bool] = False  # a contribution may be shorter than the key (down to empty)
    trailer: ClassVar[int] = 0  # bytes each push carries after its data (per-push arguments; part of the key's length)
    intercepts: ClassVar[bool] = False  # `intercept` sees each push first
    lendable: ClassVar[bool] = False  # its rounds only need a buffer while in use (KeyState.lend): no state across them
    asynchronous: bool = False  # pushes are not gathered into rounds (no staging: they go through the ring)
    reduction: ClassVar[bool] = False  # elementwise: a joined worker's zeros may stand in for its contribution

    def lengths(self, nbytes: int, itemsize: int) -> tuple[int, int]:
        """For a key of `nbytes` bytes of data: the bytes each push carries, and the accumulator's elements (a
        compressed key's pushes are smaller than its data: server/compressed.py)."""
        return nbytes + self.trailer, (nbytes + self.trailer) // itemsize

    def setup(self, state: KeyState, previous: KeyState | None = None) -> None:
        """Per-key state, allocated when the key is declared (`previous`: the key's state before an elastic reset)."""

    def add(self, state: KeyState, r: Round, dtype: dtypes.DType, wire: np.ndarray, first: bool) -> None:
        """Put one contribution into round `r` (`first`: the round's first, in the order it is added)."""
        raise NotImplementedError

    def landing(self, state: KeyState, r: Round) -> np.ndarray | None:
        """Where round `r`'s first contribution (in rank order) may be received directly, so that it is in
        without `add` (None: `add` puts it in). Deterministic sums only (server/engine.py `landing`)."""
        return None

    def check(self, state: KeyState, r: Round) -> None:
        """Called when every contribution is in: raise TensorError if they do not make a result."""

    def finish(self, state: KeyState, r: Round) -> None:
        """Called when every contribution is in, before the result of round `r` is sent."""
        self.check(state, r)

    def seeded(self, state: KeyState, r: Round, rnd: int, data: np.ndarray) -> None:
        """A worker resent the result of round `rnd` it holds (after a failover): it is `r`'s result."""
        r.out[:] = data

    def intercept(self, outbox: Outbox, state: KeyState, slot: Slot) -> bool:
        """Handle a push outside the rounds (True), or let the engine run it (False). Only with `intercepts`."""
        return False

    def answer(self, outbox: Outbox, state: KeyState, key: int, code: int, r: Round, ranks: int) -> None:
        """Send round `r`'s result to `ranks`; with a replica, once the replica has it (server/replica.py), so that
        every result a worker has seen survives this server. The result stays put until then: its buffer takes a new
        round only once every worker has this one."""
        sent = state.release_when_sent(r)
        if state.replica is None or outbox.forward is None:
            outbox.answer_round(key, code, r, ranks, sent)
            return
        rnd, payload, pulls = r.number, r.result, list(r.pulls)
        whole = memoryview(r.out).cast("B")
        done = lambda: outbox.reply(key, rnd, code, payload, pulls, ranks, sent)  # noqa: E731
        outbox.forward(state.replica, key, rnd, code, [whole], done)


class KeyState(Lending):
    """A key's two rounds, who contributes to them, and its operation (its buffers' life cycle: `Lending`)."""

    __slots__ = (
        "dtype",
        "everyone",
        "first",
        "held",
        "landable",
        "lent",
        "length",
        "members",
        "key",
        "name",
        "narrow",
        "nbytes",
        "need",
        "nexts",
        "kept",
        "pool",
        "kept_round",
        "op",
        "replica",
        "rounds",
        "scratch",
        "shared",
        "slices",
        "sums",
    )

    def __init__(
        self,
        dtype: dtypes.DType,
        length: int,
        num_workers: int,
        name: str,
        op: KeyOp,
        slices: list[tuple[int, int]] | None = None,
        members: list[int] | None = None,
        previous: KeyState | None = None,
        key: int = 0,
    ) -> None:
        self.name = name  # the tensor's, for stall reports
        self._set_members(members, num_workers)
        self.op = op
        self.slices = slices  # (start byte, bytes) of the result each rank pulls; None: all of it
        self.dtype = dtype
        self.key = key
        self.nbytes = length  # the key's data, as declared
        self.length, n = op.lengths(length, dtype.itemsize)  # what each push carries; the accumulator's elements
        wire = self.length // dtype.itemsize
        self.narrow = dtype.accumulate != dtype.wire
        # its rounds' buffers are lent by the engine's pool while they are needed (`lend`), or its own
        self.lent = op.lendable and not self.narrow and wire == n and self.length >= LEND_BYTES
        self.rounds = (
            Round(0, n, dtype, num_workers, self.first, wire, self.lent),
            Round(1, n, dtype, num_workers, self.first, wire, self.lent),
        )
        self.scratch = np.empty(n if self.narrow else 0, dtype.accumulate)
        if slices is not None and not self.lent:  # what each round answers: one slice per rank (views made once)
            for r in self.rounds:
                whole = r.result
                assert isinstance(whole, memoryview)
                r.result = [whole[a : a + b] for a, b in slices]
        self.held = None  # what the operation keeps per key (server/optimizer_op.py)
        self.replica: int | None = None  # the server that keeps this key's last answered round (server/replica.py)
        self.kept = False  # this server only keeps the key's answered rounds for its server (a replica), not owns it
        self.shared = False  # its two rounds share one buffer (`keep`)
        self.pool: BufferPool | None = None  # the engine's, which lends its rounds' buffers (`lend`)
        self.sums: Sums = NUMPY  # how contributions are added: the engine's for this dtype (Sums.for_dtype)
        self.kept_round = -1  # kept: the round last received into that buffer (Engine.replica_landing)
        # the first rank's contributions may be received straight into the accumulator (Engine.landing): only once a
        # round completed from contributions (before, after a failover, a seed may be written there meanwhile)
        self.landable = False
        op.setup(self, previous)

    def _set_members(self, members: list[int] | None, num_workers: int) -> None:
        """The ranks that contribute to its rounds (a process set; None: every worker), in the order their
        contributions go in: how many, their bitmask, the first, and the member after each rank."""
        self.members = sorted(members) if members is not None else list(range(num_workers))
        self.need = len(self.members)
        self.everyone = sum(1 << r for r in self.members)
        self.first = self.members[0] if self.members else 0
        self.nexts = [num_workers] * (num_workers + 1)  # the member after each rank, in rank order (past the last)
        for a, b in zip(self.members, self.members[1:], strict=False):
            self.nexts[a] = b

    def fits(self, code: int, length: int) -> bool:
        """A contribution of `length` bytes of dtype `code` may go into this key (a gather's may be shorter)."""
        return self.dtype.code == code and (length == self.length or self.op.variable and length < self.length)

    def unfinished(self, r: Round) -> bool:
        """`r` holds a round begun and not complete."""
        return 0 < r.count < self.need

    def begin(self, r: Round, number: int) -> None:
        """`r` takes round `number` (its previous round must be complete: double buffering)."""
        if self.unfinished(r):
            raise TensorError(f"round {number} arrived while round {r.number} is unfinished")
        r.begin(number, self.first)

    def drain(self, r: Round, dtype: dtypes.DType, staging: BufferPool) -> None:
        """Deterministic sums, after rank `turn` was added to `r`: add the early contributions that are now next in
        rank order (a lent key's staging buffers go back to the pool)."""
        r.turn = self.nexts[r.turn]
        while r.staged >> r.turn & 1:
            rank = r.turn
            source = r.stage[rank]
            assert source is not None
            self.op.add(self, r, dtype, source[: r.lengths[rank]], rank == self.first)
            if self.lent:
                r.stage[rank] = None
                staging.give(source)
            r.staged &= ~(1 << rank)
            r.turn = self.nexts[rank]

    def stalled(self, now: float, threshold: float) -> list[tuple[int, float, list[int]]]:
        """Its rounds begun more than `threshold` seconds ago and still missing workers: (round, seconds waited,
        ranks that have not pushed). Read from another thread for a report: it only reads counters the engine writes,
        so at worst a round is reported a moment late."""
        return [
            (r.number, now - r.started, r.missing(self.members))
            for r in self.rounds
            if self.unfinished(r) and now - r.started > threshold
        ]
