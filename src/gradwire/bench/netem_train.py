"""`gradwire bench --netem --train`: end-to-end training on the emulated network, gradwire's ways against their peer
(DDP over gloo; for Keras, TensorFlow's MultiWorkerMirroredStrategy) one after the other in one emulated cluster:
per way the median step time, samples per second and the ratio to the peer (bench/train.py, bench/train_keras.py).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from gradwire.bench.netem import mtu_label, timed
from gradwire.errors import GradwireError
from gradwire.netem import EmulatedCluster, Topology
from gradwire.netem.jobs import start_gloo, start_gradwire, start_tf_ring
from gradwire.tuning import ETHERNET_MTU

TRAIN_WAYS = ("optimizer", "hook", "ddp")  # gradwire's DistributedOptimizer, DDP with gradwire's hook, DDP over gloo
# asked for by name only (`--ways`): DistributedOptimizer under the cross barrier, the next forward pass overlapping
# this step's sums (an API a user opts into, as BytePS's users do)
OPT_IN_WAYS = ("crossbarrier",)


# --drift: links that change rate mid-job, with gradwire following them (the default), with GRADWIRE_ADAPT=0, and a
# job on the new links from the start (`-rendezvous`: what the settings derived at the rendezvous for them reach)
DRIFT_WAYS = ("optimizer", "optimizer-fixed", "optimizer-rendezvous", "ddp")
# `--compression`: DistributedOptimizer uncompressed, with the servers' compressors and with PowerSGD (rank 2) through
# the servers, DDP with gradwire's comm hook carrying PowerSGD, against DDP over gloo plain and with torch's own
# PowerSGD hook (rank 2)
COMPRESSION_WAYS = (
    "optimizer",
    "optimizer-onebit",
    "optimizer-topk",
    "optimizer-powersgd",
    "hook-powersgd",
    "ddp-powersgd",
    "ddp",
)
# Keras 3 on TensorFlow (bench/train_keras.py): gradwire.keras's DistributedOptimizer against TensorFlow's
# MultiWorkerMirroredStrategy
KERAS_WAYS = ("keras", "mwms")
PEERS = ("ddp", "mwms")  # each set of ways is compared with its peer: DDP over gloo, or TensorFlow's own ring


def run_train_config(
    topo: Topology,
    steps: int,
    warmup: int,
    env: dict[str, str],
    timeout: float = 1800,
    drift: tuple[str, str] | None = None,
    settle: int = 0,
    ways: tuple[str, ...] = TRAIN_WAYS,
) -> list[dict]:
    """End-to-end training (bench/train.py) the three ways, one after the other in one emulated cluster: per way the
    median step time and samples per second. `drift` (from, to): the DRIFT_WAYS instead; a job starts on links of the
    first rate, and they change to the second once rank 0 has done `warmup` steps; the `settle` steps after that are
    not timed (every way alike), so the figures are of the new links after gradwire had time to follow them."""
    results = []
    with EmulatedCluster(topo) as cluster:
        for way in DRIFT_WAYS if drift else ways:
            start, argv, job_env = _way_job(way, steps, warmup + settle, env)
            progress, rate = None, f"{drift[0]} -> {drift[1]}" if drift else topo.worker_rate
            if drift and way.endswith("-rendezvous"):
                cluster.reshape(drift[1])
                rate = f"{drift[1]} from the start"
            elif drift:
                cluster.reshape(drift[0])
                progress = tempfile.NamedTemporaryFile(prefix="gw-progress-", delete=False)
                progress.close()
                job_env |= {"GRADWIRE_BENCH_PROGRESS": progress.name}
                threading.Thread(
                    target=_reshape_after, args=(cluster, progress.name, warmup, drift[1], timeout), daemon=True
                ).start()
            try:
                rows, cpu = timed(
                    lambda start=start, argv=argv, job_env=job_env: start(cluster, argv, job_env), timeout
                )
            except GradwireError as e:
                raise GradwireError(f"the {way!r} way failed: {e}") from None
            finally:
                if progress is not None:
                    os.unlink(progress.name)
            results.append(_train_row(topo, way, rate, drift, rows[0], cpu))
    ddp = next(r for r in results if r["way"] in PEERS)
    powersgd = next((r for r in results if r["way"] == "ddp-powersgd"), None)
    for r in results if powersgd else ():
        r["x_powersgd_samples_per_s"] = r["samples_per_s"] / powersgd["samples_per_s"]
    for r in results:
        r["x_ddp_samples_per_s"] = r["samples_per_s"] / ddp["samples_per_s"]  # over the peer's (MWMS for Keras)
        r["peer"] = ddp["way"]
    return results


def _way_job(way: str, steps: int, timed_from: int, env: dict[str, str]) -> tuple[Callable, list[str], dict[str, str]]:
    """How to start one way's training job: the job starter (gradwire's, gloo's or TensorFlow's ring), the workers'
    command line and their environment."""
    trained = way if way in COMPRESSION_WAYS else way.split("-")[0]  # (the drift ways differ by settings)
    module = "gradwire.bench.train_keras" if way in KERAS_WAYS else "gradwire.bench.train"
    argv = [sys.executable, "-m", module, trained, str(steps), str(timed_from)]
    if way == "mwms":
        return start_tf_ring, argv, os.environ | env
    if way.startswith("ddp"):
        return start_gloo, argv, os.environ | env
    job_env = os.environ | env | {"GLOO_SOCKET_IFNAME": "eth0"}
    if way.endswith("-fixed"):
        job_env |= {"GRADWIRE_ADAPT": "0"}
    return start_gradwire, argv, job_env


def _train_row(topo: Topology, way: str, rate: str, drift: tuple[str, str] | None, row: dict, cpu: float) -> dict:
    """One way's figures: the job's shape and links, the settings it ran with, and its step times."""
    median = statistics.median(row["times"])
    return {
        "way": way,
        "workers": topo.workers,
        "per_host": topo.per_host,
        "servers": topo.servers,
        "colocated": topo.worker_hosts if topo.colocate else 0,
        "worker_rate": rate,
        "server_rate": rate if drift else topo.server_rate,
        "mtu": topo.mtu,
        "parameters": row["parameters"],
        "partition_bytes": row.get("partition_bytes"),
        "derived_again": row.get("derived_again"),  # why the settings changed mid-job (scheduler/adapt.py)
        "recut_steps": row.get("recut_steps") or [],  # the steps in which tensors were cut anew
        "step_seconds_median": median,
        "step_seconds_all": row["times"],
        "samples_per_s": row["samples_per_step"] / median,
        "cpu_utilization": cpu,
        "pushed_bytes_per_step": row.get("pushed_bytes_per_step"),  # rank 0's, gradwire's ways
        "window": row.get("window"),
    }


def _reshape_after(cluster: EmulatedCluster, progress: str, steps: int, rate: str, timeout: float) -> None:
    """Change every link to `rate` once rank 0 has written `steps` (or more) to the file `progress`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(progress) as f:
                done = int(f.read().strip() or 0)
        except (OSError, ValueError):
            done = 0
        if done >= steps:
            cluster.reshape(rate)
            return
        time.sleep(0.02)


