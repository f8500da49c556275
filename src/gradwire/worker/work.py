"""What a worker's links carry: what one call moves (`Transfer`), cut into one `Work` per partition, and what a worker
keeps of a key's last answered round to seed a dead server's replacement with (`Seed`, docs/faults.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from gradwire.transport import shm
from gradwire.worker.handle import Handle
from gradwire.worker.tensors import Tensor


def divisor(size: int, average: bool, members: list[int] | None = None) -> int:
    """What a sum is divided by (a `Transfer`'s `average`): for an average, the number of ranks taking part (a process
    set's members, else every worker of the job), as Horovod's average divides; else 1. The one place it is decided."""
    return (size if members is None else len(members)) if average else 1


def stages(
    queued: float, sent: float, pushed: float, result: float, done: float
) -> tuple[tuple[str, float, float], ...]:
    """A partition's four stages (name, start, end) from its times: queued (submitted until let go), push (until
    wholly sent), wait (for the sum), pull (until it was all in). Both data paths' timelines use them, and the Python
    path's stage histogram."""
    return (("queued", queued, sent), ("push", sent, pushed), ("wait", pushed, result), ("pull", result, done))


class Seed:
    """What a worker keeps of its last answered round of one key (allocated once per key), to seed a new server with
    after a failover: the sum it received, or, for a key it pulls only a slice of (reducescatter, alltoall), its own
    contribution, which it resends flagged REPLAY so that the round can be summed again for the ranks still waiting.
    A held key's (`held`) is no copy: it is the output of the call in flight, which holds the sum until every worker
    has it (worker/holding.py)."""

    __slots__ = ("averaged", "contribution", "data", "dtype", "held", "round")

    def __init__(self, nbytes: int, dtype: int, contribution: bool = False) -> None:
        self.data = np.empty(nbytes, np.uint8)
        self.dtype = dtype
        self.round = -1  # none received yet
        self.contribution = contribution  # `data` is this worker's push, not the round's result
        self.held = False  # `data` is the output of a call in flight, valid until it completes
        self.averaged = False  # `data` is the sum averaged (a held key's, by the call that holds it)

    @classmethod
    def holding(cls, work: Work, averaged: bool) -> Seed:
        """The sum of `work`'s round, as it lies in its output (a held key's), `averaged` or not."""
        seed = cls.__new__(cls)
        seed.data, seed.dtype, seed.round = work.out.reshape(-1).view(np.uint8), work.dtype, work.round
        seed.contribution, seed.held, seed.averaged = False, True, averaged
        return seed

    @classmethod
    def of(cls, seeds: dict[int, Seed], work: Work) -> Seed | None:
        """Where `work`'s answer is received: its key's seed, for a sum kept for a failover (None: straight into the
        output). A sliced round's answer is not kept; its own contribution is, now (`keep_contribution`)."""
        if work.replayable:
            cls.keep_contribution(seeds, work)
            return None
        return None if work.partial else cls.for_sum(seeds, work)

    @classmethod
    def for_sum(cls, seeds: dict[int, Seed], work: Work) -> Seed:
        """The copy of `work`'s key's sum in `seeds` (a worker's, by key), allocated once per key, that the next sum is
        received into."""
        copy = seeds.get(work.key)
        if copy is None or len(copy.data) != work.nbytes:
            copy = seeds[work.key] = cls(work.nbytes, work.dtype)
        return copy

    @classmethod
    def keep_contribution(cls, seeds: dict[int, Seed], work: Work) -> None:
        """Copy what this worker pushed in a sliced round into its key's saved copy, as the round is answered (its
        input is still the caller's until the handle completes): a dead server's replacement may need it again for
        the ranks it had not answered yet."""
        copy = seeds.get(work.key)
        if copy is None or len(copy.data) != len(work.send) or not copy.contribution:
            copy = seeds[work.key] = cls(len(work.send), work.dtype, contribution=True)
        copy.data[:] = work.send
        copy.round = work.round


