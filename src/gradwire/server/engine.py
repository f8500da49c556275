"""The engine: a thread that owns a share of the keys and sums their partitions.

Each engine consumes one ring (ring.py) in batches. For each slot it puts the contribution into the
key's accumulator for that round with the key's per-key operation (ops.py: sum by default; min, max,
product, gather), and when every contributing rank is in (all n workers, or a process set's) it hands
the result to their reply queues: all of it, or each rank its declared slice. Below, "sum" stands for
any operation. Decisions and why:

- Copy the first contribution, add the rest in place: one pass over memory per contribution, no zeroing.
- Double-buffered rounds (`KeyState.rounds[round % 2]`, a `Round` each): a worker pushes round r+1 of a key
  only after it received the sum of round r, and round r+1 completes only when every worker has pushed it,
  hence received round r. So when round r+1 completes, every reply of round r has been handed to the kernel: round
  r's buffer goes back to the pool then at the latest (it goes as soon as the repliers have sent its replies:
  KeyState.lend). A fast worker's round r+1 goes into another buffer and never corrupts round r.
- One buffer is sent to every worker, so all receive bit-identical bytes.
- Deterministic by default: contributions are added in rank order, whatever order they arrive in (one that
  arrives early waits in a staging buffer until its turn). Floating-point addition is not
  associative, so arrival order would otherwise change the last bits from run to run; in rank order a rerun,
  and a round re-summed on another server after a failover, give the same bits (as a ring all-reduce does).
  Over sockets, the readers receive every rank's contribution but rank 0's straight into a staging buffer
  (`landing`), not into a ring slot: an early one then waits there with no copy (copying it out of the ring slot
  cost 10% of a torch job's throughput over TCP on two cores, docs/benchmarks.md). Staging buffers are lent by one
  pool per engine and given back once their contribution is added (server/staging.py).
  An early contribution in a worker's shared-memory slot is copied into that staging buffer too, and every
  contribution is acknowledged as soon as it is in. (Keeping a view of the slot and acknowledging it only once
  added saved that copy, but kept it in the worker's window: workers whose hooks submit keys in different orders
  filled their windows with contributions waiting for each other.)
- Seeds (after a failover, see docs/faults.md): a worker that already holds the sum of a round resends it
  flagged SEED; the round is then complete here, and every worker that pushed it (before or after) gets that
  sum, so workers the dead server never answered get the bytes the others already have.
- Replays (after a failover): a key whose ranks pull only their slice (reducescatter, alltoall) leaves no worker
  holding the whole sum to seed with. Each worker the dead server had answered resends its own contribution instead,
  flagged REPLAY: it goes in like any push, in rank order, and only the ranks still waiting are answered.
  (Both: server/seeding.py. The landing buffers readers receive into: server/landing.py.)
- Held rounds (pushes flagged HELD): their pushers keep the sum in their outputs until every one has it; the engine
  says whom it answered (server/receipts.py), and each is told once all have it.
- float16/bfloat16 accumulate in float32 and are narrowed once, into a wire-typed output buffer.
- Buffers are lent by the engine's pool (server/staging.py), never allocated per message: a round's accumulator from
  its first contribution until its replies are sent, a staging buffer until its contribution is added.
- Exceptions in handling one slot are reported to that worker as an ERROR for the key; the engine keeps
  running (an event loop never dies silently).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from gradwire.errors import TensorError, TensorMismatch
from gradwire.protocol import dtypes
from gradwire.protocol.frames import HELD, REPLAY, REPLICA, SEED
from gradwire.ring import Ring, RingClosed
from gradwire.server import ops
from gradwire.server.landing import Landing
from gradwire.server.membership import Membership, ranks_of
from gradwire.server.receipts import Receipts
from gradwire.server.rounds import Ack, Batching, Fail, FailRank, Forward, KeyOp, KeyState, Outbox, Round, SendResult
from gradwire.server.seeding import Seeding
from gradwire.server.slot import JOIN_EVENT, Slot
from gradwire.server.staging import BufferPool
from gradwire.server.sums import NUMPY, Sums

log = logging.getLogger("gradwire.server")


class Engine(Landing, Seeding, Membership):
    """Sums the keys of one ring. Thread-safety: only the engine's own thread touches key state."""

    def __init__(
        self,
        index: int,
        ring: Ring[Slot],
        num_workers: int,
        reply: SendResult,
        fail: Fail,
        ack: Ack,
        clock: Callable[[], float] = time.monotonic,
        deterministic: bool = True,
        forward: Forward | None = None,
        fail_rank: FailRank | None = None,
        batching: Batching | None = None,
        receipts: Receipts | None = None,
        sums: Sums = NUMPY,
    ) -> None:
        self.index = index
        self.sums = sums  # numpy's or the native kernels (server/sums.py): each key's state adds with its dtype's
        self.receipts = receipts  # whom each held round was answered to, until all have it (server/receipts.py)
        self._batching = batching  # replies held over a batch, sent at its end (server/replier.py); None: at once
        self._fail_rank = fail_rank
        self.deterministic = deterministic
        self.clock = clock
        self.ring = ring
        self.num_workers = num_workers
        self._fail = fail
        # what the keys' operations send, on to the repliers (forward: to a key's replica server, server/replica.py)
        self.outbox = Outbox(reply, ack, num_workers, forward, receipts)
        self.keys: dict[int, KeyState] = {}
        self.joined = 0  # workers that have joined (hvd.join), as a bitmask: zeros stand in for their contributions
        self.departed = 0  # workers that have left the job (shutdown()) while others go on: their rounds fail
        self._zeros: dict[tuple[int, int], np.ndarray] = {}
        self.pool = BufferPool()  # staging and lent round buffers (server/staging.py)
        self.seeded_answers = 0  # workers answered with a seeded sum (after a failover)
        self.replicated = 0  # rounds kept here for another server's keys (server/replica.py)
        self._thread = threading.Thread(target=self._run, name=f"gw-engine-{index}", daemon=True)
        self._next_seq = 0  # the next slot of the ring to handle
        self.inline = False  # run by the server's link loop (`handle_published`), not a thread of its own
        self._holding = False  # inline: the loop's thread holds each batch's replies (`Batching.begin`)

    def start(self) -> None:
        """Run on a thread of its own (GRADWIRE_ENGINES > 1); else the link loop runs it (`handle_published`)."""
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        # Sums follow IEEE arithmetic (an overflow is inf, which AMP's loss scaling looks for), whatever the
        # process's warning filters say. numpy's error state is per thread: set once, no per-message cost. (The link
        # loop sets it on its own thread: transport/loop.py.)
        np.seterr(all="ignore")
        if self._batching is not None:
            self._batching.begin()
        while True:
            try:
                available = self.ring.wait(self._next_seq - 1)
            except RingClosed:
                return
            self._handle(available)

    def handle_published(self) -> None:
        """Handle what is published in the ring, without waiting (the engine the server's link loop runs inline:
        after each of its passes, and when a push finds the ring full)."""
        available = self.ring.cursor
        if available < self._next_seq:
            return
        if self._batching is not None and not self._holding:
            self._batching.begin()  # the loop's thread holds the replies of each batch from now on
            self._holding = True
        self._handle(available)

    def _handle(self, available: int) -> None:
        """One batch: every published slot up to `available`, in order; then the batch's replies go, and the slots."""
        for seq in range(self._next_seq, available + 1):
            slot = self.ring.slot(seq)
            if not slot.valid:
                continue
            try:
                self.on_event(slot)
            except Exception as e:  # noqa: BLE001 - reported to the pusher, the engine goes on
                log.exception(
                    "engine %d: key %016x round %d from worker %d", self.index, slot.key, slot.round, slot.sender
                )
                self._fail(slot, f"server failed to sum key {slot.key:016x}: {e}")
        if self._batching is not None:
            self._batching.flush()
        self._next_seq = available + 1
        self.ring.release(available)

    def declare(
        self,
        key: int,
        dtype: dtypes.DType,
        length: int,
        name: str = "?",
        op: KeyOp = ops.SUM,
        slices: list[tuple[int, int]] | None = None,
        members: list[int] | None = None,
    ) -> None:
        """Allocate a key's accumulators (called by the scheduler link when the key is declared).

        From another thread: a whole KeyState is built first and then published by one dict assignment, which
        is atomic, so the engine sees either no state or a complete one. Redeclaring the same key is a no-op.
        """
        if key not in self.keys:
            state = KeyState(dtype, length, self.num_workers, name, op, slices, members, key=key)
            state.pool, state.sums = self.pool, self.sums.for_dtype(dtype)
            self.keys[key] = state

    def reset(self, num_workers: int, forget: bool = False) -> None:
        """Elastic: start every key afresh for `num_workers` workers (`forget`: drop every key, and its memory).
        Only while nothing is in the ring (the server's connections are closed and the ring drained), so the
        engine thread touches no key meanwhile."""
        same = num_workers == self.num_workers  # else a process set's ranks or a rank's slice mean nothing any more
        self.num_workers = self.outbox.num_workers = num_workers
        self.joined = self.departed = 0
        if forget:
            self.keys, self.pool = {}, BufferPool()
            return
        for key, state in list(self.keys.items()):
            slices = state.slices if same else None
            members = state.members if same else None
            fresh = KeyState(state.dtype, state.nbytes, num_workers, state.name, state.op, slices, members, state, key)
            fresh.pool, fresh.sums = self.pool, self.sums.for_dtype(state.dtype)
            self.keys[key] = fresh

    def check(self, key: int, dtype: int, length: int) -> str | None:
        """Why a frame for `key` cannot be summed here, or None if it can (called by readers, before a slot)."""
        state = self.keys.get(key)
        if state is None:
            return f"key {key:016x} is not declared on this server"
        if not state.fits(dtype, length):
            wire = dtypes.BY_CODE[dtype].name
            return f"{length} bytes of {wire} pushed, but the key is {state.length} bytes of {state.dtype.name}"
        return None

    def stalled(self, now: float, threshold: float) -> list[tuple[str, int, int, float, list[int]]]:
        """Rounds begun more than `threshold` seconds ago and still missing workers: (tensor, key, round, seconds
        waited, ranks that have not pushed). Read from another thread, for a report (KeyState.stalled)."""
        keys = list(self.keys.items())
        return [(state.name, key, *stall) for key, state in keys for stall in state.stalled(now, threshold)]

    def on_event(self, slot: Slot) -> None:
        """Add one contribution (or take a seed); publish the sum when the round is complete."""
        if slot.flags & JOIN_EVENT:
            self.on_membership(slot)
            return
        state = self.keys.get(slot.key)
        if state is None or not state.fits(slot.dtype, slot.length):  # readers check first
            raise TensorError(f"worker {slot.sender} pushed an undeclared or inconsistent key")
        if state.shared and not state.kept:
            state.own()  # a replica's key, promoted: its rounds get their own buffers again
        if state.op.intercepts and state.op.intercept(self.outbox, state, slot):
            return
        dtype = state.dtype
        r = state.rounds[slot.round & 1]
        if slot.flags & (SEED | REPLICA):
            self._seed(state, r, slot, dtype)
            return
        self._on_contribution(state, r, slot)

    def _on_contribution(self, state: KeyState, r: Round, slot: Slot) -> None:
        """A worker's push into round buffer `r` of its key: added, then acknowledged, or the round completes."""
        bit = 1 << slot.sender
        if not state.everyone & bit:
            raise TensorError(f"worker {slot.sender} is not among the ranks {state.members} of {state.name!r}")
        replay = slot.flags & REPLAY
        if replay and self._stale_replay(state, r, slot.round, bit):
            return
        if r.number != slot.round:
            state.begin(r, slot.round)
        r.pulls[slot.sender] = slot.pull
        if slot.flags & HELD:
            r.held = True  # its pushers hold its sum in their outputs until every one has it
        if r.seeded and r.count == state.need:
            # a worker the dead server never answered pushes a round whose sum came as a seed: answer it alone
            self.seeded_answers += 1
            self.outbox.answer_round(slot.key, slot.dtype, r, bit)
            return
        if r.pushed & bit:
            raise TensorError(f"worker {slot.sender} pushed round {slot.round} twice")
        if r.count == 0:
            self._first_in(state, r)
        self._contribute(state, r, slot.sender, slot.data.view(state.dtype.wire), slot.landed)
        if replay:
            r.virtual |= bit  # its sender had its slice from the dead server: no answer, no acknowledgement
        if self.joined and r.count < state.need:
            self._join_in(state, r)  # joined workers contribute zeros (hvd.join)
        if self.departed and r.count < state.need and self._fail_departed(state, slot.key, r):
            return
        if r.count < state.need:
            # The worker's window counts contributions not yet in, not sums not yet out: a window of
            # unanswered sums deadlocks when workers' windows fill with different keys. (A replay holds no window.)
            if not replay:
                self.outbox.ack(slot.sender, slot.key, slot.round)
        else:  # complete: the RESULT is the last pusher's acknowledgement too
            self._complete(state, slot.key, slot.dtype, r)

    def _first_in(self, state: KeyState, r: Round) -> None:
        """The first contribution of round `r`: no rank stands in yet; joined workers (hvd.join) stand in only for a
        reduction."""
        r.virtual = 0
        if self.joined & state.everyone and not state.op.reduction:
            raise TensorMismatch(
                f"{state.name!r}: worker(s) {ranks_of(self.joined & state.everyone)} have joined (hvd.join): only "
                "allreduce goes on without them (their contributions count as zeros)"
            )

    def _contribute(self, state: KeyState, r: Round, sender: int, wire: np.ndarray, landed: bool) -> None:
        """Put `sender`'s contribution into round `r`, in rank order (deterministic) or as it comes."""
        dtype = state.dtype
        if r.count == 0:
            r.started = self.clock()
        if state.lent and (sender == r.turn or not (self.deterministic or state.op.ordered)):
            state.lend(r, self.pool)  # written from now on (an early one waits in a staging buffer instead)
        if not (self.deterministic or state.op.ordered):
            state.op.add(state, r, dtype, wire, r.count == 0)
        elif sender == r.turn:
            if not (landed and sender == state.first):  # else it was received into the accumulator (`landing`)
                state.op.add(state, r, dtype, wire, sender == state.first)
            lent = r.stage[sender]
            if state.lent and landed and sender != state.first and lent is not None:  # into a staging buffer
                self.pool.give(lent)
                r.stage[sender] = None
            state.drain(r, dtype, self.pool)
        else:  # early: it waits in its staging buffer (where a socket's reader received it, or copied from the ring
            # or the worker's shared slot), and is acknowledged now (see the module's docstring)
            if not landed:
                self._stage(state, r, sender)[: len(wire)] = wire
            r.lengths[sender] = len(wire)
            r.staged |= 1 << sender
        r.count += 1
        r.pushed |= 1 << sender

    def _complete(self, state: KeyState, key: int, code: int, r: Round) -> None:
        """Every contribution is in: finish the round and answer the workers that pushed (not joined ones' zeros)."""
        if state.lent:
            state.give_back(r, self.pool)  # before any worker has this round's result: none can push the next yet
        state.landable = True
        state.op.finish(state, r)
        if state.narrow:
            state.sums.narrow(state.dtype, r.acc, r.out)
        state.op.answer(self.outbox, state, key, code, r, state.everyone & ~r.virtual)
