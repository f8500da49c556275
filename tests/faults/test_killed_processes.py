"""Real SIGKILLs in a real training run (`gradwire launch`, a torch MLP): a server at several points (the job
completes with parameters bit-identical to a run without the failure), and the scheduler (every node exits with
an error naming it, nothing is left running)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.multiprocess.harness import ROOT

pytestmark = pytest.mark.multiprocess
SCRIPT = str(ROOT / "tests" / "faults" / "training_job.py")
WORKERS, SERVERS = 3, 2


def _run(
    kill: str = "",
    kill_at: int | str = -1,
    wait: bool = False,
    standby: int = 0,
    timeout: float = 120,
    script: str = SCRIPT,
    options: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
    freeze: bool = False,
    gap: float = 0.0,
) -> dict:
    """Launch the job; when worker 0 prints KILL, SIGKILL the named process (`server 1`, `scheduler`: the one in
    charge; `server 1+scheduler`: both, `gap` seconds apart). `freeze`: SIGSTOP it instead (alive, its connections
    open, silent: as if cut off from the network), and SIGCONT it once another scheduler has resumed the job."""
    cmd = [sys.executable, "-m", "gradwire", "launch", "-n", str(WORKERS), "-s", str(SERVERS), *options]
    cmd += ["--standby-servers", str(standby), "--timeout", "30", "--", sys.executable, script]
    env = (
        os.environ
        | {
            "KILL_AT": str(kill_at),
            "KILL_ROLE": kill,
            "KILL_WAIT": "1" if wait else "0",
            "GRADWIRE_PARTITION_BYTES": "16384",  # ~20 partitions, on every server
            "GRADWIRE_HEARTBEAT_TIMEOUT": "10",
        }
        | (extra_env or {})
    )
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    pids: dict[str, int] = {}
    lines: list[str] = []
    killed: dict[str, float] = {}

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            found = re.search(r"^\[(\w+(?: \w+)*?(?: \d+)?)\] (?:gradwire .*\(pid (\d+)\)|PID (\d+))", line)
            if found:
                pids[found.group(1)] = int(found.group(2) or found.group(3))
            if found and "gradwire scheduler resumed the job" in line:  # the one in charge now
                pids["scheduler"] = int(found.group(2))
                if "frozen" in killed:
                    os.kill(int(killed.pop("frozen")), signal.SIGCONT)
            if line.startswith("[worker 0] KILL "):
                for n, name in enumerate(kill.split("+")):  # "server 1+scheduler": one, then `gap` s later the other
                    time.sleep(gap if n else 0.0)
                    os.kill(pids[name], signal.SIGSTOP if freeze else signal.SIGKILL)
                    killed[name] = time.monotonic()
                    if freeze:
                        killed["frozen"] = pids[name]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(5)
        assert proc.stdout is not None
        proc.stdout.close()
        done = {line.split("]")[0] + "]" for line in lines if "] DONE" in line}
        hung = sorted({f"[worker {r}]" for r in range(WORKERS)} - done)
        pytest.fail(f"job hung past {timeout}s; workers that never finished: {hung}\n{''.join(lines)}")
    reader.join(5)
    assert proc.stdout is not None
    proc.stdout.close()
    output = "".join(lines)
    alive = [label for label, pid in pids.items() if _alive(pid)]
    assert not alive, f"left running after the launcher exited: {alive}\n{output}"
    digests = {m.group(1): m.group(2) for m in re.finditer(r"^\[(worker \d+)\] DIGEST (\w+)", output, re.M)}
    failovers = {m.group(1): m.group(2) for m in re.finditer(r"^\[(worker \d+)\] FAILOVERS (.*)$", output, re.M)}
    return {"code": code, "output": output, "digests": digests, "failovers": failovers, "killed": killed}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie not yet reaped by its parent counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def reference() -> str:
    run = _run()
    assert run["code"] == 0, run["output"]
    (digest,) = set(run["digests"].values())
    assert len(run["digests"]) == WORKERS
    return digest


@pytest.mark.parametrize(
    ("kill_at", "wait", "standby", "hold"),
    [(3, True, 0, None), (12, False, 0, None), (12, False, 1, None), (3, True, 0, "1"), (3, True, 0, "0")],
    ids=[
        "others-mid-round-onto-survivors",
        "anywhere-onto-survivors",
        "anywhere-to-a-standby",
        "others-mid-round-held-in-the-outputs",
        "others-mid-round-onto-the-replicas",
    ],
)
def test_a_sigkilled_server_leaves_the_parameters_bit_identical(reference, kill_at, wait, standby, hold):
    # hold set: no sum copied on the workers (a budget of 0); each held in the call's output until every worker has it
    # ("1"), or kept by a replica server ("0") (docs/faults.md)
    budget = {"GRADWIRE_FAILOVER_COPY_BYTES": "0", "GRADWIRE_FAILOVER_HOLD": hold} if hold is not None else None
    run = _run("server 1", kill_at, wait, standby, extra_env=budget)
    out = run["output"]
    assert run["code"] == 0, out
    assert "server 1 was killed by SIGKILL" in out
    assert run["digests"] == {f"worker {r}": reference for r in range(WORKERS)}, out
    for r in range(WORKERS):  # every worker went through the failover (the kill did not land after training)
        assert run["failovers"][f"worker {r}"].startswith(f"[(1, {bool(standby)},"), out


@pytest.mark.parametrize("standby", [0, 1], ids=["onto-survivors", "with-a-standby"])
def test_a_sigkilled_server_in_parameter_server_mode_loses_nothing(reference, standby):
    """ServerOptimizer (SGD with momentum: the momentum lives on the servers only): server 1 is SIGKILLed mid-run;
    its keys go on on their replicas, and the parameters are bit-identical to DistributedOptimizer's failure-free
    run (the synchronous server-side step is)."""
    run = _run("server 1", 12, False, standby, extra_env={"OPTIMIZER": "server"})
    out = run["output"]
    assert run["code"] == 0, out
    assert "server 1 was killed by SIGKILL" in out
    assert run["digests"] == {f"worker {r}": reference for r in range(WORKERS)}, out


@pytest.mark.parametrize(
    ("kill_at", "optimizer"), [("5", ""), ("4,14", ""), ("6", "server")], ids=["once", "twice", "parameter-server"]
)
def test_a_sigkilled_scheduler_is_restarted_and_the_parameters_stay_bit_identical(reference, kill_at, optimizer):
    """`gradwire launch` starts a SIGKILLed scheduler again at its address; the nodes train on without it meanwhile,
    report to the new one, and the job ends with the failure-free run's parameters (scheduler/recovery.py)."""
    run = _run("scheduler", kill_at=kill_at, extra_env={"OPTIMIZER": optimizer} if optimizer else None)
    out = run["output"]
    assert run["code"] == 0, out
    kills = kill_at.count(",") + 1
    assert out.count("scheduler was killed by SIGKILL") == kills and out.count("restarting it at") == kills, out
    terms = re.findall(r"recovered the job in [\d.]+ s \(term (\d+)", out)
    assert terms == [str(t) for t in range(2, 2 + kills)], out
    assert run["digests"] == {f"worker {r}": reference for r in range(WORKERS)}, out


