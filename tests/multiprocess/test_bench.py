import json
import subprocess
import sys

import pytest

from tests.multiprocess.harness import ROOT

pytestmark = pytest.mark.multiprocess


def test_bench_json_has_both_systems_and_the_documented_fields():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradwire",
            "bench",
            "-n",
            "2",
            "-s",
            "1",
            "--sizes",
            "0.25",
            "--rounds",
            "1",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert {r["system"] for r in records} == {"gradwire", "gradwire-tcp", "gloo"}
    for r in records:
        assert {"system", "workers", "servers", "bytes", "seconds_median"} <= r.keys()
        assert r["workers"] == 2 and r["bytes"] == 1 << 18 and r["seconds_median"] > 0