def _layout(r: dict) -> str:
    m = r.get("per_host", 1)
    return str(r["workers"]) if m == 1 else f"{r['workers']} ({r['workers'] // m}x{m})"


def _servers(r: dict) -> str:
    return f"{r['servers']} + {r['colocated']} colocated" if r.get("colocated") else str(r["servers"])


def _rates(r: dict) -> str:
    """The workers' and the servers' link rate, once where they are the same."""
    same = r["worker_rate"] == r["server_rate"]
    rates = r["worker_rate"] if same else f"{r['worker_rate']} / {r['server_rate']}"
    return rates + mtu_label(r.get("mtu", ETHERNET_MTU))  # rows written before the MTU was a field: 1500


def _partitions(sizes: list | None) -> str:
    """gradwire's partition size at the start and the end of a job: '256 KiB -> 32 KiB', or '-' (DDP)."""
    if not sizes or sizes[0] is None:
        return "-"
    kib = [f"{b // 1024} KiB" for b in sizes]
    return kib[0] if kib[0] == kib[-1] else " -> ".join(kib)


def _megabytes(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.3f}"


def train_table(results: list[dict]) -> str:
    """Markdown: per configuration and way, the step time, samples/s and the ratio to DDP over gloo."""
    lines = [
        "| n | k | rate | way | parameters | partitions | step s (median) | samples/s | x peer | CPU use |",
        "|---:|---:|---|---|---:|---|---:|---:|---:|---:|",
    ]
    powersgd = any("x_powersgd_samples_per_s" in r for r in results)
    if powersgd:
        lines[0] += " x DDP+PowerSGD | MB pushed per step (rank 0) |"
        lines[1] += "---:|---:|"
    for r in results:
        lines.append(
            f"| {_layout(r)} | {_servers(r)} | {_rates(r)} | {r['way']} "
            f"| {r['parameters'] / 1e6:.1f}M | {_partitions(r.get('partition_bytes'))} "
            f"| {r['step_seconds_median']:.2f} | {r['samples_per_s']:.1f} "
            f"| {r['x_ddp_samples_per_s']:.2f}x | {r['cpu_utilization']:.0%} |"
            + (
                f" {r['x_powersgd_samples_per_s']:.2f}x | {_megabytes(r.get('pushed_bytes_per_step'))} |"
                if powersgd
                else ""
            )
        )
    return "\n".join(lines)
