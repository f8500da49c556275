"""Server failover (GRADWIRE_SERVER_FAILOVER, docs/faults.md). A server that dies (its connection drops, it falls
silent, or a worker reports it) is failed over: the epoch goes up, its keys go to a standby (at the same index) or are
re-placed on the surviving servers, and every worker is told (REPLACE) so it can resend what the server had not
answered. Each worker then reports what it holds of the moved keys, and the rounds that the dead server answered to
some workers only are seeded from them (`seeds_needed`). With no server left to take the keys, the job aborts naming
the server.
"""

from __future__ import annotations

import logging
import threading
import time

from gradwire.errors import GradwireError
from gradwire.protocol import messages
from gradwire.scheduler import moves
from gradwire.scheduler.adapt import Adaptation
from gradwire.scheduler.node import Node
from gradwire.scheduler.roster import Roster, server_entry

log = logging.getLogger("gradwire.scheduler")


class Failover:
    def __init__(self, roster: Roster, adaptation: Adaptation) -> None:
        self.roster = roster
        self.adaptation = adaptation
        self.records: list[dict] = []  # one per failover: server, epoch, where its keys went, duration
        # epoch -> (set once every live worker reported, {worker rank: {key: (round held, round resent)}})
        self._states: dict[int, tuple[threading.Event, dict[int, dict]]] = {}

    def possible_locked(self, node: Node) -> bool:
        """Whether server `node`'s keys would have somewhere to go."""
        roster = self.roster
        live = [s for s in roster.live_servers() if s is not node]
        return roster.config.server_failover and roster.declarations is not None and bool(live or roster.standby)

    def server_lost(self, node: Node, why: str) -> None:
        """A server is gone: fail it over (in a thread of its own: it waits on the new owners), or abort."""
        roster = self.roster
        with roster.lock:
            if node.lost or node.said_bye or roster.over():
                return
            if node in roster.standby:  # an idle standby: nothing to move
                node.lost = True
                roster.standby.remove(node)
                log.warning("standby server at %s lost: %s", node.host, why)
                return
            node.lost = True
            if not self.possible_locked(node):
                roster.abort_locked(f"lost server {node.rank} at {node.host}: {why}", lost=("server", node.rank))
                return
            roster.epoch += 1
            standby = roster.standby.pop(0) if roster.standby else None
            if standby is not None:
                standby.rank = node.rank
                standby.standby = False
                standby.since_epoch = roster.epoch
                roster.servers[node.rank] = standby
            epoch = roster.epoch
        assert roster.declarations is not None
        roster.declarations.abandon(node.rank)  # what waits on the dead server's replies goes on without them
        node.conn.close()  # fence it: a server the workers cannot reach must not go on summing
        threading.Thread(
            target=self._fail_over, args=(node, standby, epoch, why), name="gw-sched-failover", daemon=True
        ).start()

    def reported(self, node: Node, state: messages.FailoverReport) -> None:
        """A worker's FAILOVER_STATE: per moved key, the round of the sum it holds and the round it resends."""
        with self.roster.lock:
            entry = self._states.get(state.epoch)
            if entry is not None:
                everyone, reported = entry
                reported[node.rank] = held_of(state.keys)
                self._everyone_in_locked(everyone, reported)

    def _fail_over(self, dead: Node, standby: Node | None, epoch: int, why: str) -> None:
        roster = self.roster
        started = roster.clock()
        log.warning("lost server %d at %s (%s): failing over in epoch %d", dead.rank, dead.host, why, epoch)
        try:
            moved, address = self._move_keys(dead, standby, epoch)
        except (GradwireError, ValueError) as e:
            roster.abort(f"lost server {dead.rank} at {dead.host} ({why}) and could not fail over: {e}")
            return
        with roster.lock:
            settings = self.adaptation.retune_locked(f"server {dead.rank} lost")
        body = messages.Replace(epoch, dead.rank, moved, address, settings and settings.as_dict())
        with roster.lock:
            workers = roster.live_workers()
        seeded = self._complete(body, workers, {})
        to, seconds = self._record(body, seeded, started, why)
        log.warning("server %d failed over to %s in %.1f ms (epoch %d)", dead.rank, to, seconds * 1e3, epoch)

    def resume(self, body: messages.Replace, held: dict[int, dict], untold: list[int]) -> None:
        """A failover the scheduler before this one had begun and not finished (scheduler/recovery.py): its keys have
        moved; `held` (worker rank -> what it holds, as FAILOVER_STATE says) are the workers it told, `untold` the
        workers it did not: they are told now, and the rounds the dead server answered to some workers only are
        seeded (again: a stale seed is dropped by the server)."""
        roster = self.roster
        started = roster.clock()
        with roster.lock:
            workers = [w for w in roster.live_workers() if w.rank in untold]
        log.warning(
            "completing the failover of server %d (epoch %d) that the last scheduler began: told %s, telling %s",
            *(body.server, body.epoch, sorted(held) or "none", untold or "none"),
        )
        self._record(body, self._complete(body, workers, held), started, "completed after the scheduler's death")

    def _record(self, body: messages.Replace, seeded: int, started: float, why: str) -> tuple[str, float]:
        """Keep the record of the failover `body` told (for /status); returns where the keys went, and its seconds."""
        to, seconds = "standby" if body.standby else "survivors", self.roster.clock() - started
        record = {"server": body.server, "epoch": body.epoch, "seeds": seeded, "to": to}
        self.records.append(record | {"tensors_moved": len(body.moved), "seconds": seconds, "why": why})
        return to, seconds

    def _complete(self, body: messages.Replace, workers: list[Node], held: dict[int, dict]) -> int:
        """Tell `workers` the keys have moved (REPLACE); once every live worker has reported what it holds (`held`:
        those that have already), seed what some wait for that others hold, and tell every worker the failover is
        over (a SEED each, most empty). Returns the seeds asked for."""
        roster, epoch = self.roster, body.epoch
        everyone, reported = threading.Event(), dict(held)
        with roster.lock:
            self._states[epoch] = (everyone, reported)
            self._everyone_in_locked(everyone, reported)
        roster.tell(workers, body)  # a worker that cannot be told is lost, which its own connection reports
        # every worker reports, per moved key, the round of the sum it holds and the round it resends; a round that
        # one worker resends and others hold the sum (or their contributions) of was being answered when the server
        # died: seed it (or replay them)
        deadline = time.monotonic() + min(roster.config.timeout, 60)
        while not everyone.wait(0.1) and not roster.done.is_set() and time.monotonic() < deadline:
            pass
        if not everyone.is_set():
            log.warning("not every worker reported its state after the failover in epoch %d", epoch)
        with roster.lock:
            self._states.pop(epoch, None)
            seeds = seeds_needed(dict(reported))
            live = roster.live_workers()
        for worker in live:
            roster.tell([worker], messages.Reseed(epoch, seeds.get(worker.rank, [])))
        return sum(len(k) for k in seeds.values())

    def _everyone_in_locked(self, everyone: threading.Event, reported: dict) -> None:
        if len(reported) >= len(self.roster.live_workers()):
            everyone.set()

    def _move_keys(self, dead: Node, standby: Node | None, epoch: int) -> tuple[dict, dict | None]:
        """Move the dead server's keys: to their replicas where they have one, the rest to the standby (promoted
        here) or onto the survivors. Returns the tensors moved and the standby's address (None: survivors)."""
        declarations = self.roster.declarations
        assert declarations is not None
        with declarations.moving:  # declarations answered meanwhile wait: their keys may be moving
            # keys whose optimizer state the dead server held go to their replica, which has it (server/replica.py)
            moved = moves.move_to_replicas(declarations, dead.rank)
            if standby is None:
                return moved | moves.evict(declarations, dead.rank), None
            # confirmed before the workers hear of it: they connect to it at once, and a standby not yet promoted
            # refuses them (the dead server's keys may all have gone to replicas: nothing else to wait on)
            promote = messages.Promote(rank=dead.rank, epoch=epoch)
            declarations.revive(dead.rank)
            if not declarations.call(dead.rank, promote):
                raise GradwireError(f"the standby taking server {dead.rank}'s place did not confirm its promotion")
            moves.register_all(declarations, dead.rank)
            return moved, server_entry(standby)


