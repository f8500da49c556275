"""The README's main command: the same CNN training with gradwire (4 workers, 2 servers) and with DDP over gloo.

make demo        (or: .venv/bin/python examples/digits_demo.py)
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = str(HERE / "digits_train.py")
WORKERS, SERVERS = 4, 2


def run(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    """Run a job, echo its output, and return rank 0's summary."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    summary = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if "SUMMARY " in line:
            summary = json.loads(line.split("SUMMARY ", 1)[1])
        else:
            print(line, end="", flush=True)
    if proc.wait() != 0 or summary is None:
        raise SystemExit(f"{' '.join(cmd[:6])}... failed with exit code {proc.returncode}")
    return summary


def run_ddp() -> dict:
    """DDP over gloo: WORKERS processes with torchrun's variables, rendezvous through a file."""
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        procs = []
        for r in range(1, WORKERS):
            env = os.environ | {"RANK": str(r), "WORLD_SIZE": str(WORKERS)}
            procs.append(
                subprocess.Popen(
                    [sys.executable, TRAIN, "--backend", "ddp", "--init", init], env=env, stdout=subprocess.DEVNULL
                )
            )
        summary = run(
            [sys.executable, TRAIN, "--backend", "ddp", "--init", init],
            env=os.environ | {"RANK": "0", "WORLD_SIZE": str(WORKERS)},
        )
        for proc in procs:
            if proc.wait() != 0:
                raise SystemExit(f"a DDP rank failed with exit code {proc.returncode}")
        return summary


def main() -> None:
    print(f"== gradwire: {WORKERS} workers, {SERVERS} summation servers ==", flush=True)
    gw = run(
        [
            sys.executable,
            "-m",
            "gradwire",
            "launch",
            "-n",
            str(WORKERS),
            "-s",
            str(SERVERS),
            "--",
            sys.executable,
            TRAIN,
            "--backend",
            "gradwire",
        ]
    )
    print(f"\n== DDP over gloo (ring all-reduce): {WORKERS} workers ==", flush=True)
    ddp = run_ddp()
    print("\n| system | workers | test accuracy | training time | samples/s |")
    print("|---|---:|---:|---:|---:|")
    for name, s in (("gradwire", gw), ("DDP (gloo)", ddp)):
        print(
            f"| {name} | {s['workers']} | {s['test_accuracy']:.3f} | {s['seconds']:.1f} s | {s['samples_per_s']:,.0f} |"
        )
    print(
        f"\ngradwire / DDP throughput: {gw['samples_per_s'] / ddp['samples_per_s']:.2f}x "
        "(one 2-core machine: every process shares the same cores and the loopback)"
    )


if __name__ == "__main__":
    main()
