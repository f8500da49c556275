"""Who acts for a job that has standby schedulers (GRADWIRE_SCHEDULER_STANDBY): the scheduler's lease, each node's
promise, and a standby's proof that the scheduler it replaces can no longer act. No outside service is needed: the job's
own workers and servers are the voters (a leader lease, as Raft's leader and Chubby's master hold theirs).

- The scheduler sends every node a BEAT each beat interval, noting when it sent it; a node answers with the same beat
  at once. The scheduler holds its lease until LEASE (half of GRADWIRE_HEARTBEAT_TIMEOUT) after the latest beat that a
  majority of the job's nodes answered on connections still open. It acts (answers a declaration, a barrier, a
  failover, any request) only while it holds the lease, and steps down for good the moment it finds it lost.
- A node's promise (`client.Promise`): having answered a beat at (its own) time t, it counts toward another
  scheduler's takeover only from t + LEASE + MARGIN; at once if the connection was closed from the scheduler's end (its
  process ended, or it closed it: either way the scheduler no longer counts this node).
- A standby takes the job over only once a majority of the job's nodes have reported to it with their promises over.

A lease runs from a beat's sending and a promise from its receipt, later, so the two cannot overlap unless the clocks'
rates differ by more than MARGIN over LEASE (a half). Any two majorities share a node, so no two schedulers ever act
for the job at once: one cut off from the others steps down before any standby takes over, and a node refuses an older
term's scheduler (`Resumed`). The reasoning, and what this does not cover, is in docs/faults.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from gradwire.config import Config
from gradwire.protocol import messages
from gradwire.scheduler.node import Node
from gradwire.scheduler.roster import Roster

log = logging.getLogger("gradwire.scheduler")


def lease_seconds(config: Config) -> float:
    return config.heartbeat_timeout / 2


def margin_seconds(config: Config) -> float:
    return config.heartbeat_timeout / 4


def beat_seconds(config: Config) -> float:
    """How often the scheduler beats: every heartbeat interval, and at least four times a timeout."""
    return min(config.heartbeat_interval, config.heartbeat_timeout / 4)


def majority(count: int) -> int:
    return count // 2 + 1


class Lease:
    """The scheduler's side: its beats, the nodes' answers (`Node.answered`: when the latest beat a node answered was
    sent), and whether it holds the lease. Off (always held) in a job without standby schedulers."""

    def __init__(self, roster: Roster) -> None:
        self.roster = roster
        self.on = roster.config.leased
        self._seq = 0
        self._sent: dict[int, float] = {}  # beat -> when it was sent, while it can still count

    def beat(self) -> None:
        """Send the next beat to every voter (`voters`)."""
        roster = self.roster
        now = roster.clock()
        with roster.lock:
            self._seq += 1
            self._sent[self._seq] = now
            horizon = now - lease_seconds(roster.config)
            self._sent = {seq: at for seq, at in self._sent.items() if at >= horizon}
            voters = self.voters()
        roster.tell(voters, messages.Beat(seq=self._seq))

    def answered(self, node: Node, beat: messages.Beat) -> None:
        sent = self._sent.get(beat.seq)
        if sent is not None:
            node.answered = max(node.answered, sent)

    def voters(self) -> list[Node]:
        """The job's workers and live servers that have not left it (a node that said bye votes for nobody)."""
        roster = self.roster
        nodes: Iterable[Node] = [*roster.workers, *roster.servers]
        return [n for n in nodes if not (n.lost or n.said_bye)]

    def held(self, now: float | None = None) -> bool:
        """Whether this scheduler may act for the job now. Outside a running job (the rendezvous, a recovery under
        way, the end) nothing is at stake: held."""
        roster = self.roster
        if not self.on or roster.declarations is None or roster.over():
            return True
        fresh, voters = self._fresh(now)
        return len(fresh) >= majority(len(voters)) if voters else True

    def why_lost(self, now: float | None = None) -> str:
        fresh, voters = self._fresh(now)
        return (
            f"only {len(fresh)} of the job's {len(voters)} nodes answered its beats in the last "
            f"{lease_seconds(self.roster.config):g}s ({', '.join(f'{n.role} {n.rank}' for n in fresh) or 'none'}): "
            "a standby may take the job over"
        )

    def _fresh(self, now: float | None) -> tuple[list[Node], list[Node]]:
        """The voters that answered a beat sent within the lease, on a connection still open; and all the voters."""
        roster = self.roster
        now = roster.clock() if now is None else now
        horizon = now - lease_seconds(roster.config)
        voters = self.voters()
        return [n for n in voters if n.answered > horizon and not n.conn_closed()], voters


class Proof:
    """A standby's: when each reporting node's promise to the scheduler it lost is over, by this scheduler's clock."""

    def __init__(self, config: Config) -> None:
        self.wait = lease_seconds(config) + margin_seconds(config)
        self.free_at: dict[tuple[str, int], float] = {}

    def report(self, key: tuple[str, int], report: dict, now: float) -> None:
        promise = report.get("scheduler") or {}
        if promise.get("dropped"):
            self.free_at[key] = now
            return
        since = float(promise.get("since_beat", 0.0))
        self.free_at[key] = now + max(0.0, self.wait - since)

    def withdraw(self, key: tuple[str, int]) -> None:
        self.free_at.pop(key, None)

    def holds(self, voters: list[tuple[str, int]], now: float) -> bool:
        """A majority of `voters` (the job's workers and live servers) are free of their promise."""
        return bool(voters) and self.count(voters, now) >= majority(len(voters))

    def count(self, voters: list[tuple[str, int]], now: float) -> int:
        """How many of `voters` are free of their promise."""
        return sum(1 for key in voters if self.free_at.get(key, float("inf")) <= now)
