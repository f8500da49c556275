"""Recovery: a scheduler that starts into a running job (its process restarted at the same address) rebuilds the job
from the nodes' reports, and the job goes on (docs/faults.md, "The scheduler").

While no scheduler runs, workers and servers keep their links and the data path goes on; a node whose scheduler
connection drops tries to reach one again for GRADWIRE_SCHEDULER_TIMEOUT, and opens with RESUME instead of REGISTER:
its role, rank, the term and epoch it knows, and its report. Where the scheduler's state comes back from:

- ranks, roles, addresses: each node's RESUME (what its REGISTER said, and the rank it holds);
- the epoch: the highest reported; the term: one past the highest reported (every node refuses an older term's
  scheduler from then on: `Resumed`);
- the address book (servers' addresses and which are lost, placement weights, the data path's settings): the
  workers' books, which every worker holds alike;
- declarations and placements: the workers' tensor tables (each tensor's signature, partition size and servers); a
  tensor some worker had its answer for is taken as placed, and the others' requests for it are answered as any late
  declaration; one no worker had its answer for is declared again by their requests;
- replicas: the servers' (which keys each forwards to which server);
- barriers passed: the workers' counts (a barrier answered to some workers only is answered to the rest at once);
- servers lost: a server no longer reporting, which a worker reports it lost its link to, is failed over once the job
  is rebuilt (the scheduler and a server dying together);
- a server failover under way (the scheduler died failing a server over): the latest REPLACE some worker applied, and
  what each such worker holds of the moved keys now; the workers not told are told, and the seeding is done again (a
  seed the server no longer needs is dropped). A standby it had promoted that no worker knows of is a standby again;
- a re-cut under way (scheduler/adapt.py): the RETUNE some worker applied goes to the others; if none applied one, the
  held calls are released by a cancel; re-cuts go on numbered after the latest.

Nothing is kept outside the nodes: whatever the scheduler held that they do not is either derived again from what
they report (the placement's loads, the bytes the workers copy for a failover) or history (/status's records).
"""

from __future__ import annotations

import logging
import threading

from gradwire.errors import GradwireError
from gradwire.protocol import messages
from gradwire.protocol.messages import decode
from gradwire.scheduler import rendezvous, unfinished
from gradwire.scheduler.lease import Proof
from gradwire.scheduler.node import Node
from gradwire.scheduler.roster import Roster, server_entry
from gradwire.transport import tcp
from gradwire.tuning import Tuning

log = logging.getLogger("gradwire.scheduler")
# what a scheduler process prints, then its term, once it has resumed a running job: the launchers read from it which
# process is in charge (launch/cli.py prints it)
RESUMED_LINE = "gradwire scheduler resumed the job in term "


class Absent:
    """The connection of a node that did not report (a server that died with the scheduler): nothing reaches it."""

    peer = "absent"

    def send_message(self, message: messages.Message) -> None:
        raise GradwireError("this node did not report to the recovering scheduler")

    def close(self) -> None:
        pass