class Work:
    """One partition of one push_pull: what to send, where the sum goes, and whom to tell."""

    __slots__ = (
        "acked",
        "average",
        "credited",
        "dtype",
        "expand",
        "extra",
        "handle",
        "held",
        "index",
        "key",
        "nbytes",
        "order",
        "partial",
        "push_bytes",
        "replayable",
        "out",
        "pull_slot",
        "push_slot",
        "round",
        "seed",
        "send",
        "t_pushed",
        "t_queued",
        "t_result",
        "t_sent",
        "tensor",
    )

    def __init__(
        self,
        tensor: str,
        key: int,
        rnd: int,
        dtype: int,
        send: np.ndarray,
        out: np.ndarray,
        average: int,
        handle: Handle | None,
        index: int = 0,
        seed: int = 0,
        partial: bool = False,
        replayable: bool = False,
    ) -> None:
        self.tensor, self.key, self.round, self.dtype, self.index = tensor, key, rnd, dtype, index
        self.order: tuple = ()  # the job-wide order of flow control, set when queued (see Flow.push)
        self.send = memoryview(send).cast("B")
        self.push_bytes = len(self.send)  # what this worker contributes (a gather's part may be short, or empty)
        self.extra: memoryview | None = None  # bytes pushed after the data (`trail`)
        # a compressed partition's: decodes the answered block into the caller's output (worker/compressing.py)
        self.expand: Callable[[np.ndarray, int], None] | None = None
        self.out = out
        self.nbytes = out.nbytes  # what it pulls
        self.partial = partial  # it pulls only its slice of the key's result (so holds no sum to seed a failover)
        self.replayable = replayable  # a sliced round's: its contribution is kept instead (see Seed)
        self.held = False  # its sum stays in the output, the call unfinished, until every worker has it (Seed.holding)
        self.average = average
        self.handle = handle
        self.acked = False  # the server has our contribution: the window slot and credit are free again
        self.credited = False  # holds credit (taken by the sender, given back on its ACK)
        # resent after a failover, no answer expected: a sum this worker holds (SEED) or its contribution (REPLAY)
        self.seed = seed
        self.push_slot = shm.NO_SLOT  # shared slots in use (same-host links only)
        self.pull_slot = shm.NO_SLOT
        # when it was queued, taken by the sender, fully sent, and answered (time.monotonic): the stages
        self.t_queued = self.t_sent = self.t_pushed = self.t_result = 0.0

    def deliver(self, seed: Seed | None) -> None:
        """The answer is in (in `seed`, or in the output): into the output, averaged, in one pass; the seed keeps the
        sum of this round."""
        source = self.out
        if seed is not None:
            seed.round = self.round
            source = seed.data.view(self.out.dtype)
        if self.expand is not None:  # a compressed block: decoded into the output, averaged there
            self.expand(source.view(np.uint8), self.average)
            return
        if self.average > 1:
            # integers: the quotient truncated toward zero, as Horovod's average of an integer tensor
            np.divide(source, self.average, out=self.out, casting="unsafe")
        elif seed is not None:
            np.copyto(self.out.reshape(-1).view(np.uint8), seed.data)

    def stages(self, done: float) -> tuple[tuple[str, float, float], ...]:
        """Its four stages, once answered at `done` (`stages`)."""
        return stages(self.t_queued, self.t_sent, self.t_pushed, self.t_result, done)

    def trail(self, extra: memoryview | None) -> Work:
        """Push `extra` after the data (a server-side update's trailer: protocol/update.py)."""
        if extra is not None:
            self.extra = extra
            self.push_bytes += len(extra)
        return self


@dataclass
class Transfer:
    """What one call moves. `send` holds the elements [send_at, send_at + len) of the tensor that this worker
    contributes (all of them for a reduction, its own segment for a gather); the result's elements [pull_at, pull_at +
    len) land in `pull` (a view of the output): all of them, or this rank's slice. `average`: what the result is
    divided by. `extra`: bytes every partition's push carries after its data (a server-side update's trailer).
    `partial`: the answers are not results to keep for a failover (reads of a server's state). `same_round`: not a new
    round (a read or write that its server answers outside the rounds)."""

    send: np.ndarray
    send_at: int
    pull: np.ndarray
    pull_at: int
    average: int
    priority: int
    extra: np.ndarray | None = None
    partial: bool = False
    same_round: bool = False

    def spans(self, start: int, count: int) -> tuple[int, int, int, int]:
        """Of the tensor's elements [start, start + count) (a partition), the ones this call pushes and pulls: (first,
        end) in `send`, then (first, end) in `pull` (empty where it has none of them)."""
        sent, pulled, end = len(self.send), len(self.pull), start + count
        return (
            min(max(start - self.send_at, 0), sent),
            min(max(end - self.send_at, 0), sent),
            min(max(start - self.pull_at, 0), pulled),
            min(max(end - self.pull_at, 0), pulled),
        )

    def keeps(self, sliced: bool, replicated: bool, held: bool) -> tuple[bool, bool, bool]:
        """What a partition of this call keeps for a failover, as (partial: no sum of its own to keep, replayable: its
        contribution kept instead, held: its sum held in the output until every worker has it), from whether this
        rank pulls only a slice of it, whether its key's replica server keeps its rounds, and whether its tensor's
        sums are held. A key whose replica keeps its last round needs no copy here: after a failover the replica
        answers that round from its own (a cut-off answer is then simply asked for again)."""
        partial = self.partial or sliced or replicated
        replayable = sliced and not self.partial and not replicated
        return partial or held, replayable, held and not partial  # the scheduler holds no sliced or read key's sums

    def works(self, tensor: Tensor, rnd: int, handle: Handle) -> Iterator[Work]:
        """A `Work` per partition of `tensor`, for round `rnd`, in partition order."""
        send, pull = self.send, self.pull
        extra = memoryview(self.extra).cast("B") if self.extra is not None else None
        code = tensor.dtype.code
        replicated = tensor.replicated or [False] * len(tensor.keys)
        for part, key, kept in zip(tensor.parts, tensor.keys, replicated, strict=True):
            give_from, give_to, take_from, take_to = self.spans(part.start, part.count)
            give, take = send[give_from:give_to], pull[take_from:take_to]
            partial, replayable, held = self.keeps(len(take) < part.count, kept, tensor.held)
            args = (tensor.name, key, rnd, code, give, take, self.average, handle, part.index)
            work = Work(*args, partial=partial, replayable=replayable).trail(extra)
            work.held = held
            yield work
