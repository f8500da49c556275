"""The job's scheduler processes under `gradwire launch`: the scheduler and its standbys (--standby-schedulers).

Without standbys, a scheduler that dies while the job runs is started again at its address and resumes the job from
the nodes' reports (scheduler/recovery.py). With standbys, the nodes report to the next standby instead, which takes
the job over once a majority of them have (scheduler/lease.py); a new standby is then started at the dead one's
address, so the job always has one. Either way at most --max-restarts times.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import time
from collections.abc import Callable

from gradwire.config import env_for
from gradwire.launch.child import Child
from gradwire.launch.output import how
from gradwire.scheduler.recovery import RESUMED_LINE

ARGV = [sys.executable, "-m", "gradwire", "scheduler"]
START_SECONDS = 30.0  # how long a scheduler process gets to print its address
ADMIN = "gradwire scheduler admin on "  # the line with a scheduler's admin URL (launch/cli.py)
# after the scheduler ended the job cleanly, how long a replacement still starting gets before it is stopped (one that
# had registered is told at once that the job ended; one still connecting would wait for GRADWIRE_TIMEOUT)
REPLACEMENT_GRACE_SECONDS = 2.0


def is_scheduler(child: Child) -> bool:
    return child.role.endswith("scheduler")


class Schedulers:
    """Starts the scheduler processes, says which is in charge (`in_charge`), and replaces those that die."""

    def __init__(
        self,
        spawn: Callable[[str, int, list[str], dict[str, str]], Child],
        say: Callable[[str], None],
        host: str,
        standby: int,
        restarts: int,
    ) -> None:
        self.spawn, self.say, self.host = spawn, say, host
        self.num_standby, self.restarts = standby, restarts
        self.in_charge: Child | None = None
        self._admin: dict[int, str] = {}  # by child, each scheduler process's admin URL
        self.standby_addresses: list[str] = []
        self._addresses: dict[int, str] = {}  # by child, each scheduler process's address

    def start(self) -> tuple[str | None, Child]:
        """The standbys first (the scheduler must know it has some), then the scheduler. Returns its address (None if
        it did not start; then the child that did not: the launcher reports it) and the child."""
        for r in range(1, self.num_standby + 1):
            extra = env_for(role="scheduler", scheduler=f"{self.host}:0", standby=True)
            child = self.spawn("standby scheduler", r, ARGV, extra)
            address = self._await_address(child)
            if address is None:
                return None, child
            self.standby_addresses.append(address)
        extra = env_for(role="scheduler", scheduler=f"{self.host}:0") | self.standby_env()  # it has standbys
        primary = self.spawn("scheduler", 0, ARGV, extra)
        self.in_charge = primary
        return self._await_address(primary), primary

    def standby_env(self) -> dict[str, str]:
        """The environment that tells every node where the standbys are."""
        return env_for(scheduler_standby=",".join(self.standby_addresses)) if self.standby_addresses else {}

    @property
    def admin_url(self) -> str | None:
        """The admin endpoint of the scheduler in charge (None: it has none)."""
        return self._admin.get(id(self.in_charge))

    def heard(self, child: Child, line: str) -> None:
        """A line of a scheduler process: its admin URL; the one that says it resumed the job is in charge from now
        on."""
        if line.startswith(ADMIN):
            self._admin[id(child)] = line.split(" on ", 1)[1].split()[0]
        elif line.startswith(RESUMED_LINE) and child is not self.in_charge:
            self.in_charge = child
            if self.admin_url:
                self.say(f"{child.label} is in charge now; status: {self.admin_url}/status")

    def replace(self, dead: Child, job_done: bool) -> bool:
        """A scheduler process exited: started again at its address (without standbys), or a new standby started there
        (with them), while the job runs and restarts are left. False if it is not replaced."""
        code = dead.proc.returncode
        if code == 0 or job_done or self.restarts <= 0:
            return False
        self.restarts -= 1
        address = self._addresses[id(dead)]
        if self.num_standby:
            self.say(
                f"{dead.label} {how(code)} (pid {dead.proc.pid}); starting a new standby scheduler at {address}"
                + ("; the nodes report to the next standby, which takes the job over" if dead is self.in_charge else "")
            )
            self._start_at("standby scheduler", dead.rank, address, standby=True)
            return True
        self.say(
            f"scheduler {how(code)} (pid {dead.proc.pid}); restarting it at {address}: the job's nodes go on "
            "training and report to it"
        )
        admin = self.admin_url.rsplit(":", 1)[1] if self.admin_url else "-1"
        self.in_charge = self._start_at("scheduler", 0, address, admin=admin)
        return True

    def ended_cleanly(self) -> bool:
        """The scheduler in charge ended the job without an error, or does within a moment."""
        if self.in_charge is None:
            return False
        try:
            return self.in_charge.proc.wait(REPLACEMENT_GRACE_SECONDS) == 0
        except subprocess.TimeoutExpired:
            return False

    def idle(self, child: Child) -> bool:
        """A standby that never took the job over: it does not end by itself."""
        return is_scheduler(child) and child is not self.in_charge

    def _start_at(self, role: str, rank: int, address: str, standby: bool = False, admin: str = "0") -> Child:
        extra = env_for(role="scheduler", scheduler=address, standby=standby) | {"GRADWIRE_ADMIN_PORT": admin}
        child = self.spawn(role, rank, ARGV, extra)
        self._addresses[id(child)] = address
        return child

    def _await_address(self, child: Child) -> str | None:
        """The address in a scheduler's first line (and its admin URL on the next: `heard` keeps it)."""
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            try:
                line = child.lines.get(timeout=0.1)
            except queue.Empty:
                if child.proc.poll() is not None:
                    return None
                continue
            if line.startswith("gradwire ") and " listening on " in line:
                address = self._addresses[id(child)] = line.split(" listening on ", 1)[1].split()[0]
                try:  # the admin URL follows on the next line, unless the endpoint is off
                    child.lines.get(timeout=2)
                except queue.Empty:
                    pass
                return address
        return None