class Recovery:
    """The reports of a job being recovered; complete once every worker and every live server has reported, or
    GRADWIRE_HEARTBEAT_TIMEOUT after the first report (then a missing worker ends the job, a missing server is failed
    over, and in an elastic job a missing worker is taken as lost while GRADWIRE_MIN_WORKERS remain). `lost`: the
    servers the scheduler is to fail over once the job is rebuilt, and why; `left`: the workers it is to re-form the
    job without (elastic).

    A standby scheduler (GRADWIRE_STANDBY) first waits for its proof that the scheduler it replaces can no longer act:
    a majority of the job's nodes free of their promise to it (scheduler/lease.py); its deadline runs from then."""

    def __init__(self, roster: Roster) -> None:
        self.roster = roster
        self.active = False  # a RESUME came first: this scheduler recovers a running job
        self.done = threading.Event()
        self.started = 0.0
        self.proof = Proof(roster.config) if roster.config.standby else None
        self.taken_over = self.proof is None  # a standby: once its proof holds
        self.record: dict = {}  # what was recovered, and from whom (/status)
        self._reports: dict[tuple[str, int], tuple[Node, messages.Resume]] = {}
        self._standby: list[tuple[Node, messages.Resume]] = []
        self.lost: list[tuple[Node, str]] = []
        self.left: list[tuple[Node, str]] = []
        # a server failover the last scheduler left under way: its REPLACE, what each worker it told holds, and the
        # workers it did not tell
        self.under_way: tuple[messages.Replace, dict[int, dict], list[int]] | None = None
        # the latest re-cut's number, and if one was left under way: the RETUNE to send and the workers to send it to
        self.recut: tuple[int, messages.Retune | None, list[int]] = (0, None, [])

    def report(self, conn: tcp.Connection, resume: messages.Resume, now: float) -> Node:
        """A node's RESUME: its node; the rebuild runs when this report completes the job's (then `done` is set)."""
        registration = decode(messages.Register, resume.registration | {"op": messages.Register.op})
        assert isinstance(registration, messages.Register)
        node = rendezvous.node_of(conn, registration, now)
        node.rank, conn.peer_rank = resume.rank, resume.rank
        roster = self.roster
        with roster.lock:
            if self.done.is_set():
                return self._late_locked(node, resume)
            if not self.active:
                self.active, self.started = True, now
                log.warning("a running job: recovering it from its nodes' reports")
            if node.standby:
                self._standby.append((node, resume))
            else:
                self._reports[(resume.role, resume.rank)] = (node, resume)
                if self.proof is not None:
                    self.proof.report((resume.role, resume.rank), resume.report, now)
            if self._ready_locked(now):
                self._rebuild_locked(now)
        return node

    def withdraw(self, node: Node) -> bool:
        """`node` went away before the job was rebuilt: its report no longer counts. False if it is not reporting."""
        with self.roster.lock:
            if not self.active or self.done.is_set():
                return False
            self._standby = [(n, r) for n, r in self._standby if n is not node]
            for key, (reported, _) in list(self._reports.items()):
                if reported is node:
                    del self._reports[key]
                    if self.proof is not None:
                        self.proof.withdraw(key)
            return True

    def _ready_locked(self, now: float) -> bool:
        """Every report is in, and (a standby) the scheduler it replaces can no longer act."""
        if not self.taken_over:
            assert self.proof is not None
            voters = self._voters()
            if not self.proof.holds(voters, now):
                return False
            self.taken_over, self.started = True, now
            log.warning(
                "standby: %d of the job's %d nodes are free of the scheduler they lost: taking the job over",
                *(self.proof.count(voters, now), len(voters)),
            )
        return not self._missing_locked()

    def _voters(self) -> list[tuple[str, int]]:
        """The job's workers and live servers, as the latest address book tells (lease.py's majority is of these)."""
        book = self._book()
        if not book:
            return []
        voters = [("worker", r) for r in range(int(book["num_workers"]))]
        return voters + [("server", s) for s, e in enumerate(book.get("servers") or []) if not e.get("lost")]

    def check_deadline(self, now: float) -> None:
        """Past GRADWIRE_HEARTBEAT_TIMEOUT from the first report, go on with the nodes that reported."""
        roster = self.roster
        timeout = roster.config.heartbeat_timeout or roster.config.timeout
        with roster.lock:
            if not self.active or self.done.is_set():
                return
            if self._ready_locked(now):
                self._rebuild_locked(now)
                return
            if not self.taken_over or now - self.started < timeout:
                return
            missing = self._missing_locked()
            workers = [r for role, r in missing if role == "worker"]
            config, book = roster.config, self._book()
            elastic = bool(book) and 0 < config.min_workers <= int(book["num_workers"]) - len(workers)
            if workers and not elastic:
                roster.nodes = [n for n, _ in [*self._reports.values(), *self._standby]]  # those told why
                roster.abort_locked(
                    f"recovering the job after the scheduler's restart: worker(s) {workers} did not report within "
                    f"{timeout:g}s",
                    lost=("worker", workers[0]),
                )
                return
            self._rebuild_locked(now)

    def _late_locked(self, node: Node, resume: messages.Resume) -> Node:
        """A report after the job was rebuilt: a standby joins the standby servers (also one the last scheduler
        promoted before any worker was told: `_promoted_unknown`); anyone else was taken as lost."""
        roster = self.roster
        if resume.role == "server" and not node.standby and resume.rank < len(roster.servers):
            node.standby = not _at(node, server_entry(roster.servers[resume.rank]))
        if not node.standby:
            raise GradwireError(f"{resume.role} {resume.rank} reported after the job was recovered without it")
        self.roster.standby.append(node)
        self.roster.nodes.append(node)
        node.conn.send_message(messages.Resumed(self.roster.term, self.roster.epoch))
        return node

    def _book(self) -> dict:
        """The address book of the worker that knows the latest epoch."""
        workers = [r for (role, _), (_, r) in self._reports.items() if role == "worker"]
        if not workers:
            return {}
        return max(workers, key=lambda r: r.epoch).report.get("book") or {}

    def _missing_locked(self) -> list[tuple[str, int]]:
        """The workers and live servers that have not reported yet (as far as the reports so far tell)."""
        voters = self._voters()
        if not voters:  # no worker's book yet
            return [("worker", 0)]
        # lost as the latest book's epoch knows the servers (a worker not told of a failover under way says it lost
        # the dead server, whose place a standby may have taken since)
        epoch = max(r.epoch for _, r in self._reports.values() if r.role == "worker")
        said_lost = {
            int(s)
            for _, r in self._reports.values()
            if r.role == "worker" and r.epoch == epoch
            for s in r.report.get("lost", [])
        }
        expected = [(role, rank) for role, rank in voters if not (role == "server" and rank in said_lost)]
        return [k for k in expected if k not in self._reports]

    def _rebuild_locked(self, now: float) -> None:
        """Every report is in (or the deadline passed): the roster, the declarations, the term."""
        roster, reports, book = self.roster, self._reports, self._book()
        roster.epoch = max(r.epoch for _, r in [*reports.values(), *self._standby])
        roster.term = max(r.term for _, r in [*reports.values(), *self._standby]) + 1
        roster.workers = [self._worker(r, book) for r in range(int(book["num_workers"]))]
        roster.servers = [self._server(s, entry) for s, entry in enumerate(book["servers"])]
        roster.standby = [n for n, _ in self._standby]
        roster.nodes = [n for n, _ in reports.values()] + roster.standby
        roster.placement_info = book.get("placement") or {}
        roster.tuning = Tuning.from_dict(book.get("tuning"))
        weights = roster.placement_info.get("weights") or [1.0] * len(roster.servers)
        declarations = roster.declarations = rendezvous.declarations_for(roster, weights)
        for s, server in enumerate(roster.servers):
            if server.lost:
                declarations.placement.remove(s)
                declarations.abandon(s)
        replicas = self._replicas()
        tensors = self._tensors()
        workers = [r for (role, _), (_, r) in reports.items() if role == "worker"]
        self.under_way = unfinished.failover(workers)
        self.recut = unfinished.recut(workers, roster.tuning)
        for rank, declare, pbytes, servers, held in tensors.values():
            declarations.restore(rank, declare, pbytes, servers, replicas, held)
        roster.barriers_passed = max(
            int(r.report.get("barriers", 0)) for _, r in reports.values() if r.role == "worker"
        )
        self._keep_record_locked(now, len(tensors))
        for node in roster.nodes:
            # heard from now on: a node waiting for RESUMED sends nothing (it reported up to a timeout ago); its
            # promise to this scheduler starts with RESUMED (lease.py)
            node.heard = node.last_seen = node.answered = now
        # the servers first: a worker told it may go on declares at once, and the new scheduler then sends the keys to
        # their servers, which must have had their RESUMED before (a server waiting for it refused the keys message as
        # a scheduler's wrong answer: the declaration was answered without that server's keys)
        servers_first = sorted(roster.nodes, key=lambda node: node.role == "worker")
        roster.tell(servers_first, messages.Resumed(roster.term, roster.epoch))
        self.done.set()

    def _keep_record_locked(self, now: float, tensors: int) -> None:
        """What was recovered, and from whom (/status `recovered`), also said in the log."""
        roster, reports = self.roster, self._reports
        seconds = now - self.started
        self.record = {
            "term": roster.term,
            "epoch": roster.epoch,
            "seconds": round(seconds, 3),
            "reported": sorted(f"{role} {rank}" for role, rank in reports)
            + [f"standby {n.host}" for n in roster.standby],
            "tensors": tensors,
            "barriers_passed": roster.barriers_passed,
            "servers_lost": [n.rank for n, _ in self.lost],
            "failover_under_way": self.under_way[0].server if self.under_way else None,
            "recut_under_way": self.recut[0] if self.recut[1] is not None else None,
            "workers_lost": [n.rank for n, _ in self.left],
        }
        log.warning(
            "recovered the job in %.1f s (term %d, epoch %d) from %s: %d workers, %d servers, %d tensors, %d barriers "
            "passed; servers to fail over: %s; a failover to complete: %s; a re-cut to end: %s",
            *(seconds, roster.term, roster.epoch, ", ".join(self.record["reported"]), len(roster.workers)),
            *(len(roster.servers), tensors, roster.barriers_passed, self.record["servers_lost"] or "none"),
            "none" if self.under_way is None else f"server {self.under_way[0].server}",
            self.record["recut_under_way"] or "none",
        )

    def _worker(self, rank: int, book: dict) -> Node:
        """Worker `rank` of the rebuilt roster: its report's node, or (it did not report: an elastic job goes on
        without it) a node nothing reaches, to be taken as lost."""
        reported = self._reports.get(("worker", rank))
        if reported is not None:
            return reported[0]
        hosts = book.get("workers") or []
        host = hosts[rank] if rank < len(hosts) else "?"
        node = Node(Absent(), "worker", rank, host, 0, rank=rank)  # type: ignore[arg-type]
        self.left.append((node, "it died while the scheduler was away (it did not report to the new one)"))
        return node

    def _server(self, rank: int, entry: dict) -> Node:
        """Server `rank` of the rebuilt roster: its report's node, or (it did not report) a node nothing reaches,
        lost already or to be failed over."""
        reported = self._reports.get(("server", rank))
        if reported is not None and not self._promoted_unknown(reported, entry):
            return reported[0]
        node = Node(Absent(), "server", rank, entry["host"], int(entry["port"]), rank=rank)  # type: ignore[arg-type]
        node.colocated, node.host_id = bool(entry.get("colocated")), str(entry.get("host_id", ""))
        node.slot_bytes, node.unix = int(entry.get("slot_bytes", 0)), str(entry.get("unix", ""))
        if entry.get("lost"):
            node.lost = True
        else:
            self.lost.append((node, "it died while the scheduler was away (it did not report to the new one)"))
        return node

    def _promoted_unknown(self, reported: tuple[Node, messages.Resume], entry: dict) -> bool:
        """Whether the server reporting rank `entry`'s is not at its address: a standby that the last scheduler
        promoted to it before any worker was told (it died in between). It is a standby again, and the rank's server
        is failed over anew (to it, as the first standby)."""
        node, resume = reported
        if _at(node, entry):
            return False
        log.warning("server %d at %s:%d: a standby promoted that no worker knows of", node.rank, node.host, node.port)
        del self._reports[("server", node.rank)]
        node.standby = True
        self._standby.insert(0, (node, resume))
        return True

    def _replicas(self) -> dict[int, int]:
        """key -> the server that keeps its last answered round, as the servers report it."""
        out: dict[int, int] = {}
        for (role, rank), (_, resume) in self._reports.items():
            if role == "server":
                for key in resume.report.get("kept", []):
                    out[int(key)] = rank
        return out

    def _tensors(self) -> dict[str, tuple[int, messages.Declare, int, list[int], bool]]:
        """Every tensor some worker has its declaration's answer for: (the rank that reported it first, its
        declaration, its partition size, its servers, whether its sums are held).

        Workers agree on each, but for a failover some of them were not told of (unfinished.py): the placement is
        that of the workers that know the latest epoch."""
        out: dict[str, tuple[int, messages.Declare, int, list[int], bool]] = {}
        workers = [(rank, r) for (role, rank), (_, r) in self._reports.items() if role == "worker"]
        for rank, resume in sorted(workers, key=lambda w: (-w[1].epoch, w[0])):  # a failover's REPLACE first
            for t in resume.report.get("tensors", []):
                declare = decode(messages.Declare, t["declare"] | {"op": messages.Declare.op, "id": 0})
                assert isinstance(declare, messages.Declare)
                if declare.name not in out:
                    servers = [int(s) for s in t["servers"]]
                    out[declare.name] = (rank, declare, int(t["partition_bytes"]), servers, bool(t.get("held")))
        return out


def _at(node: Node, entry: dict) -> bool:
    """Whether a reporting server `node` is where the address book's `entry` says that rank's server is."""
    return (node.host, node.port) == (entry["host"], int(entry["port"]))
