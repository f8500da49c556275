"""examples/deploy/slurm.sbatch, run as Slurm would on two nodes: a stand-in `srun` starts its torchrun line once per
node (here both on this machine), with the variables Slurm sets; `scontrol` names the head node."""

import os
import socket
import stat
import subprocess
import sys
import uuid

import pytest

from tests.multiprocess.harness import ROOT

pytestmark = pytest.mark.multiprocess

SRUN = """#!/bin/bash
# one task per node, all at once, as srun does; each with its own SLURM_PROCID
for i in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_PROCID=$i SLURM_NODEID=$i "$@" & done
wait_all=0; for job in $(jobs -p); do wait "$job" || wait_all=1; done; exit $wait_all
"""
SCONTROL = "#!/bin/bash\necho 127.0.0.1\n"


def test_the_sbatch_script_runs_a_two_node_job(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    (bin_dir / "torchrun").symlink_to(os.path.join(os.path.dirname(sys.executable), "torchrun"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADWIRE_", "DMLC_"))} | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[0-1]",
        "SLURM_JOB_ID": marker,
        "RDZV_PORT": str(port),
        "PYTHONUNBUFFERED": "1",
    }
    job = str(ROOT / "tests" / "multiprocess" / "torchrun_job.py")
    done = subprocess.run(
        ["bash", str(ROOT / "examples" / "deploy" / "slurm.sbatch"), job, marker],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        assert f"DONE rank {rank} of 2 with 2 servers {marker}" in done.stdout, done.stdout + done.stderr
