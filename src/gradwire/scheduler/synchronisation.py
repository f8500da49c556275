"""Synchronisation among the workers: barriers and hvd.join. A barrier completes when every live worker has entered
it and fails at once when a worker has left (it never will); a join lets the others' allreduces go on with zeros in
the joined workers' place until all have joined.
"""

from __future__ import annotations

import logging
import threading

from gradwire.errors import GradwireError
from gradwire.protocol import messages
from gradwire.scheduler.node import Node
from gradwire.scheduler.roster import Roster

log = logging.getLogger("gradwire.scheduler")


class Synchronisation:
    """The workers waiting are the roster's `barrier` and `joins`."""

    def __init__(self, roster: Roster) -> None:
        self.roster = roster
        self._join_lock = threading.Lock()  # one join at a time (see `join`)

    def enter_barrier(self, node: Node, request_id: int, number: int = 0) -> None:
        """Worker `node` enters its `number`th barrier (0: not counted). One the job has passed already (its answer
        went down with a scheduler that died: recovery.py) is answered at once."""
        roster = self.roster
        with roster.lock:
            if 0 < number <= roster.barriers_passed:
                passed = True
            else:
                passed = False
                roster.barrier = [(n, r) for n, r in roster.barrier if n is not node] + [(node, request_id)]
                gone = [w for w in roster.workers if w.said_bye and not w.lost]
                complete = gone or len(roster.barrier) >= sum(not w.lost for w in roster.workers)
                if complete:
                    waiting, roster.barrier = roster.barrier, []
                    roster.barriers_passed = max(roster.barriers_passed, number)
        if passed:
            node.conn.send_message(messages.Reply(request_id, {}))
            return
        if not complete:
            self.break_barrier_deadlocks()
            return
        result: dict = {}
        if gone:  # a worker that has left never enters: fail the barrier now instead of at the timeout
            result = {"error": departed(gone), "lost_rank": gone[0].rank}
        for waiter, rid in waiting:
            waiter.conn.send_message(messages.Reply(rid, result))

    def fail_barrier(self, node: Node) -> None:
        """Worker `node` has left (said bye): the workers waiting in a barrier for it are told it never comes."""
        roster = self.roster
        with roster.lock:
            waiting = roster.barrier if node.role == "worker" and node in roster.workers else []
            roster.barrier = [] if waiting else roster.barrier
        for waiter, rid in waiting:
            result = {"error": departed([node]), "lost_rank": node.rank}
            try:
                waiter.conn.send_message(messages.Reply(rid, result))
            except GradwireError:
                pass  # that worker's own loss is handled on its connection

    def break_barrier_deadlocks(self) -> None:
        """A worker blocked on a collective that waits for a worker waiting in a barrier: neither can go on (the
        barrier waits for the first). Fail that collective now, on every worker that called it."""
        roster = self.roster
        declarations = roster.declarations
        if declarations is None:
            return
        with roster.lock:
            in_barrier = [n.rank for n, _ in roster.barrier]
        for rank in in_barrier:
            declarations.cancel(f"worker {rank} entered a barrier without calling it", rank=rank, blocked_only=True)

    def join(self, node: Node, request_id: int, rounds: dict[str, int]) -> None:
        """Worker `node` is out of data (hvd.join). Until every worker has joined, the others' allreduces go on
        with zeros in the joined workers' place (the servers are told; declarations stop waiting for them). Once every
        worker has, each is answered with the last to join and, per tensor, the latest round any worker reached (a
        joined worker skipped rounds, and numbers its next one after them). One join at a time (each worker's request
        comes on its own thread): the servers must learn the joined sets in the order they were made."""
        with self._join_lock:
            complete, waiting = self._tell_joined(node, request_id, rounds)
        if not complete:
            return
        latest: dict[str, int] = {}
        for _, _, reported in waiting:
            for name, rnd in reported.items():
                latest[name] = max(latest.get(name, 0), rnd)
        for waiter, rid, _ in waiting:
            try:
                waiter.conn.send_message(messages.Reply(rid, {"last": node.rank, "rounds": latest}))
            except GradwireError:
                pass  # its own loss is handled on its connection

    def _tell_joined(self, node: Node, request_id: int, rounds: dict[str, int]) -> tuple[bool, list]:
        """Record `node`'s join and tell the servers and declarations who has joined now. Returns whether every
        worker has, and then the joins to answer."""
        roster = self.roster
        with roster.lock:
            roster.joins[node.rank] = (node, request_id, rounds)
            live = [w for w in roster.workers if not w.lost]
            complete = all(w.rank in roster.joins for w in live)
            joined = set() if complete else set(roster.joins)
            servers = [s for s in roster.live_servers() if not s.standby]
            waiting = list(roster.joins.values()) if complete else []
            if complete:
                roster.joins = {}
        declarations = roster.declarations
        assert declarations is not None
        # every server has it in its engines' rings before anything that follows: the declarations that complete
        # now, and (once all have joined) the workers' next pushes, which must not be taken for joined ones'
        for server in servers:
            if not declarations.call(server.rank, messages.Joined(ranks=sorted(joined))):
                log.warning("server %d did not confirm the joined workers %s", server.rank, sorted(joined))
        declarations.set_joined(joined)
        return complete, waiting


def departed(workers: list[Node]) -> str:
    ranks = ", ".join(str(w.rank) for w in workers)
    return (
        f"worker {ranks} left the job (called shutdown()) and will never enter this barrier: every worker must "
        "reach the same barriers before shutting down"
    )
