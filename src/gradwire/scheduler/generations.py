"""Generations: every worker called shutdown() and may init() again (GRADWIRE_REINIT_SECONDS). The job then waits
for them; when all `num_workers` have registered anew, a new generation starts on the same servers, afresh: every key
forgotten, a new epoch, new ranks, new declarations. (Not an elastic job's re-forming: elastic.py.)
"""

from __future__ import annotations

import logging
import threading

from gradwire.errors import GradwireError
from gradwire.protocol import messages
from gradwire.scheduler.node import Node
from gradwire.scheduler.rendezvous import Rendezvous, rank
from gradwire.scheduler.roster import Roster

log = logging.getLogger("gradwire.scheduler")


class Generations:
    """The roster's `between` is the next generation's workers as they register (None: no generation is awaited)."""

    def __init__(self, roster: Roster, rendezvous: Rendezvous) -> None:
        self.roster = roster
        self.rendezvous = rendezvous
        self.started = threading.Event()  # set when a new generation has begun (or the job ends)

    def await_locked(self) -> None:
        """Every worker has called shutdown() in a process that lives on: wait for them to init() again."""
        roster = self.roster
        roster.between, roster.barrier, roster.joins = [], [], {}
        self.started.clear()
        threading.Thread(target=self._wait, name="gw-sched-reinit", daemon=True).start()
        log.info("every worker called shutdown(); waiting %gs for them to init() again", roster.config.reinit_seconds)

    def admit_locked(self, node: Node) -> bool:
        """A worker registering for the next generation (True), or not awaited (False)."""
        roster = self.roster
        if roster.between is None or node.role != "worker":
            return False
        roster.between.append(node)
        roster.nodes.append(node)
        expected = roster.config.num_workers
        log.info(
            "worker from %s registered for a new generation (%d/%d)", node.conn.peer, len(roster.between), expected
        )
        if len(roster.between) == expected:
            workers, roster.between = roster.between, None
            self.started.set()
            threading.Thread(target=self._begin, args=(workers,), daemon=True).start()
        return True

    def final_bye(self, node: Node) -> None:
        """A worker that had called shutdown() is gone for good (its process ended, or it registered anew). Once
        every worker of the last generation is, and no new one has registered, nobody can init() again."""
        roster = self.roster
        with roster.lock:
            node.final_bye = True
            over = roster.between == [] and node in roster.workers and all(w.final_bye for w in roster.workers)
        if over:
            self.started.set()
            roster.end("every worker process has left; job complete")

    def _wait(self) -> None:
        """End the job unless the workers init() again within GRADWIRE_REINIT_SECONDS (all of them within
        GRADWIRE_TIMEOUT once the first is back), or once every worker process has gone (`final_bye`)."""
        roster = self.roster
        if self.started.wait(roster.config.reinit_seconds):
            return
        with roster.lock:
            begun = bool(roster.between)
        if begun and self.started.wait(roster.config.timeout):
            return
        if not roster.done.is_set():
            roster.end(f"no worker called init() again within {roster.config.reinit_seconds:g}s; job complete")

    def _begin(self, workers: list[Node]) -> None:
        """The same servers, afresh: every key forgotten, a new epoch, new ranks, new declarations."""
        roster = self.roster
        with roster.lock:
            try:
                ranked = rank("worker", roster.config.num_workers, workers)
            except GradwireError as e:
                roster.abort_locked(str(e))
                return
            for old, new in zip(roster.workers, ranked, strict=False):
                new.link_rate = new.link_rate or old.link_rate  # measured at the first rendezvous
            roster.nodes = [n for n in roster.nodes if n.role != "worker" or n in workers]
            roster.workers = ranked
            roster.epoch += 1
            epoch, declarations = roster.epoch, roster.declarations
        assert declarations is not None
        for server in roster.live_servers():
            if not declarations.call(server.rank, messages.Reset(epoch, num_workers=len(ranked), forget=True)):
                roster.abort(f"server {server.rank} did not reset for the new generation (epoch {epoch})")
                return
        with roster.lock:
            self.rendezvous.publish_locked(to=ranked)
        log.info("a new generation of %d workers started (epoch %d)", len(ranked), epoch)
