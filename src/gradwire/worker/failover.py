"""A worker's side of server failover (docs/faults.md). Every link keeps each key's last answered round (`Seed`,
worker/work.py) and, when its server dies, everything unanswered. The scheduler moves the dead server's keys (to a
standby at the same index, or onto the survivors) and says so (REPLACE); the worker re-routes, resends what was not
answered, reports per moved key what it holds, and seeds the rounds that the dead server answered to some workers
only, where the scheduler asks (SEED; every worker gets one, most of them empty, when the failover is over).
"""

from __future__ import annotations

import logging
import threading
import time

from gradwire.errors import GradwireError, JobAborted
from gradwire.protocol import messages
from gradwire.protocol.frames import AVERAGED, REPLAY, SEED
from gradwire.tuning import Tuning
from gradwire.worker.connecting import Connecting, LinkHooks
from gradwire.worker.control import Control
from gradwire.worker.holding import release
from gradwire.worker.link import ServerLink
from gradwire.worker.native_path import NativePath
from gradwire.worker.recut import Retuning
from gradwire.worker.state import SHUTDOWN_JOIN_SECONDS, WorkerState
from gradwire.worker.tensors import TensorTable
from gradwire.worker.work import Seed, Work

log = logging.getLogger("gradwire.worker")
SEED_PRIORITY = 1 << 62  # seeds leave a new link before anything else


