"""A worker's side of an elastic job (docs/faults.md): the scheduler's RESET cancels everything in flight, and calls
raise MembershipChanged until `reset()` re-forms the job (gradwire.torch.elastic.run calls it after restoring the
last commit). MEMBERS says how many workers wait to join at the next commit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gradwire.errors import ConfigError, MembershipChanged
from gradwire.protocol import messages
from gradwire.worker.connecting import Connecting
from gradwire.worker.control import Control
from gradwire.worker.failover import Failover
from gradwire.worker.recut import Retuning
from gradwire.worker.state import SHUTDOWN_JOIN_SECONDS, WorkerState
from gradwire.worker.tensors import TensorTable

log = logging.getLogger("gradwire.worker")


class Elastic:
    def __init__(
        self,
        state: WorkerState,
        table: TensorTable,
        control: Control,
        connecting: Connecting,
        failover: Failover,
        retuning: Retuning,
    ) -> None:
        self.state = state
        self.table = table
        self.control = control
        self.connecting = connecting
        self.failover = failover
        self.retuning = retuning
        self.joining = 0  # workers waiting to join at the next reset
        self.resets: list[dict] = []
        self.reformed: Callable[[messages.AddressBook], None] = lambda book: None  # the worker's, for the new layout
        self._use_before: dict[str, float] = {}  # link use counted by credits and links since replaced

    def on_members(self, members: messages.Members) -> None:
        """MEMBERS: workers wait to join; the next `state.commit()` re-forms the job with them."""
        self.joining = members.joining

    def on_reset(self, reset: messages.Reset) -> None:
        """RESET from the scheduler: cancel everything in flight; calls raise MembershipChanged until reset()."""
        rank = self.state.rank
        error = MembershipChanged(
            f"worker {rank}: the job's workers changed ({reset.message}); restore the last commit and "
            "call reset() (gradwire.torch.elastic.run does both)",
            lost_rank=reset.lost_rank,
            rank=rank,
        )
        self._cancel(error)

    def _cancel(self, error: MembershipChanged) -> None:
        with self.state.lock:
            if self.state.membership_error is None:
                self.state.membership_error = error
        self.control.cancel_requests()
        for link in self.state.links:
            link.close(error)
        self.failover.fail_held(error)

    def reset(self) -> None:
        """Re-form the job after a MembershipChanged (or at a commit, when workers are joining).

        Cancels anything still in flight, waits for the scheduler to fix the new membership (this worker's rank may
        change), starts every tensor's rounds afresh, reconnects to the servers and passes a barrier. The caller
        then brings every worker to the same state (`state.sync()`: a broadcast from rank 0).
        """
        state = self.state
        if not state.config.elastic:
            raise ConfigError("reset() is for elastic jobs: start them with GRADWIRE_MIN_WORKERS (--min-workers)")
        if state.abort is not None:
            raise state.abort
        self._cancel(MembershipChanged(f"worker {state.rank} is re-forming the job"))
        for link in state.links:
            link.join(SHUTDOWN_JOIN_SECONDS)
        started, old_rank, old_size = time.monotonic(), state.rank, state.size
        reply = self.control.request(messages.Rejoin(), check=False, rejoin=True)
        book = messages.address_book(reply)
        if state.abort is not None:
            raise state.abort
        with state.lock:
            state.apply_book(book)
            self.table.restart()
            self.retuning.recut.release()
            self._use_before = self.link_use()
            state.active = 0
            self.failover.seeds.clear()
            state.membership_error = None
            self.joining = 0
        state.credit = state.new_credit()  # the cancelled pushes' credit is not coming back
        self.reformed(book)  # the layout's local aggregation, before the links (it sizes their shared slots)
        self.connecting.connect_all(book.servers, self.failover.hooks)
        self.control.barrier()
        seconds = time.monotonic() - started
        self.resets.append({"epoch": state.epoch, "rank": state.rank, "size": state.size, "seconds": seconds})
        log.info(
            "worker %d (was %d of %d) re-formed the job in epoch %d: %d workers, in %.0f ms",
            *(state.rank, old_rank, old_size, state.epoch, state.size, seconds * 1e3),
        )

    def link_use(self) -> dict:
        """The network links' use so far (across resets), for the heartbeat: the scheduler's drift check."""
        state = self.state
        if state.native is not None:  # the native data path's links (worker/native_path.py)
            busy, moved, full = state.native.link_use()
        else:
            busy, moved = state.credit.busy() if state.credit else (0.0, 0)
            full = sum(link.flow.full_seconds for link in state.links if getattr(link, "network", False))
        now = dict(zip(messages.LINK_USE, (busy, moved, full), strict=True))
        return {k: self._use_before.get(k, 0) + v for k, v in now.items()}
