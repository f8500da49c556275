import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.multiprocess.harness import ROOT, launch, leftover_processes

JOB = str(ROOT / "tests" / "multiprocess" / "job.py")
pytestmark = pytest.mark.multiprocess


def test_four_workers_two_servers_over_real_tcp():
    marker = uuid.uuid4().hex
    result = launch(4, 2, JOB, "ok", marker)
    assert result.code == 0, result.output
    for r in range(4):
        assert result.lines(f"[worker {r}] DONE rank {r} of 4"), result.output
    assert result.lines("[scheduler] gradwire scheduler listening on 127.0.0.1:")
    assert not leftover_processes(marker)


def test_a_failing_worker_stops_the_job_with_its_exit_code():
    marker = uuid.uuid4().hex
    result = launch(3, 1, JOB, "fail1", marker)
    assert result.code == 3, result.output
    assert "worker 1 failed: it exited with code 3" in result.output
    assert not leftover_processes(marker)


def test_a_killed_worker_is_named_with_its_signal_and_nothing_is_left_behind():
    marker = uuid.uuid4().hex
    result = launch(3, 2, JOB, "kill1", marker)
    assert result.code == 137, result.output
    assert "worker 1 failed: it was killed by SIGKILL" in result.output
    assert not leftover_processes(marker)


def test_ctrl_c_stops_every_process(tmp_path):
    marker = uuid.uuid4().hex
    script = tmp_path / "sleepy.py"
    script.write_text("import time, gradwire as gw\ngw.init()\nprint('READY', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradwire", "launch", "-n", "2", "-s", "1", "--", sys.executable, str(script), marker],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = 0
    deadline = time.monotonic() + 30
    assert proc.stdout is not None
    while seen < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen += "READY" in line
    assert seen == 2, "workers never became ready"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, out
    assert "interrupted" in out
    assert not leftover_processes(marker), leftover_processes(marker)


def test_elastic_starts_no_replacement_once_a_worker_has_finished(tmp_path):
    """A worker that exits 0 has done the job's work: a worker killed after it is not replaced (a replacement would
    wait for a job that is ending), and the launcher exits 0 at once."""
    marker = uuid.uuid4().hex
    script = tmp_path / "ends.py"
    script.write_text(
        "import os, signal, time\n"
        "if os.environ['GRADWIRE_RANK'] == '1':\n"
        "    time.sleep(1.5)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    started = time.monotonic()
    result = launch(2, 1, str(script), marker, options=("--min-workers", "1", "--max-workers", "2"), timeout=30)
    assert result.code == 0, result.output
    assert "worker 1 was killed by SIGKILL" in result.output and "(worker 0 finished); no replacement" in result.output
    assert "starting worker" not in result.output, result.output
    assert time.monotonic() - started < 15
    assert not leftover_processes(marker)


def test_elastic_ends_the_job_on_a_worker_that_exits_with_an_error_code(tmp_path):
    """Only a worker killed by a signal (a crash, the OOM killer, a preempted host) is recovered from; one that exits
    with an error code failed in its own script, which a replacement would run into again: the job stops with it."""
    marker = uuid.uuid4().hex
    script = tmp_path / "fails.py"
    script.write_text("import os, sys, time\nif os.environ['GRADWIRE_RANK'] == '1':\n    sys.exit(3)\ntime.sleep(20)\n")
    result = launch(3, 1, str(script), marker, options=("--min-workers", "1", "--max-workers", "3"), timeout=30)
    assert result.code == 3, result.output
    assert "worker 1 failed: it exited with code 3" in result.output and "starting worker" not in result.output
    assert not leftover_processes(marker)