class Failover:
    def __init__(
        self, state: WorkerState, table: TensorTable, control: Control, retuning: Retuning, connecting: Connecting
    ) -> None:
        self.state = state
        self.table = table
        self.control = control
        self.retuning = retuning
        self.connecting = connecting
        seeds: dict[int, Seed] | None = {} if state.config.server_failover else None
        on_lost = self.on_link_lost if seeds is not None else None
        self.hooks = LinkHooks(seeds, on_lost, self.resubmit)  # every link's (connecting.py)
        self.records: list[dict] = []  # what happened at each failover, for status and tests
        self._lock = threading.Lock()  # one failover at a time
        # when the link to each server died (wall clock), until it is failed over: for the record, and the report
        self.lost_at: dict[int, float] = {}
        # the latest REPLACE, the keys it moved, and whether the scheduler's SEED of its epoch said it is over: a
        # scheduler that resumes the job before every worker's is completes it (worker/report.py, recovery.py)
        self._last: tuple[messages.Replace, list[int]] | None = None
        self._over = False
        # held partitions the dead servers had answered (worker/holding.py): done once the failover is over, when
        # every seed their outputs were asked for has been sent
        self._holding: list[tuple[ServerLink, list[tuple[Work, Seed]]]] = []
        self._native_holding: list[int] = []  # the same on the native path: the dead links whose held parts wait

    @property
    def seeds(self) -> dict[int, Seed]:
        return self.hooks.seeds if self.hooks.seeds is not None else {}

    def on_link_lost(self, link: ServerLink, error: BaseException) -> None:
        """A server's connection died (a link thread calls this once): tell the scheduler, keep the work."""
        if self.state.closed:  # shutting down: servers close connections after our bye
            return
        self.lost_at[link.server] = time.time()
        log.warning(
            "worker %d lost server %d (%s): %s; its unanswered partitions wait for the scheduler to move its keys",
            self.state.rank,
            link.server,
            link.conn.peer,
            error,
        )
        self.control.send(messages.ServerLost(link.server, link.epoch, str(error)))

    def on_replace(self, body: messages.Replace) -> None:
        """REPLACE: the scheduler moved a dead server's keys (to a standby at the same index, or onto the survivors).

        The dead link is retired (its submits redirected) only after the new owners are known. Then the worker tells
        the scheduler, per moved key, the round of the sum it holds and the round it resends; the scheduler asks one
        holder to seed each round that another worker still waits for (`on_seed`), so seeds move only where the dead
        server died mid-answer.
        """
        state = self.state
        started, told_at = time.monotonic(), time.time()
        dead, state.epoch = body.server, body.epoch
        self.retuning.retune(Tuning.from_dict(body.tuning))
        old, native = state.links[dead], self._native()
        with self._lock:
            if native is not None:  # the native loop keeps the dead link's parts (worker/native_path.py)
                orphans, pending = [], native.detach(dead)
                self._native_holding.append(dead)
            else:
                orphans = old.detach(SHUTDOWN_JOIN_SECONDS)
                self._holding.append((old, old.holds.take_all()))
            standby = body.standby
            if standby and not self._replace_link(dead, standby):
                return
            moved = {str(name): [int(s) for s in servers] for name, servers in body.moved.items()}
            if state.book is not None:  # as a scheduler that resumes the job must learn it (worker/report.py)
                state.book.servers[dead] = dict(standby) if standby else state.book.servers[dead] | {"lost": True}
                state.book.epoch = state.epoch
            with state.lock:
                moved_keys = self.table.move(moved, dead)
                self.table.unreplicate()
            if native is None:
                orphans += old.retire(self.resubmit)
            seeded = self._seed_state(moved_keys)
            if native is not None:
                with state.lock:
                    owners = {key: self.table.owner[key] for key in moved_keys if key in self.table.owner}
                native.reroute(dead, owners)
            else:
                pending = {w.key: w.round for w in orphans}
                for work in orphans:
                    self.resubmit(work, 0)
            held = self._held(moved_keys, pending)
            self._last, self._over = (body, moved_keys), False
        # even empty: the scheduler waits for every worker's report
        self.control.send(messages.FailoverReport(state.epoch, held))
        record = {
            "server": dead,
            "epoch": state.epoch,
            "standby": bool(standby),
            "resent": len(pending),
            "seeds": seeded,  # parameters resent for a server-side optimizer; plus on_seed's, if any
            "seconds": time.monotonic() - started,
            "lost_at": self.lost_at.pop(dead, None),  # wall clock: when this worker saw the connection die
            "told_at": told_at,  # when the scheduler's REPLACE arrived
        }
        self.records.append(record)
        where = "to a standby" if standby else "onto the surviving servers"
        log.warning(
            "worker %d: server %d's keys moved (%s); resent %d partitions in %.1f ms",
            *(state.rank, dead, where, len(pending), record["seconds"] * 1e3),
        )

    def _replace_link(self, dead: int, standby: dict) -> bool:
        """A link to the standby that took server `dead`'s place; False (and every call failed) if unreachable."""
        state = self.state
        try:
            link = state.links[dead] = self.connecting.link(dead, standby, self.hooks)
            link.start()
            native = self._native()
            if native is not None:
                native.replace(dead, link)
        except (GradwireError, OSError) as e:
            error = JobAborted(f"worker {state.rank} cannot reach standby server {dead}: {e}", rank=state.rank)
            self.control.fail_all(error)
            return False
        return True

    def _native(self) -> NativePath | None:
        """The native data path, where it moves this worker's bytes: it keeps the seeds and the lost parts."""
        native = self.state.native
        return native if isinstance(native, NativePath) else None

    def latest(self) -> dict | None:
        """The latest failover this worker was in, for a scheduler that resumes the job (worker/report.py): the
        REPLACE it applied; per moved key, what it holds and what it waits for now (as FAILOVER_STATE says); and
        whether the scheduler's SEED of that epoch said it is over. None if there was none."""
        with self._lock:
            if self._last is None:
                return None
            body, moved_keys = self._last
            native = self._native()
            if native is not None:
                waiting = native.unanswered(moved_keys)
            else:
                waiting = {}
                for link in list(self.state.links):
                    if isinstance(link, ServerLink):
                        waiting |= link.unanswered(moved_keys)
            return {"replace": body.fields(), "held": self._held(moved_keys, waiting), "over": self._over}

    def _held(self, moved_keys: list[int], pending: dict[int, int]) -> dict[str, list[int]]:
        """Per moved key: [the round of the sum held, the round resent (`pending`: key -> the round waited for),
        whether what is held is this worker's contribution] (the scheduler's FAILOVER_STATE: who seeds what,
        docs/faults.md)."""
        kept = self._kept(moved_keys)
        return {
            str(k): [kept[k][0] if k in kept else -1, pending.get(k, -1), int(k in kept and kept[k][1])]
            for k in moved_keys
            if k in kept or k in pending
        }

    def kept_bytes(self) -> int:
        """The bytes this worker keeps of its keys' last answered rounds for a failover (held outputs not counted:
        they are the calls' own)."""
        native = self._native()
        if native is not None:
            return native.seed_bytes()
        return sum(seed.data.nbytes for seed in list(self.seeds.values()) if not seed.held)

    def _kept(self, keys: list[int]) -> dict[int, tuple[int, bool]]:
        """Of `keys`, those whose last answered round this worker keeps: key -> (the round, whether it is this
        worker's contribution rather than the sum)."""
        native = self._native()
        if native is not None:
            return native.seeds(keys)
        seeds = self.seeds
        return {k: (seeds[k].round, seeds[k].contribution) for k in keys if k in seeds}

    def _seed_state(self, keys: list[int]) -> int:
        """Resend the parameters this worker holds of every moved key whose servers hold state (parameter-server
        mode, docs/ps-mode.md), ahead of its resent pushes: the new server starts from them."""
        with self.state.lock:
            stateful = self.table.stateful_keys()
        kept = self._kept(keys)
        return sum(self._seed(key, kept[key][0]) for key in keys if key in stateful and key in kept)

    def on_seed(self, body: messages.Reseed) -> None:
        """SEED: resend the sums (or, for sliced keys, the contributions) the scheduler asked for: a round another
        worker still waits for. One already replaced by a later round's is not needed any more: that later round could
        only complete once everyone had this one."""
        kept = self._kept([int(k) for k, _ in body.keys])
        asked = [(int(k), int(rnd)) for k, rnd in body.keys if int(k) in kept and kept[int(k)][0] == int(rnd)]
        sent = sum(self._seed(key, rnd) for key, rnd in asked)
        with self._lock:
            over = self._last is not None and self._last[0].epoch <= body.epoch
            if over:
                self._over = True  # every worker gets its SEED (most an empty one) when the failover is over
            holding, self._holding = (self._holding, []) if over else ([], self._holding)
            native_holding, self._native_holding = (self._native_holding, []) if over else ([], self._native_holding)
        for link, held in holding:  # the seeds asked of their outputs are sent: the calls may complete
            for work in release(held, self.seeds):
                link.finish_held(work)
        native = self._native()
        for dead in native_holding if native is not None else ():
            native.finish_held(dead)
        if self.records:
            self.records[-1]["seeds"] += sent
        if body.keys:
            log.warning("worker %d: seeded %d sums the new servers' workers were waiting for", self.state.rank, sent)

    def _seed(self, key: int, rnd: int) -> bool:
        """Send the sum this worker holds of `key`'s round `rnd` to the key's server, flagged SEED (its contribution
        to a sliced round: REPLAY); False if it holds none (or the key has no server)."""
        with self.state.lock:
            server = self.table.owner.get(key)
        if server is None or rnd < 0:
            return False
        native = self._native()
        if native is not None:
            return native.push_seed(key, rnd, server)
        seed = self.seeds[key]
        flag = REPLAY if seed.contribution else SEED | (AVERAGED if seed.averaged else 0)
        data = seed.data.copy() if seed.held else seed.data  # a call's output: it may complete before this is sent
        work = Work("", key, seed.round, seed.dtype, data, data, 1, None, seed=flag)
        self.state.links[server].submit(work, SEED_PRIORITY)
        return True

    def fail_held(self, error: GradwireError) -> None:
        """The job re-forms (elastic): the held partitions of a failover under way fail with their calls."""
        with self._lock:  # (the native path's fail with its loop, which the re-forming stops)
            holding, self._holding, self._native_holding = self._holding, [], []
        for _, held in holding:
            for work in release(held, self.hooks.seeds):
                if work.handle is not None:
                    work.handle.fail(error)

    def resubmit(self, work: Work, priority: int) -> None:
        """Push a partition again, to its key's server now."""
        with self.state.lock:
            server = self.table.owner[work.key]
        self.state.links[server].submit(work, priority)