def seeds_needed(reported: dict[int, dict[int, tuple[int, int, bool]]]) -> dict[int, list[list[int]]]:
    """{worker: [[key, round], ...]} to seed: for each moved key, a round some worker resends while others hold
    what they got of it (the dead server answered some workers only). A holder of the sum: one seeds it, the lowest
    rank. Holders of only their contributions (a sliced key, whose ranks each pull a slice): every one replays its
    own, and with the waiting workers' resent pushes the round is whole again."""
    out: dict[int, list[list[int]]] = {}
    keys = {k for state in reported.values() for k in state}
    for key in sorted(keys):
        waiting = {state[key][1] for state in reported.values() if key in state and state[key][1] >= 0}
        for rnd in sorted(waiting):
            holders = sorted(r for r, state in reported.items() if key in state and state[key][0] == rnd)
            sums = [r for r in holders if not reported[r][key][2]]
            for rank in sums[:1] or holders:
                out.setdefault(rank, []).append([key, rnd])
    return out


def held_of(keys: dict) -> dict[int, tuple[int, int, bool]]:
    """A FAILOVER_STATE's keys as `seeds_needed` reads them: key -> (round held, round resent, a contribution)."""
    return {int(k): (int(v[0]), int(v[1]), bool(v[2])) for k, v in keys.items()}
