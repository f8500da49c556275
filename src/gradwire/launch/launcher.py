"""`gradwire launch`: a whole job on this machine, with every output line prefixed by role and rank.

The launcher starts the scheduler first and reads its address from its first line of output, then the
servers and the workers with the environment set (GRADWIRE_*, horovodrun's HOROVOD_RANK/SIZE/LOCAL_RANK/...,
and torchrun's RANK/WORLD_SIZE/LOCAL_RANK
for scripts that read them). It makes a fresh job secret and hands it over in the environment. It exits
with the first failing worker's code after stopping the rest; Ctrl-C (or SIGTERM) stops everything.
Children run in their own sessions, so a terminal's Ctrl-C reaches only the launcher, which then stops
them in order; nothing is left behind.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from http.client import HTTPException

from gradwire.config import env_for, worker_env
from gradwire.launch.child import Child
from gradwire.launch.output import consequence, how, make_output, progress_line
from gradwire.launch.schedulers import REPLACEMENT_GRACE_SECONDS, Schedulers, is_scheduler

GRACE_SECONDS = 5.0
DRAIN_SECONDS = 1.0  # after the last worker exits, how long the services get to end by themselves
SURVIVOR_SECONDS = 3.0  # after a worker fails, how long the others get to report it themselves (WorkerLost)
PROGRESS_SECONDS = 2.0


class Launcher:
    """Starts, watches and stops the processes of one job."""

    def __init__(
        self,
        num_workers: int,
        num_servers: int,
        command: list[str],
        host: str = "127.0.0.1",
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        standby: int = 0,
        min_workers: int = 0,
        max_workers: int = 0,
        max_restarts: int = 3,
        colocate: bool = False,
        standby_schedulers: int = 0,
    ) -> None:
        if not command:
            raise SystemExit("gradwire launch: give the worker command after --, e.g. -- python train.py")
        self.num_workers, self.num_servers, self.command, self.host = num_workers, num_servers, command, host
        self.num_standby = standby
        self.colocate = colocate
        self.min_workers, self.max_workers, self.restarts_left = min_workers, max_workers or num_workers, max_restarts
        # a scheduler that dies while the job runs is started again, or a standby takes over (launch/schedulers.py)
        self.schedulers = Schedulers(self._spawn, self._say, host, standby_schedulers, max_restarts)
        self._next_worker = num_workers  # the label of the next replacement
        self.base_env = dict(os.environ if env is None else env)
        self.base_env |= env_for(
            num_workers=num_workers,
            num_servers=num_servers + (num_workers if colocate else 0),
            num_standby=standby,
            min_workers=min_workers,
            max_workers=max_workers,
            host=host,
            secret=secrets.token_hex(32),
        )
        self.base_env["PYTHONUNBUFFERED"] = "1"
        if timeout is not None:
            self.base_env |= env_for(timeout=timeout)
        self.children: list[Child] = []
        self.admin_url: str | None = None
        self._finished = threading.Event()
        self._exits: queue.SimpleQueue[Child] = queue.SimpleQueue()
        # elastic: when the job's work was done (a worker finished, or the scheduler ended it cleanly), and the
        # replacements started for dead workers (stopped if the job ends before they join)
        self._done_by: str | None = None
        self._ended_at: float | None = None
        self._replacements: set[int] = set()
        self.out = make_output()

    def run(self) -> int:
        """Run the job to its end; returns the exit code for the launcher."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        except KeyboardInterrupt:
            self._say("interrupted: stopping every process")
            return 130
        finally:
            self._stop_all()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    def _spawn_servers(self) -> None:
        """The dedicated servers, a colocated one per worker (--colocate), and the standby servers."""
        for r in range(self.num_servers):
            self._spawn(
                "server",
                r,
                [sys.executable, "-m", "gradwire", "server"],
                env_for(role="server", rank=r),
            )
        for r in range(self.num_workers if self.colocate else 0):
            self._spawn(
                "colocated server",
                r,
                [sys.executable, "-m", "gradwire", "server"],
                env_for(role="server", rank=self.num_servers + r, colocated=True),
            )
        for r in range(self.num_standby):
            self._spawn(
                "standby",
                r,
                [sys.executable, "-m", "gradwire", "server"],
                env_for(role="server", standby=True),
            )

    def _run(self) -> int:
        address, scheduler = self.schedulers.start()
        if address is None:
            return self._report(scheduler, "did not start")
        self.admin_url = self.schedulers.admin_url
        self.base_env |= env_for(scheduler=address) | self.schedulers.standby_env()
        standby = f" (+{self.num_standby} standby)" if self.num_standby else ""
        standbys = ", ".join(self.schedulers.standby_addresses)
        self._say(
            f"scheduler at {address}{f' (standby schedulers at {standbys})' if standbys else ''}; "
            f"starting {self.num_servers} servers{standby}"
            f"{f' + {self.num_workers} colocated' if self.colocate else ''} and {self.num_workers} workers"
        )
        if self.admin_url:
            self._say(
                f"status: {self.admin_url}/status  metrics: {self.admin_url}/metrics  "
                f"watch: gradwire top {self.admin_url}"
            )
            threading.Thread(target=self._progress, name="gw-progress", daemon=True).start()
        self._spawn_servers()
        for r in range(self.num_workers):
            self._spawn("worker", r, self.command, worker_env(r, self.num_workers))
        return self._watch()

    def _watch(self) -> int:
        # Exits arrive in the order they happened (a waiter thread per child), so the worker named is the
        # one that failed first, not the survivors that exited a moment later because it was gone.
        running = {id(c) for c in self.children if c.role == "worker"}
        while running:
            try:
                child = self._exits.get(timeout=0.5)  # a timeout keeps Ctrl-C deliverable
            except queue.Empty:
                self._stop_unneeded_replacements()
                continue
            code = child.proc.returncode
            if is_scheduler(child) and self.schedulers.replace(child, self._done_by is not None):
                continue
            if child.role != "worker":
                if code != 0:
                    self._say(f"{child.label} {how(code)} (pid {child.proc.pid}){consequence(child.role)}")
                elif is_scheduler(child):
                    self._ended_at = time.monotonic()
                    self._done_by = self._done_by or "the scheduler ended the job"
                continue
            running.discard(id(child))
            if id(child) in self._replacements and code != 0 and self._ended_cleanly():
                self._say(f"{child.label} was not needed: the job ended before it joined")
                continue
            if code == 0:
                self._done_by = self._done_by or f"{child.label} finished"
                continue
            if code < 0 and self.min_workers and (self._done_by or len(running) >= self.min_workers):
                self._elastic_loss(child, running)
                continue
            code = self._report(child, "failed")
            self._let_survivors_report(running)
            return code
        self._drain_services()
        return 0

    def _ended_cleanly(self) -> bool:
        """The scheduler ended the job without an error, or does within a moment: a replacement that registered as
        the job ended is told so, and may exit before the scheduler does."""
        clean = self.schedulers.ended_cleanly()
        if clean and self._ended_at is None:
            self._ended_at = time.monotonic()
        return clean

    def _stop_unneeded_replacements(self) -> None:
        """The job ended cleanly while replacements were still waiting to join it: they never will."""
        if self._ended_at is None or time.monotonic() - self._ended_at < REPLACEMENT_GRACE_SECONDS:
            return
        for child in self.children:
            if id(child) in self._replacements and child.proc.poll() is None:
                _signal_group(child.proc, signal.SIGTERM)

    def _elastic_loss(self, child: Child, running: set[int]) -> None:
        """Elastic, a worker killed by a signal: the job goes on with the others; a replacement joins while restarts
        and --max-workers allow, and the job's work is not done yet (docs/faults.md has which exits are recovered)."""
        if self._done_by is not None:
            self._say(
                f"{child.label} {how(child.proc.returncode)} (pid {child.proc.pid}) after the job's work was done "
                f"({self._done_by}); no replacement"
            )
            return
        self._say(
            f"{child.label} {how(child.proc.returncode)} (pid {child.proc.pid}); the job goes on with "
            f"{len(running)} workers (elastic, --min-workers {self.min_workers})"
        )
        if self.restarts_left <= 0 or len(running) >= self.max_workers:
            return
        self.restarts_left -= 1
        label = self._next_worker
        self._next_worker += 1
        self._say(f"starting worker {label} to join the job")
        extra = env_for(role="worker", local_rank=label) | {"LOCAL_RANK": str(label)}
        replacement = self._spawn("worker", label, self.command, extra, unset=("GRADWIRE_RANK", "RANK", "HOROVOD_RANK"))
        running.add(id(replacement))
        self._replacements.add(id(replacement))

    def _let_survivors_report(self, running: set[int]) -> None:
        """The other workers learn of the failure within milliseconds (WorkerLost names the rank) and exit with
        that message; give them a moment to print it before everything is stopped."""
        deadline = time.monotonic() + SURVIVOR_SECONDS
        while running and time.monotonic() < deadline:
            try:
                child = self._exits.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            running.discard(id(child))

    def _drain_services(self) -> None:
        """Every worker process has exited: the services end by themselves at the workers' last bye, except after
        shutdown() calls, when they wait (GRADWIRE_REINIT_SECONDS) for an init() that can no longer come. A short
        wait, then `_stop_all` ends whatever is left."""
        deadline = time.monotonic() + DRAIN_SECONDS
        for child in self.children:
            if child.role != "worker" and not self.schedulers.idle(child):
                try:
                    child.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    return

    def _report(self, child: Child, what: str) -> int:
        code = child.proc.wait()
        exit_code = 128 - code if code < 0 else code or 1
        self._say(f"{child.label} {what}: it {how(code)} (pid {child.proc.pid}); the job stops")
        return exit_code

    def _spawn(
        self, role: str, rank: int, argv: list[str], extra: dict[str, str], unset: tuple[str, ...] = ()
    ) -> Child:
        env = {k: v for k, v in (self.base_env | extra).items() if k not in unset}
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        child = Child(role, rank, proc)
        self.children.append(child)
        threading.Thread(target=self._pump, args=(child,), name=f"gw-pump-{child.label}", daemon=True).start()
        threading.Thread(target=self._reap, args=(child,), name=f"gw-reap-{child.label}", daemon=True).start()
        return child

    def _reap(self, child: Child) -> None:
        child.proc.wait()
        self._exits.put(child)

    def _pump(self, child: Child) -> None:
        prefix = f"[{child.label}] "
        assert child.proc.stdout is not None
        for raw in iter(child.proc.stdout.readline, b""):
            text = raw.decode(errors="replace")
            if is_scheduler(child):
                self.schedulers.heard(child, text)
                child.lines.put(text)
            self.out.line(prefix + text)

    def _progress(self) -> None:
        """The live progress line, from the scheduler's /status every PROGRESS_SECONDS (see output.py)."""
        from gradwire.admin.top import fetch

        while not self._finished.wait(PROGRESS_SECONDS):
            try:  # the scheduler in charge's (a standby's, once it has taken over)
                status = fetch(self.schedulers.admin_url or "", timeout=2)
            except (OSError, HTTPException, ValueError):  # it died mid-answer, or is not up yet
                continue
            self.out.progress(f"[gradwire launch] {progress_line(status)}")

    def _stop_all(self) -> None:
        self._finished.set()
        self.out.close()
        alive = [c for c in self.children if c.proc.poll() is None]
        for child in alive:
            _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        for child in alive:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(child.proc, signal.SIGKILL)
                child.proc.wait()

    def _say(self, message: str) -> None:
        self.out.line(f"[gradwire launch] {message}")


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
