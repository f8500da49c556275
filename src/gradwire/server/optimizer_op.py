"""The optimizer update as a per-key operation: servers that hold parameters and optimizer state (docs/ps-mode.md).

A key declared with `optimizer` keeps its partition of the parameters and of the optimizer state (`Held`, allocated
when the key is declared). Its rounds run like any key's (ring, rank order, staging, validation, seeds): workers push
gradients with a trailer of hyper-parameters (protocol/update.py); when every member's push is in, the sum is averaged
(the same division the workers' DistributedOptimizer does), the optimizer steps the parameters, and every member pulls
the new parameters. Reads and writes of the state (a checkpoint) answer their sender alone, outside the rounds.

Two implementations of each algorithm. `torch` (what gradwire.torch declares) runs torch.optim's own single-tensor
step on the partition, so the parameters are bit-identical to every worker stepping the same torch optimizer on the
averaged gradients (partitioning does not change the bits: torch's optimizers are elementwise). `numpy` (the numpy
API) follows torch's formulas in float32 or float64; without fused multiply-adds its last bits differ.

Asynchronous mode (staleness > 0): each worker's push is applied when it arrives, scaled by 1/n (so n pushes of
SGD move the parameters as far as one synchronous step on the average), and answered with the newest parameters; a
worker whose pushes run more than `staleness` ahead of the slowest member's is answered only once the slowest catches up
(stale synchronous parallel). The answer may be read while another worker's push updates the parameters (Hogwild-style:
within one partition, some elements may be one update newer than others).

Delay compensation (asynchronous keys declared with `delay_compensation` lambda > 0; DC-ASGD, Zheng et al. 2017): a
worker's gradient g was computed at the parameters it was last answered with, w_old, and is applied at w_now; it is
corrected first to g + lambda * g * g * (w_now - w_old), elementwise. The key keeps a copy of the parameters each
worker was last answered with (`Held.answered`: the number of workers times the partition, per key: the price of
knowing w_old exactly; a ring of recent versions would need up to n * (staleness + 1) copies). After a failover the
parameters are installed anew and each worker's first push is applied uncorrected until it has been answered again.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from gradwire.errors import TensorError
from gradwire.protocol import dtypes, update
from gradwire.protocol.frames import REPLICA, SEED
from gradwire.server import replica
from gradwire.server.held import Held
from gradwire.server.rounds import KeyOp, KeyState, Outbox, Round

if TYPE_CHECKING:
    from gradwire.server.slot import Slot

log = logging.getLogger("gradwire.server")


class ServerUpdate(KeyOp):
    """Gradients in, an optimizer step on the server, parameters out (see the module's docstring)."""

    name = "optimizer"
    ordered = True  # the first member's trailer says what the round is; its hyper-parameters are the round's
    variable = True  # a read carries only its trailer, a seed only the parameters
    trailer = update.TRAILER_BYTES
    intercepts = True

    def __init__(self, args: dict) -> None:
        self.args = update.check_args(args)
        self.asynchronous = self.args["staleness"] > 0
        self.compressed = bool(self.args.get("compressor"))  # gradient pushes arrive encoded (protocol/update.py)

    def setup(self, state: KeyState, previous: KeyState | None = None) -> None:
        if state.dtype.name not in update.DTYPES:
            raise TensorError(f"a server-side optimizer holds float32 or float64 parameters, not {state.dtype.name}")
        if self.compressed and state.dtype.name != "float32":
            raise TensorError(f"{state.name!r}: compressed gradients are float32, not {state.dtype.name}")
        if previous is not None and previous.held is not None:  # an elastic reset keeps parameters and state
            state.held = previous.held
            state.held.workers(len(state.rounds[0].pulls))
            state.held.round = -1  # the workers number their rounds afresh
        else:
            count = (state.length - self.trailer) // state.dtype.itemsize
            state.held = Held(self.args, count, np.dtype(state.dtype.wire), len(state.rounds[0].pulls))
        params = state.held.params
        for r in state.rounds:
            r.out, r.result = params, memoryview(params).cast("B")

    @staticmethod
    def _trailer(data: np.ndarray) -> np.ndarray:
        return np.frombuffer(data.view(np.uint8)[-update.TRAILER_BYTES :].tobytes(), np.float64)

    def add(self, state: KeyState, r: Round, dtype: dtypes.DType, wire: np.ndarray, first: bool) -> None:
        held, i = state.held, r.index
        t = self._trailer(wire)
        _check_push(state, wire, int(t[0]))
        if first:
            held.trailer[i][:] = t
        elif t[0] != held.trailer[i][0]:
            kinds = f"{held.trailer[i][0]:.0f} and {t[0]:.0f}"
            raise TensorError(f"{state.name!r}: the workers pushed different kinds of round ({kinds})")
        acc, data = r.acc[: held.m], wire[: held.m]
        if held.trailer[i][0] == update.GRAD and held.codec is not None:
            held.decode(wire, acc, state.key, r.number, add=not first)
        elif held.trailer[i][0] == update.GRAD:
            if first:
                np.copyto(acc, data)
            else:
                state.sums.add_into(dtype, acc, data, state.scratch)
        elif first:  # INIT: the first member's parameters
            np.copyto(acc, data)

    def finish(self, state: KeyState, r: Round) -> None:
        held, t = state.held, state.held.trailer[r.index]
        acc = r.acc[: held.m]
        if r.number <= held.round:  # a replica that took its primary's place, answering a round it has
            return
        if t[0] == update.INIT:
            held.install(acc)
        elif t[0] == update.GRAD:
            if not held.installed:
                raise TensorError(f"{state.name!r}: gradients pushed before the parameters (an init round)")
            np.divide(acc, state.need, out=acc)  # the workers' average: the same division, the same bits
            held.stepper.step(acc, t[2:])
        else:
            raise TensorError(f"{state.name!r}: a round of kind {t[0]:.0f}")
        held.round = r.number

    def seeded(self, state: KeyState, r: Round, rnd: int, data: np.ndarray) -> None:
        """A worker resent the parameters it holds (after a failover): installed if newer than what is here."""
        held = state.held
        if len(data) != held.m:
            raise TensorError(f"{state.name!r}: a seed of {len(data)} elements, not {held.m}")
        if held.installed and rnd <= held.round:
            return
        restarted = held.installed or held.stepper.count > 0 or rnd > 0
        held.install(data)
        held.round = rnd
        if restarted:
            held.restarts += 1
            log.warning(
                "%r (a partition): parameters of round %d installed from a worker; the optimizer state of this "
                "partition starts afresh (its server died: docs/ps-mode.md)",
                state.name,
                rnd,
            )

    def answer(self, outbox: Outbox, state: KeyState, key: int, code: int, r: Round, ranks: int) -> None:
        """Answer a round once its replica has it (if the key has one): what was applied goes there first."""
        held = state.held
        if held.replica is None or outbox.forward is None:
            outbox.answer_round(key, code, r, ranks)
            return
        rnd, payload, pulls = r.number, r.result, list(r.pulls)
        assert isinstance(payload, memoryview)
        parts = [memoryview(r.acc[: held.m]).cast("B"), memoryview(held.trailer[r.index]).cast("B")]
        outbox.forward(held.replica, key, rnd, code, parts, lambda: outbox.reply(key, rnd, code, payload, pulls, ranks))

    def _apply_replica(self, state: KeyState, slot: Slot, wire: np.ndarray) -> None:
        """The replica's side: apply what the key's primary applied, then acknowledge it."""
        held = state.held
        _check_whole(state, wire, "a replicated update")
        t = self._trailer(wire)
        kind, which = int(t[0]), int(t[1])
        if kind == update.GRAD:
            held.stepper.step(wire[: held.m], t[2:])
            held.round = slot.round
        elif kind == update.INIT:
            held.install(wire[: held.m])
            held.round = slot.round
        elif kind == update.WRITE:
            held.write(which, wire[: held.m])
        held.replicated += 1
        replica.acknowledge(slot.conn, slot.key, slot.round, slot.pull)

    def intercept(self, outbox: Outbox, state: KeyState, slot: Slot) -> bool:
        """Reads and writes (answered to their sender alone), replicated updates, and every push of an asynchronous
        key."""
        held = state.held
        wire = slot.data.view(state.dtype.wire)
        if slot.flags & REPLICA:
            self._apply_replica(state, slot, wire)
            return True
        if slot.flags & SEED:
            if not self.asynchronous:
                return False
            if not held.installed:
                held.install(wire[: held.m])
            return True
        if len(wire) * state.dtype.itemsize < update.TRAILER_BYTES:
            raise TensorError(f"{state.name!r}: a push of {slot.length} bytes has no trailer")
        t = self._trailer(wire)
        kind, which = int(t[0]), int(t[1])
        if kind == update.READ:
            outbox.answer_one(slot, memoryview(held.read(which)).cast("B"))
            return True
        if kind == update.WRITE:
            _check_whole(state, wire, "a write")
            held.write(which, wire[: held.m])
            if held.replica is None or outbox.forward is None:
                outbox.answer_one(slot, _params(state))
                return True
            # the data and the writer's answer taken now: the ring slot is reused once this returns
            parts = [memoryview(wire.copy()).cast("B")]
            answer = (slot.key, slot.round, slot.dtype, _params(state), slot.pull, slot.sender)
            done = partial(outbox.answer_rank, *answer)
            outbox.forward(held.replica, slot.key, slot.round, slot.dtype, parts, done)
            return True
        if not self.asynchronous:
            return False
        self._push_async(outbox, state, slot, wire, kind, t)
        return True

    def _push_async(
        self, outbox: Outbox, state: KeyState, slot: Slot, wire: np.ndarray, kind: int, t: np.ndarray
    ) -> None:
        held, w = state.held, slot.sender
        if not state.everyone >> w & 1:
            raise TensorError(f"worker {w} is not among the ranks {state.members} of {state.name!r}")
        _check_push(state, wire, kind)
        if kind == update.INIT:
            if not held.installed:  # the first to arrive wins (every worker is answered with those parameters)
                held.install(wire[: held.m])
        elif kind == update.GRAD:
            if not held.installed:
                raise TensorError(f"{state.name!r}: gradients pushed before the parameters (an init round)")
            staleness = held.stepper.count - held.seen[w]
            held.staleness_max = max(held.staleness_max, staleness)
            held.staleness_sum += staleness
            grad = (
                wire[: held.m] if held.codec is None else held.decode(wire, held.scratch, slot.key, slot.round, False)
            )
            np.divide(held.compensate(w, grad), state.need, out=held.scratch)
            held.stepper.step(held.scratch, t[2:])
            held.pushes[w] += 1
        else:
            raise TensorError(f"{state.name!r}: a push of kind {kind}")
        held.held[w] = (slot.round, slot.pull)
        slowest = min(held.pushes[r] for r in state.members)
        bound = self.args["staleness"]
        ready = [r for r in sorted(held.held) if held.pushes[r] - slowest <= bound]
        if w not in ready:
            outbox.ack(w, slot.key, slot.round)  # its push is in (frees its window); the answer waits
        for r in ready:
            rnd, pull = held.held.pop(r)
            held.seen[r] = held.stepper.count
            held.remember(r)
            outbox.answer_rank(slot.key, rnd, slot.dtype, _params(state), pull, r)


def _params(state: KeyState) -> memoryview:
    """The key's parameters, as every round answers them."""
    result = state.rounds[0].result
    assert isinstance(result, memoryview)
    return result


def _check_push(state: KeyState, wire: np.ndarray, kind: int) -> None:
    """A push of a round: a gradient of the key's gradient bytes (its block where compressed), or the parameters."""
    held = state.held
    if kind != update.GRAD or held.codec is None:
        _check_whole(state, wire, "a push")
        return
    nbytes, expected = len(wire) * state.dtype.itemsize, held.block + update.TRAILER_BYTES
    if nbytes != expected:
        raise TensorError(f"{state.name!r}: a compressed gradient of {nbytes} bytes, not {expected}")


def _check_whole(state: KeyState, wire: np.ndarray, what: str) -> None:
    """A push that must carry the key's whole data and trailer (a seed or a read carries less)."""
    nbytes = len(wire) * state.dtype.itemsize
    if nbytes != state.length:
        raise TensorError(f"{state.name!r}: {what} of {nbytes} bytes, not {state.length}")


def stats(states: list[KeyState]) -> dict:
    """The optimizer keys of a server: their count, bytes held, and the staleness seen (asynchronous keys)."""
    held = [s.held for s in states if isinstance(s.held, Held)]  # not a compressed key's (server/compressed.py)
    return {
        "keys": len(held),
        "bytes": sum(h.nbytes for h in held),
        "restarts": sum(h.restarts for h in held),
        "replicated": sum(h.replicated for h in held),  # updates applied here as a replica
        "staleness_max": max((h.staleness_max for h in held), default=0),
        "updates": sum(h.stepper.count for h in held),
        "delay_compensated": sum(h.compensated for h in held),  # asynchronous pushes corrected for their delay
        "delay_compensation_bytes": sum(h.dc_bytes for h in held),  # of `bytes`: what that correction holds
        "decoded": sum(h.decoded for h in held),  # compressed gradient pushes decoded
    }


def staleness_by_tensor(states: list[KeyState]) -> dict[str, tuple[int, float]]:
    """Per tensor (over its partitions here): the largest staleness seen and the mean over applied pushes."""
    out: dict[str, list[int]] = {}
    for s in states:
        h = s.held
        if not isinstance(h, Held) or not h.asynchronous:
            continue
        entry = out.setdefault(s.name, [0, 0, 0])
        entry[0] = max(entry[0], h.staleness_max)
        entry[1] += h.staleness_sum
        entry[2] += sum(h.pushes)
    return {name: (e[0], e[1] / e[2] if e[2] else 0.0) for name, e in out.items()}
