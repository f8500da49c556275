"""torchrun starts everything: a script that calls nothing but gradwire.init() gets a scheduler (from global rank 0)
and a server per node (from each local rank 0), and nothing is left running after the job."""

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.multiprocess.harness import ROOT

pytestmark = pytest.mark.multiprocess
JOB = str(ROOT / "tests" / "multiprocess" / "torchrun_job.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _env():
    # as a user's shell would have it: no GRADWIRE_* set
    return {k: v for k, v in os.environ.items() if not k.startswith(("GRADWIRE_", "DMLC_"))} | {"PYTHONUNBUFFERED": "1"}


def _run(cmds, timeout=120, env=None):
    procs = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=_env() | (env or {}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for cmd in cmds
    ]
    outputs = []
    for i, proc in enumerate(procs):
        try:
            outputs.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"torchrun {i} hung past {timeout}s") from None
        assert proc.returncode == 0, outputs[-1]
    return "\n".join(outputs)


def _children_gone(output, timeout=10.0):
    # each process prints its children twice (after the first allreduce, and at its end): each pid once
    pids = sorted({int(p) for line in output.splitlines() if "CHILDREN" in line for p in line.split() if p.isdigit()})
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and "State:\tZ" not in _status(p)]
        time.sleep(0.1)
    return pids, alive


def _status(pid):
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "State:\tZ"


def _c10d_node(marker: str, *flags: str) -> list[str]:
    """One node's torchrun command (one process per node) with a c10d rendezvous on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = TORCHRUN + [*flags, "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    return node + ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", marker, JOB, marker]


def test_torchrun_standalone_needs_nothing_but_init():
    marker = uuid.uuid4().hex
    output = _run([TORCHRUN + ["--standalone", "--nproc-per-node", "2", JOB, marker]])
    for rank in range(2):
        assert f"DONE rank {rank} of 2 with 1 servers {marker}" in output, output
    pids, alive = _children_gone(output)
    assert len(pids) == 2 and not alive, (pids, alive, output)  # the scheduler and the node's server, both ended


def test_torchrun_two_nodes_with_c10d_rendezvous():
    marker = uuid.uuid4().hex
    node = _c10d_node(marker, "--nnodes", "2")
    output = _run([node, node])
    for rank in range(2):
        assert f"DONE rank {rank} of 2 with 2 servers {marker}" in output, output  # one server per node
    pids, alive = _children_gone(output)
    assert len(pids) == 3 and not alive, (pids, alive, output)  # a scheduler and two servers


def test_torchrun_max_restarts_starts_a_new_job_after_a_worker_dies():
    """Elastic torchrun: worker 1 dies mid-job; torchrun stops the group and starts it again (`--max-restarts`);
    gradwire.init() in the new attempt starts a new job (its own scheduler and server) that completes, and the dead
    attempt's scheduler and server end too."""
    marker = uuid.uuid4().hex
    cmd = TORCHRUN + ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", JOB, marker]
    output = _run([cmd], env={"CRASH_RANK": "1"})
    assert "CRASH rank 1 in attempt 0" in output, output
    for rank in range(2):
        assert f"DONE rank {rank} of 2 with 1 servers {marker} in attempt 1" in output, output
    pids, alive = _children_gone(output, timeout=30)
    assert len(pids) == 4 and not alive, (pids, alive, output)  # both attempts' scheduler and server, all ended


def test_torchrun_elastic_node_range_with_c10d_rendezvous():
    """`--nnodes 1:2`: the nodes that arrive within the rendezvous form the job (here both)."""
    marker = uuid.uuid4().hex
    node = _c10d_node(marker, "--nnodes", "1:2", "--max-restarts", "1")
    output = _run([node, node])
    for rank in range(2):
        assert f"DONE rank {rank} of 2 with 2 servers {marker}" in output, output
    pids, alive = _children_gone(output)
    assert len(pids) == 3 and not alive, (pids, alive, output)


def test_torchrun_restarts_a_killed_scheduler_and_the_job_goes_on():
    """Rank 0 SIGKILLs the scheduler it started: the process that started it starts it again at its port, the job
    resumes (term 2) and ends cleanly; nothing is left running."""
    marker = uuid.uuid4().hex
    output = _run([TORCHRUN + ["--standalone", "--nproc-per-node", "2", JOB, marker]], env={"KILL_SCHEDULER": "1"})
    for rank in range(2):
        assert f"DONE rank {rank} of 2 with 1 servers {marker}" in output, output
        assert f"TERM rank {rank} 2" in output, output
    pids, alive = _children_gone(output)
    assert len(set(pids)) == 3 and not alive, (pids, alive, output)  # two schedulers (one killed) and the server


def test_torchrun_two_nodes_with_a_standby_scheduler_on_the_second():
    """GRADWIRE_STANDBY_SCHEDULERS=1: the second node starts a standby scheduler; rank 0 SIGKILLs the scheduler, the
    standby takes the job over (term 2), and a new standby starts in the dead one's place; nothing is left running."""
    marker = uuid.uuid4().hex
    node = _c10d_node(marker, "--nnodes", "2")
    output = _run([node, node], env={"KILL_SCHEDULER": "1", "GRADWIRE_STANDBY_SCHEDULERS": "1"})
    for rank in range(2):
        assert f"DONE rank {rank} of 2 with 2 servers {marker}" in output, output
        assert f"TERM rank {rank} 2" in output, output
    pids, alive = _children_gone(output)
    assert len(set(pids)) == 5 and not alive, (pids, alive, output)  # 2 servers, 2 schedulers, the new standby
