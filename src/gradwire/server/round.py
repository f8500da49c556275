"""One of a key's two rounds on a server (double buffering: server/engine.py): the round number it holds, whose
contributions are in, and its accumulator with its result (lent while needed: server/lending.py)."""

from __future__ import annotations

import numpy as np

from gradwire.protocol import dtypes
from gradwire.transport.shm import NO_SLOT


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
