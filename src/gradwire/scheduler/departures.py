"""Departures: a node that says bye, whose script raised, or whose connection drops. When every worker has said bye
the job ends (or waits for a new generation: generations.py); a worker whose connection drops before its bye aborts
the job, naming it, so nobody hangs, unless the job is elastic (it re-forms: elastic.py) or finishing (another worker
is done, and this one's end is a departure too). A server's loss is failover's (failover.py).
"""

from __future__ import annotations

import logging
import threading

from gradwire.protocol import messages
from gradwire.scheduler.elastic import Reforming
from gradwire.scheduler.failover import Failover
from gradwire.scheduler.generations import Generations
from gradwire.scheduler.node import Node
from gradwire.scheduler.roster import Roster
from gradwire.scheduler.synchronisation import Synchronisation

log = logging.getLogger("gradwire.scheduler")
# a worker whose process ended mid-job: how long before the rounds that need it fail (see `bye`)
DEPARTED_GRACE_SECONDS = 2.0


class Departures:
    def __init__(
        self,
        roster: Roster,
        synchronisation: Synchronisation,
        generations: Generations,
        failover: Failover,
        membership: Reforming | None,
    ) -> None:
        self.roster = roster
        self.synchronisation = synchronisation
        self.generations = generations
        self.failover = failover
        self.membership = membership

    def said_bye(self, node: Node, bye: messages.Bye) -> bool:
        """A BYE; True when it is the node's last word (its connection is done)."""
        # shutdown() in a process that lives on keeps its connection open: it may init() again, and its connection
        # closing (at exit, or once it has registered anew) is its final word
        node.final_bye = bye.final or node.role != "worker"
        if bye.error and self._failed(node, bye.error):
            return True
        self.bye(node)
        return node.final_bye

    def bye(self, node: Node) -> None:
        roster = self.roster
        with roster.lock:
            node.said_bye = True
        self.synchronisation.fail_barrier(node)
        if node.role == "worker" and roster.declarations is not None:
            roster.declarations.leave(node.rank, f"worker {node.rank} left the job (called shutdown())")
        if node.role == "worker" and node in roster.workers:
            # the others' rounds that need its pushes fail on the servers, not at the timeout: at once after a
            # shutdown(); a moment later where its process ends, so that a launcher sees that exit first and names it
            # (not the others', which the failed rounds cause)
            if node.final_bye:
                _later(DEPARTED_GRACE_SECONDS, self._tell_departed)
            else:
                self._tell_departed()
        with roster.lock:
            if not all(w.said_bye or w.lost for w in roster.workers) or node.role != "worker":
                return
            if self.membership is not None and node not in roster.workers:
                return  # a joiner that gave up
            config = roster.config
            if self.membership is None and config.reinit_seconds > 0 and not all(w.final_bye for w in roster.workers):
                self.generations.await_locked()
                return
        roster.end("every worker said bye; job complete")

    def _failed(self, node: Node, error: str) -> bool:
        """A worker's process ends because its script raised `error`. In an elastic job that ends the job, naming it:
        only membership changes are recovered from (Horovod's rule), since the replacement would run the same script
        into the same error, and the survivors would otherwise wait in rounds it never pushes. True if it did."""
        roster = self.roster
        with roster.lock:
            if self.membership is None or node not in roster.workers or roster.over():
                return False
            node.lost = True
        why = (
            f"worker {node.rank} at {node.host} failed: {error}. An elastic job re-forms around a worker that dies or "
            "goes silent, not one whose training script raised: a replacement would raise it too"
        )
        # a moment later, as for a departure (bye): a launcher then sees this worker's exit first and names it
        _later(DEPARTED_GRACE_SECONDS, roster.abort, why, ("worker", node.rank))
        return True

    def _tell_departed(self) -> None:
        """Tell the servers which workers have left (said bye) while others go on (server/engine.set_departed)."""
        roster = self.roster
        with roster.lock:
            left = sorted(w.rank for w in roster.workers if w.said_bye)
            if roster.done.is_set() or len(left) == len(roster.workers):
                return  # the job is over, or ends now: no round waits
            roster.tell(roster.live_servers(), messages.Departed(ranks=left))

    def disconnected(self, node: Node, error: Exception) -> None:
        """`node`'s connection dropped, with `error`."""
        roster = self.roster
        if node.role == "server" and (node in roster.servers or node in roster.standby):
            self.failover.server_lost(node, str(error))
            return
        if node.said_bye and not node.final_bye:
            self.generations.final_bye(node)
            return
        with roster.lock:
            if node.said_bye or node.lost or roster.over():
                return
            elastic = self.membership is not None and node.role == "worker"
            finishing = elastic and node in roster.workers and roster.finishing()
            if elastic and not finishing:
                assert self.membership is not None
                self.membership.left(node, str(error))
                return
            if not finishing:
                node.lost = True
                roster.abort_locked(
                    f"lost {node.role} {node.rank} at {node.host}: {error}", lost=(node.role, node.rank)
                )
                return
        # elastic, and the job is finishing (another worker is done): a departure, not a loss to re-form around (the
        # survivors would roll back and train again), nor one to abort on
        log.info("worker %d at %s ended while the job finishes: %s", node.rank, node.host, error)
        node.final_bye = True
        self.bye(node)


def _later(seconds: float, function, *args) -> None:
    timer = threading.Timer(seconds, function, args=args)
    timer.daemon = True
    timer.start()
