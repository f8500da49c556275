"""Re-cuts and re-tunes while the job runs (scheduler/adapt.py). A re-tune changes every link's window and cap and
the partition size of tensors declared from then on; a re-cut gives the tensors already declared new partitions.

Every worker must make a re-cut at the same round of each tensor, or a round would wait for partitions another worker
cuts differently. Step 1 (RECUT): the worker reports its round of each tensor and holds calls RECUT_AHEAD rounds past
it. Step 2 (RETUNE): the scheduler says, per tensor, the first round cut anew; the tensor gets a successor
(`root~n`, n the re-cut's number; new keys) that carries its rounds from then on, and the holds are released.
"""

from __future__ import annotations

import logging
import threading
import time

from gradwire.errors import GradwireTimeout, RemoteProtocolError
from gradwire.protocol import messages
from gradwire.tuning import Tuning
from gradwire.worker.control import Control
from gradwire.worker.declaring import Declaring
from gradwire.worker.link import ServerLink
from gradwire.worker.state import WorkerState
from gradwire.worker.tensors import Tensor, TensorTable

log = logging.getLogger("gradwire.worker")


class Recutting:
    """The worker's side of re-cuts (the module docstring). Every method is called with `lock` held, the lock that
    guards the worker's tensors; `wait_turn` waits on it."""

    def __init__(self, lock: threading.Lock) -> None:
        self.holds: dict[str, int] = {}  # root name -> the first round held until the RETUNE
        self.number = 0  # the re-cut in step 1 (the scheduler numbers them)
        self.released = threading.Condition(lock)
        self.history: list[dict] = []  # each re-cut: its number, tensors, the partition size, when told

    def hold(self, tensors: list[Tensor], number: int) -> dict[str, int]:
        """Step 1: each re-cuttable tensor's round, reported; calls RECUT_AHEAD rounds past it wait from now on."""
        rounds = {}
        for tensor in tensors:
            current = tensor.current()
            # not one whose last re-cut is still ahead (its successor's round is not the calls' yet)
            if tensor.root == tensor.name and current is tensor.current(next_round=True) and current.recuttable:
                rounds[tensor.name] = current.round
        self.holds = {name: r + messages.RECUT_AHEAD for name, r in rounds.items()}
        self.number = number
        return rounds

    def cut(
        self, tensors: dict[str, Tensor], switch: dict, number: int, partition_bytes: int, who: str
    ) -> list[Tensor]:
        """Step 2: a successor for each tensor in `switch` (name -> its first round cut anew) that partitions of
        `partition_bytes` cut otherwise, added to `tensors` and returned (to be declared); the holds of re-cut `number`
        released. Raises RemoteProtocolError for a round this worker (`who`) has passed (the scheduler broke step
        1)."""
        successors = []
        for name, first in switch.items():
            tensor = tensors.get(name)
            if tensor is None:
                continue
            last = tensor.current()
            if last.successor is not None or last.round >= int(first):
                raise RemoteProtocolError(f"{who}: re-cut of {name!r} at round {first} came too late")
            if last.fits_one(partition_bytes):
                continue  # one partition before and after: nothing to re-cut (the same on every worker)
            new = Tensor(f"{name}~{number}", last.shape, last.dtype, user_name=last.user_name, root=name)
            new.signature, new.round = last.signature, int(first) - 1
            tensors[new.name] = new
            last.successor = (int(first), new)
            successors.append(new)
        if number == self.number:
            self.release()
        if successors:
            record = {"recut": number, "tensors": len(successors), "partition_bytes": partition_bytes}
            self.history.append(record | {"at": time.time()})  # when told: its new partitions start two rounds later
        return successors

    def release(self) -> None:
        """No call is held any more (the re-cut's RETUNE came, or the job re-formed)."""
        self.holds = {}
        self.released.notify_all()

    def wait_turn(self, tensor: Tensor, timeout: float, who: str) -> Tensor:
        """The tensor whose keys take `tensor`'s next round, once no re-cut holds that round (for at most `timeout`
        seconds; `who` names the worker in the error)."""
        deadline = time.monotonic() + timeout
        while True:
            current = tensor.current(next_round=True)
            hold = self.holds.get(tensor.root)
            if hold is None or current.round + 1 < hold:
                return current
            if not self.released.wait(max(0.0, deadline - time.monotonic())):
                raise GradwireTimeout(
                    f"{who}: the scheduler did not say where {tensor.root!r} is cut anew (re-cut {self.number}) "
                    f"in {timeout}s",
                    tensor=tensor.root,
                )


class Retuning:
    """The scheduler's RECUT and RETUNE (and a failover's new settings), applied to this worker."""

    def __init__(self, state: WorkerState, table: TensorTable, control: Control, declaring: Declaring) -> None:
        self.state = state
        self.table = table
        self.control = control
        self.declaring = declaring
        self.recut = Recutting(state.lock)
        self.last_retune: messages.Retune | None = None  # the RETUNE of the latest re-cut (its number > 0)

    def retune(self, tuning: Tuning | None) -> None:
        """New settings from the scheduler (a re-derivation, a failover): every link's window and cap from now on,
        and the partition size of tensors declared from now on (declared ones keep their keys)."""
        state = self.state
        if tuning is None or tuning == state.tuning:
            return
        state.tuning = tuning
        state.config = state.config.tuned(tuning)
        state.partition_bytes = min(state.config.partition_bytes, state.carry_limit())
        if state.credit is not None:  # pacing's lead is counted in partitions
            state.credit.set_lead(state.pacing_lead())
        for link in state.links:
            if isinstance(link, ServerLink):
                link.set_flow(state.config.window, state.config.unanswered)

    def on_recut(self, recut: messages.Recut) -> None:
        """RECUT (step 1): report each tensor's round, and hold calls two rounds past it until RETUNE says where the
        new partitions begin."""
        state = self.state
        with state.lock:
            rounds = self.recut.hold(list(self.table.tensors.values()), recut.number)
        fixed = "partition_bytes" in state.config.explicit
        assert self.control.conn is not None
        self.control.conn.send_message(messages.RecutRounds(recut.number, rounds, state.carry_limit(), fixed))

    def on_retune(self, retune: messages.Retune) -> None:
        """RETUNE: new settings (scheduler/adapt.py); `switch`: per tensor, the round from which it is cut anew."""
        state = self.state
        self.retune(Tuning.from_dict(retune.tuning))
        number, switch = retune.recut, retune.switch
        if number > 0:
            self.last_retune = retune
        with state.lock:
            who = f"worker {state.rank}"
            successors = self.recut.cut(self.table.tensors, switch, number, state.partition_bytes, who)
        for new in successors:
            self.declaring.send(new)
        if successors:
            log.info(
                "worker %d re-cuts %d tensors into %d-byte partitions",
                state.rank,
                len(successors),
                state.partition_bytes,
            )

    def report(self) -> dict:
        """For a scheduler that resumes the job (worker/report.py): the latest re-cut this worker heard of, whether it
        still holds calls for it (step 1), and the latest re-cut's RETUNE it applied (step 2)."""
        with self.state.lock:
            number, held = self.recut.number, bool(self.recut.holds)
        last = self.last_retune
        return {"number": max(number, last.recut if last else 0), "held": held, "retune": last and last.fields()}
