"""Elastic membership (GRADWIRE_MIN_WORKERS > 0): workers leave and join a running job.

A change goes through one reset, in the shape of Horovod's elastic mode:
1. A worker is lost (its connection closes, or it falls silent), or a worker registers after the rendezvous (a
   joiner: held until the reset, told nothing yet). For a loss, every live worker is told RESET at once: its calls
   in flight fail with MembershipChanged, and `elastic.run` restores the last commit. For a joiner, the workers
   are told MEMBERS (joining=k) and re-form at their next `state.commit()` (WorkersJoining); the first of them to
   rejoin turns it into a RESET for the others, so a worker that missed the notice cannot wait forever.
2. Each live worker sends REJOIN (a request). When every live member has, ranks are fixed again: survivors in
   their old order, then joiners in order of arrival. Servers are told RESET (epoch, num_workers): they drop their
   connections and start every key afresh. Then each worker gets its new rank and the address book (the REJOIN's
   reply; joiners get the book their registration waits for), reconnects, and the job goes on from a broadcast of
   rank 0's state (`state.sync()`).
Fewer than GRADWIRE_MIN_WORKERS left aborts the job, naming the lost worker.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import TYPE_CHECKING

from gradwire.errors import GradwireError
from gradwire.protocol import messages
from gradwire.scheduler import probe
from gradwire.scheduler.placing import host_of

if TYPE_CHECKING:
    from gradwire.scheduler.adapt import Adaptation
    from gradwire.scheduler.node import Node
    from gradwire.scheduler.roster import Roster

log = logging.getLogger("gradwire.scheduler")


class Reforming:
    """The elastic part of a scheduler; every method is called with the roster's lock held unless it says not. The
    workers waiting to join are the roster's `joiners`."""

    def __init__(self, roster: Roster, adaptation: Adaptation) -> None:
        self.roster = roster
        self.adaptation = adaptation
        self.resetting = False
        self.rejoined: dict[int, tuple[Node, int]] = {}  # id(node) -> (node, request id)
        self.resets = 0
        self.history: list[dict] = []  # one record per completed reset: epoch, workers, reason

    def join(self, node: Node) -> None:
        """A worker registered after the rendezvous: hold it until the next reset."""
        limit = self.roster.config.worker_limit
        if len(self.roster.live_workers()) + len(self.roster.joiners) >= limit:
            raise GradwireError(f"the job has {limit} workers already (GRADWIRE_MAX_WORKERS)")
        self.roster.joiners.append(node)
        log.info("worker from %s waits to join (%d joining)", node.host, len(self.roster.joiners))
        if self.resetting:
            return  # it joins this reset
        self.roster.tell(self.roster.live_workers(), messages.Members(len(self.roster.joiners)))

    def left(self, node: Node, why: str) -> None:
        """A member worker (or a joiner) is gone."""
        node.lost = True
        if node in self.roster.joiners:
            self.roster.joiners.remove(node)
            return
        live = self.roster.live_workers()
        if len(live) < self.roster.config.min_workers:
            self.roster.abort_locked(
                f"lost worker {node.rank} at {node.host}: {why}; {len(live)} left, fewer than "
                f"GRADWIRE_MIN_WORKERS={self.roster.config.min_workers}",
                lost=("worker", node.rank),
            )
            return
        log.warning(
            "lost worker %d at %s (%s): re-forming the job with %d workers", node.rank, node.host, why, len(live)
        )
        self._begin(f"lost worker {node.rank}: {why}", node.rank)
        self._maybe_complete()

    def rejoin(self, node: Node, request_id: int) -> None:
        self.rejoined[id(node)] = (node, request_id)
        if not self.resetting:  # the first worker to re-form at a commit: the others follow now
            self._begin("workers joining", None)
        self._maybe_complete()

    def _begin(self, reason: str, lost_rank: int | None) -> None:
        self.roster.barrier = []  # waiters are woken by the reset itself
        if not self.resetting:
            self.resetting = True
            self.roster.epoch += 1
        reset = messages.Reset(self.roster.epoch, message=reason, lost_rank=lost_rank)
        self.roster.tell([w for w in self.roster.live_workers() if id(w) not in self.rejoined], reset)

    def _maybe_complete(self) -> None:
        live = self.roster.live_workers()
        if not self.resetting or any(id(w) not in self.rejoined for w in live):
            return
        members = sorted(live, key=lambda w: w.rank) + self.roster.joiners
        replies = {id(node): rid for node, rid in self.rejoined.values()}
        self.roster.joiners, self.rejoined = [], {}
        for rank, worker in enumerate(members):
            worker.rank = rank
            worker.conn.peer_rank = rank
        self.roster.workers = members
        epoch = self.roster.epoch
        threading.Thread(
            target=self._complete, args=(members, replies, epoch), name="gw-sched-reset", daemon=True
        ).start()

    def _complete(self, members: list[Node], replies: dict[int, int], epoch: int) -> None:
        """Without the lock: reset the servers, then give every member its place."""
        declarations = self.roster.declarations
        assert declarations is not None
        declarations.cancel(f"the job's workers changed (epoch {epoch})")  # the workers cancelled theirs already
        declarations.num_workers = len(members)
        declarations.joined, declarations.departed = set(), {}  # ranks are numbered afresh
        with self.roster.lock:
            self.roster.joins = {}  # a join in progress is cancelled with the workers' other requests
        self._measure_joiners(members)
        for server in self.roster.live_servers():
            if not declarations.call(server.rank, messages.Reset(epoch, num_workers=len(members))):
                with self.roster.lock:
                    self.roster.abort_locked(f"server {server.rank} did not reset for epoch {epoch}")
                return
        with self.roster.lock:
            self.adaptation.retune_locked(f"the job re-formed with {len(members)} workers")
        book = self.roster.address_book()
        for worker in members:
            theirs = replace(book, rank=worker.rank, epoch=epoch, num_workers=len(members), standby=False)
            if id(worker) in replies:  # a REJOIN's answer: the book's fields
                message: messages.Message = messages.Reply(replies[id(worker)], theirs.fields())
            else:
                message = theirs
            try:
                worker.conn.send_message(message)
            except GradwireError:
                pass  # its loss starts the next reset
        with self.roster.lock:
            self.resetting = False
            self.resets += 1
            self.history.append({"epoch": epoch, "workers": len(members)})
            joining = len(self.roster.joiners)
            live = self.roster.live_workers()
        log.info("job re-formed in epoch %d with %d workers", epoch, len(members))
        if joining:  # arrived during the reset: they join the next one
            self.roster.tell(live, messages.Members(joining))

    def _measure_joiners(self, members: list[Node]) -> None:
        """Joiners get a link rate as the workers of the start did (without the lock): the rate of a host measured
        already, or, where the placement is measured (GRADWIRE_PLACEMENT=auto), a probe of their own while they wait
        for the address book. Without it, one worker with no rate turned the measured placement into an equal one."""
        joiners = [w for w in members if w.link_rate <= 0]
        rated = [w for w in members if w.link_rate > 0]
        if not joiners or not rated:
            return
        known = {host_of(w): w.link_rate for w in rated}
        if self.roster.config.placement != "auto":
            for joiner in joiners:
                joiner.link_rate = known.get(host_of(joiner), 0.0)
            return
        try:
            measured = probe.measure_links(joiners, self.roster.config.timeout, known)
        except GradwireError as e:  # the joiner is gone or silent: its loss starts the next reset
            log.warning("could not measure a joining worker's link: %s", e)
            return
        if measured:
            log.info("measured the links of joining workers' hosts: %s", measured)