@pytest.mark.parametrize("gap", [0.0, 0.02, 0.2], ids=["together", "20ms-apart", "200ms-apart"])
def test_a_server_and_the_scheduler_sigkilled_together_lose_nothing(reference, gap):
    """Server 1 SIGKILLed, then the scheduler `gap` seconds later: before it noticed, while it failed the server over,
    or after. The restarted scheduler fails the server over, or completes the failover the dead one began, and the
    parameters equal the failure-free run's (scheduler/recovery.py)."""
    # each step stretched: the 35 steps after the kill outlast the gap (on the native data path they took under 0.2 s,
    # and the job ended before the scheduler died)
    run = _run("server 1+scheduler", kill_at=5, gap=gap, extra_env={"STEP_SLEEP": "0.02"})
    out = run["output"]
    assert run["code"] == 0, out
    assert "server 1 was killed by SIGKILL" in out and "scheduler was killed by SIGKILL" in out, out
    assert re.findall(r"recovered the job in [\d.]+ s \(term (\d+)", out) == ["2"], out
    assert run["digests"] == {f"worker {r}": reference for r in range(WORKERS)}, out
    for r in range(WORKERS):  # every worker went through the failover
        assert run["failovers"][f"worker {r}"].startswith("[(1, False,"), out


@pytest.mark.parametrize("kill_at", ["5", "4,14"], ids=["once", "twice"])
def test_a_sigkilled_scheduler_s_standby_takes_the_job_over_and_the_parameters_stay_bit_identical(reference, kill_at):
    """--standby-schedulers 1: the nodes report to the standby, which takes the job over once a majority of them have
    (their connections closed under them: the old one can no longer act); a new standby starts at the dead one's
    address, which takes over from the next (scheduler/lease.py)."""
    run = _run("scheduler", kill_at=kill_at, options=("--standby-schedulers", "1"))
    out = run["output"]
    assert run["code"] == 0, out
    kills = kill_at.count(",") + 1
    assert out.count("was killed by SIGKILL") == kills, out
    assert out.count("starting a new standby scheduler at") == kills, out
    assert out.count("taking the job over") == kills, out
    terms = re.findall(r"gradwire scheduler resumed the job in term (\d+)", out)
    assert terms == [str(t) for t in range(2, 2 + kills)], out
    assert run["digests"] == {f"worker {r}": reference for r in range(WORKERS)}, out


