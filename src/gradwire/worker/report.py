"""What a worker tells a scheduler that resumes the job (RESUME; scheduler/recovery.py rebuilds the job from it): who it
is, and what it knows of the job: its tensors as declared and placed, the barriers it has passed, the servers it has
lost its link to (not failed over yet), its address book as failovers changed it, and its latest failover (the REPLACE
it applied, what it holds and waits for of the moved keys now, and whether it is over) and re-cut (whether it
holds calls for one, and the RETUNE it applied).
"""

from __future__ import annotations

from gradwire.protocol import messages
from gradwire.worker.control import Control
from gradwire.worker.declaring import Declaring
from gradwire.worker.failover import Failover
from gradwire.worker.recut import Retuning
from gradwire.worker.state import WorkerState
from gradwire.worker.tensors import TensorTable


class Report:
    """`report()` makes this worker's RESUME now; `registration` (what it registered with) is set at the rendezvous."""

    def __init__(
        self,
        state: WorkerState,
        table: TensorTable,
        control: Control,
        declaring: Declaring,
        failover: Failover,
        retuning: Retuning,
    ) -> None:
        self.state = state
        self.table = table
        self.control = control
        self.declaring = declaring
        self.failover = failover
        self.retuning = retuning
        self.registration: dict = {}

    def __call__(self) -> messages.Resume:
        state = self.state
        with state.lock:
            placed = [t for t in self.table.tensors.values() if t.ready.is_set() and t.error is None and t.keys]
            tensors = [
                {
                    "declare": {k: v for k, v in self.declaring.body(t).fields().items() if k != "id"},
                    "partition_bytes": t.cut_bytes,
                    "servers": list(t.servers),
                    "held": t.held,
                }
                for t in placed
            ]
        book = state.book
        assert book is not None
        report = {
            "tensors": tensors,
            "barriers": state.barriers_passed,
            "lost": sorted(self.failover.lost_at),  # the servers whose links died, not failed over yet
            "failover": self.failover.latest(),
            "recut": self.retuning.report(),
            "book": {k: v for k, v in book.fields().items() if k not in ("rank", "standby", "wall_time")},
            "scheduler": self.control.promise.report(),  # for a standby's proof (scheduler/lease.py)
        }
        where = ("worker", state.rank, state.config.host)
        return messages.Resume.of(*where, (state.term, state.epoch), self.registration, report)
