"""Observability across real processes: Ctrl-C leaves valid timelines; the launcher and `gradwire top` show status."""

import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from gradwire.testing import LocalCluster
from tests.multiprocess.harness import ROOT

pytestmark = pytest.mark.multiprocess

LOOP = """
import numpy as np, gradwire as gw
gw.init()
print("READY", flush=True)
while True:
    gw.push_pull(np.ones(200_000, np.float32), name="g")
"""


def test_ctrl_c_leaves_a_valid_timeline_per_worker(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    trace = tmp_path / "trace.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradwire", "launch", "-n", "2", "-s", "1", "--", sys.executable, str(script)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**__import__("os").environ, "GRADWIRE_TIMELINE": str(trace), "GRADWIRE_PARTITION_BYTES": "65536"},
    )
    seen, lines = 0, []
    deadline = time.monotonic() + 60
    while seen < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        seen += "READY" in line
    assert seen == 2, "".join(lines)
    time.sleep(2.5)  # the writer rewrites each file about once a second
    proc.send_signal(signal.SIGINT)
    out = "".join(lines) + proc.communicate(timeout=30)[0]
    assert proc.returncode == 130, out
    assert "status: http://127.0.0.1:" in out and "gradwire top http://" in out
    for rank in (0, 1):
        events = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())["traceEvents"]
        assert {e["name"] for e in events if e["ph"] == "X"} == {"queued", "push", "wait", "pull"}


def test_top_renders_a_running_job():
    with LocalCluster(num_workers=2, num_servers=1, heartbeat_interval=0.2) as c:
        c.run(lambda w: w.push_pull(np.ones(1000, np.float32), "top"))
        time.sleep(0.5)
        out = subprocess.run(
            [sys.executable, "-m", "gradwire", "top", "--once", c.scheduler.admin_url],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert out.returncode == 0, out.stderr
    assert "phase running" in out.stdout and "healthy" in out.stdout
    for node in ("worker 0", "worker 1", "server 0"):
        assert node in out.stdout
    # the settings derived from the links measured at the start, and why: on loopback, partitions of megabytes (how
    # many depends on the rate this loaded machine measured, 9-20 Gbit/s: 2 or 4 MiB; under another job's load the
    # probe has read a few Gbit/s: 512 KiB)
    chosen = re.search(r"data path: (\d+) KiB partitions, window (\d+): (\d+) Mbit/s", out.stdout)
    assert chosen is not None, out.stdout
    # the window: at least two partitions per server (partitions of megabytes already hold 128 KiB per worker)
    assert int(chosen[1]) >= 256 and int(chosen[2]) >= 2 and int(chosen[3]) > 1000