def test_a_scheduler_cut_off_alive_steps_down_and_only_its_standby_acts_for_the_job(reference):
    """The scheduler SIGSTOPped (alive, its connections open, silent), then woken once the standby has taken over: the
    nodes take it as lost after GRADWIRE_HEARTBEAT_TIMEOUT, the standby waits out their promises, and the old one,
    woken with their requests still queued on its sockets, finds its lease lost and steps down without answering any:
    one scheduler acts for the job at a time (scheduler/lease.py)."""
    # 4 s: a loaded machine can hold a node silent for 2 s (then it would leave a scheduler that is not cut off)
    beats = {"GRADWIRE_HEARTBEAT_TIMEOUT": "4", "GRADWIRE_HEARTBEAT_INTERVAL": "0.5"}
    run = _run("scheduler", kill_at=5, options=("--standby-schedulers", "1"), extra_env=beats, freeze=True)
    out = run["output"]
    assert run["code"] == 0, out
    assert re.search(r"\[scheduler\] .*scheduler of term 1 steps down: only \d of the job's 5 nodes", out), out
    assert "[gradwire launch] scheduler exited with code 3" in out, out
    assert re.findall(r"gradwire scheduler resumed the job in term (\d+)", out) == ["2"], out
    assert re.search(r"\[worker \d\] .*lost the scheduler \(timed out", out), out  # silence, not a closed socket
    assert run["digests"] == {f"worker {r}": reference for r in range(WORKERS)}, out


def test_a_sigkilled_scheduler_not_restarted_stops_every_node_with_an_error_naming_it():
    run = _run("scheduler", kill_at=5, options=("--max-restarts", "0"), extra_env={"GRADWIRE_SCHEDULER_TIMEOUT": "2"})
    out = run["output"]
    assert run["code"] != 0, out
    assert "scheduler was killed by SIGKILL" in out
    assert re.search(r"\[worker \d\] .*lost the scheduler.*no scheduler resumed the job", out), out


def test_elastic_training_goes_on_without_a_killed_worker_and_a_replacement_joins_with_the_state():
    elastic = str(ROOT / "tests" / "faults" / "elastic_job.py")
    run = _run("worker 2", kill_at=12, script=elastic, options=("--min-workers", "2", "--max-workers", "3"))
    out = run["output"]
    assert run["code"] == 0, out
    assert "worker 2 was killed by SIGKILL" in out and "the job goes on with 2 workers" in out, out
    assert "starting worker 3 to join the job" in out, out
    # the replacement started from the survivors' committed state, not from scratch
    joined = re.search(r"^\[worker 3\] START batch=(\d+) size=3", out, re.M)
    assert joined and int(joined.group(1)) > 12, out
    sizes = dict(re.findall(r"^\[(worker \d+)\] SIZES (.*)$", out, re.M))
    assert sizes["worker 0"] == "[3, 2, 3]" and sizes["worker 3"] == "[3]", out
    digests = {m.group(1): m.group(2) for m in re.finditer(r"^\[(worker \d+)\] DIGEST (\w+)", out, re.M)}
    assert set(digests) == {"worker 0", "worker 1", "worker 3"} and len(set(digests.values())) == 1, out


ELASTIC = ("--min-workers", "2", "--max-workers", "3")


def test_an_elastic_job_whose_script_raises_ends_naming_the_error_and_starts_no_replacement():
    """Worker 0's training script raises: a replacement would raise it too, so the job ends (no re-form, no
    replacement, no hang), every survivor names worker 0 and the exception, and the launcher exits non-zero."""
    elastic = str(ROOT / "tests" / "faults" / "elastic_job.py")
    started = time.monotonic()
    run = _run(script=elastic, options=ELASTIC, extra_env={"RAISE_AT": "12"}, timeout=60)
    out = run["output"]
    assert run["code"] == 1, out
    assert "worker 0 failed: it exited with code 1" in out and "starting worker" not in out, out
    for rank in (1, 2):  # the scheduler's abort names the failed worker and its exception
        assert re.search(
            rf"^\[worker {rank}\] .*worker 0 at .* failed: RuntimeError: a bug in the training script", out, re.M
        ), out
    assert time.monotonic() - started < 45, out


def test_a_worker_killed_after_the_work_is_done_ends_the_job_cleanly_without_a_replacement():
    """Worker 2 SIGKILLed once worker 0's training is over (the job is shutting down): its end is a departure (no
    re-form: the others would roll back and train again), the job ends cleanly, and a replacement the launcher started
    meanwhile (no worker had exited yet, so it could not know the work was done) is stopped as not needed. The launcher
    exits 0 within seconds; it hung before, its replacement waiting for a scheduler that had exited."""
    elastic = str(ROOT / "tests" / "faults" / "elastic_job.py")
    started = time.monotonic()
    run = _run("worker 2", kill_at="done", script=elastic, options=ELASTIC, timeout=60)
    out = run["output"]
    assert run["code"] == 0, out
    assert "worker 2 was killed by SIGKILL" in out and "re-formed" not in out and "aborted" not in out, out
    assert "[worker 0] DONE" in out and "[worker 1] DONE" in out, out
    assert "starting worker 3" not in out or "worker 3 was not needed: the job ended before it joined" in out, out
    assert len(set(run["digests"].values())) == 1, out
    assert time.monotonic() - started < 45, out
