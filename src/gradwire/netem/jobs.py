"""Running gradwire's roles, or a gloo job, on the hosts of an emulated cluster."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from gradwire.config import env_for
from gradwire.errors import GradwireError
from gradwire.netem.cluster import EmulatedCluster
from gradwire.netem.topology import Host


@dataclass
class Job:
    """The processes of one job; `workers` in rank order; `env`, the job's environment (its secret, the scheduler's
    address: what a scheduler started again into it needs)."""

    services: list[subprocess.Popen]
    workers: list[subprocess.Popen]
    env: dict[str, str] = field(default_factory=dict)

    def wait(self, timeout: float) -> list[str]:
        """Wait for every worker; returns their outputs in rank order. Raises naming every worker that failed, with
        the end of its output (the first to fail is often not the first rank: the others then fail on its loss)."""
        deadline = time.monotonic() + timeout
        outputs = []
        for rank, proc in enumerate(self.workers):
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise GradwireError(f"worker {rank} did not finish within {timeout}s") from None
            if proc.returncode != 0:
                raise GradwireError(self._failures(rank, out or ""))
            outputs.append(out or "")
        for proc in self.services:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        return outputs

    def _failures(self, rank: int, out: str) -> str:
        """What every failed worker said, once the others had a few seconds to end (then they are killed)."""
        said = [f"worker {rank} exited with {self.workers[rank].returncode}:\n{out[-3000:]}"]
        for other, proc in enumerate(self.workers):
            if other == rank:
                continue
            try:
                rest, _ = proc.communicate(timeout=5)
            except (subprocess.TimeoutExpired, ValueError):
                continue  # still running, or its output was read already
            if proc.returncode:
                said.append(f"worker {other} exited with {proc.returncode}:\n{(rest or '')[-3000:]}")
        self.kill()
        return "\n".join(said)

    def kill(self) -> None:
        for proc in self.services + self.workers:
            if proc.poll() is None:
                proc.kill()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        """Whatever happened: every process killed if still running, reaped, and its output pipe closed."""
        self.kill()
        for proc in self.services + self.workers:
            proc.wait()
            if proc.stdout is not None and proc in self.workers:  # the schedulers' are closed by their drains
                proc.stdout.close()


def start_gradwire(
    cluster: EmulatedCluster,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    standby_scheduler: bool = False,
    scheduler_output: IO[str] | None = None,
) -> Job:
    """Scheduler, servers and workers (running `argv`) each on their own emulated host; with the topology's
    `colocate`, a server beside each worker too. As a user would run it: the scheduler measures the links (the
    default GRADWIRE_PLACEMENT=auto); with GRADWIRE_PLACEMENT=model each node is told its link's rate instead.
    `standby_scheduler`: a standby scheduler on the first server's host (the job's services then begin with the
    scheduler and the standby). `scheduler_output`: where the schedulers' lines go (default: dropped)."""
    topo = cluster.topology
    servers = topo.servers + (topo.worker_hosts if topo.colocate else 0)
    base = dict(env or os.environ) | {"PYTHONUNBUFFERED": "1"}
    base |= env_for(num_workers=topo.workers, num_servers=servers, secret=secrets.token_hex(32))
    standby = [_start_standby(cluster, base, scheduler_output)] if standby_scheduler else []
    if standby:
        base |= env_for(scheduler_standby=standby[0][1])
    scheduler, address = _start_scheduler(cluster, topo.of("scheduler")[0], base, scheduler_output)
    base |= env_for(scheduler=address)
    given = base.get("GRADWIRE_PLACEMENT") == "model"  # else (the default, auto) the scheduler measures the links

    def node_env(h, rank: int) -> dict[str, str]:
        rate = env_for(link_rate=h.up) if given else {}
        return base | rate | env_for(host=h.address, rank=rank)

    services = [scheduler, *(proc for proc, _ in standby), *_start_servers(cluster, node_env)]
    workers = [
        cluster.spawn(
            h,
            list(argv),
            node_env(h, rank),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank, h in topo.placed_workers()
    ]
    return Job(services, workers, base)


def _start_standby(
    cluster: EmulatedCluster, env: dict[str, str], output: IO[str] | None
) -> tuple[subprocess.Popen, str]:
    """A standby scheduler on the first server's host, and its address."""
    return _start_scheduler(cluster, cluster.topology.of("server")[0], env | env_for(standby=True), output)


def restart_scheduler(cluster: EmulatedCluster, job: Job, output: IO[str] | None = None) -> subprocess.Popen:
    """A scheduler started again on the scheduler's host at its address (after it died): the job's nodes report to
    it and it resumes the job (scheduler/recovery.py). It joins the job's services."""
    sched = cluster.topology.of("scheduler")[0]
    env = {k: v for k, v in job.env.items() if k != "GRADWIRE_STANDBY"} | env_for(host=sched.address)
    proc, _ = _start_scheduler(cluster, sched, env, output, address=job.env["GRADWIRE_SCHEDULER"])
    job.services.append(proc)
    return proc


def _start_scheduler(
    cluster: EmulatedCluster, sched: Host, env: dict[str, str], output: IO[str] | None = None, address: str = ""
) -> tuple[subprocess.Popen, str]:
    """A scheduler on an emulated host (at `address`, else a port the kernel picks), and the address it listens on
    (its first line); its other lines go to `output`."""
    scheduler = cluster.spawn(
        sched,
        [sys.executable, "-m", "gradwire", "scheduler"],
        env | env_for(scheduler=address or f"{sched.address}:0", host=sched.address),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert scheduler.stdout is not None
    first = scheduler.stdout.readline()
    if not (first.startswith("gradwire ") and " listening on " in first):
        scheduler.kill()
        raise GradwireError(f"the scheduler did not start: {first!r}")
    # keep reading, or a chatty scheduler would block on a full pipe
    threading.Thread(target=_drain, args=(scheduler.stdout, output), daemon=True).start()
    return scheduler, first.split(" listening on ", 1)[1].split()[0]


def _drain(stream: IO[str], output: IO[str] | None = None) -> None:
    with stream:
        for line in stream:
            if output is not None:
                output.write(line)
                output.flush()


def _start_servers(cluster: EmulatedCluster, node_env: Callable[[Host, int], dict[str, str]]) -> list:
    """The dedicated servers, each on its own host, and with the topology's `colocate` one more in each worker's
    namespace (same host, same link)."""
    topo, server = cluster.topology, [sys.executable, "-m", "gradwire", "server"]
    started = [cluster.spawn(h, server, node_env(h, h.index), stdout=subprocess.DEVNULL) for h in topo.of("server")]
    if topo.colocate:
        started += [
            cluster.spawn(
                h, server, node_env(h, topo.servers + h.index) | env_for(colocated=True), stdout=subprocess.DEVNULL
            )
            for h in topo.of("worker")
        ]
    return started


def start_gloo(cluster: EmulatedCluster, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Job:
    """A torch.distributed job on the worker hosts; rendezvous through a file, traffic over the emulated links."""
    topo = cluster.topology
    tmp = tempfile.mkdtemp(prefix="gradwire-gloo-")
    base = dict(env or os.environ) | {
        "WORLD_SIZE": str(topo.workers),
        "GLOO_SOCKET_IFNAME": "eth0",
        "GRADWIRE_BENCH_INIT": f"file://{tmp}/rendezvous",
        "PYTHONUNBUFFERED": "1",
    }
    workers = [
        cluster.spawn(
            h,
            list(argv),
            base | {"RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank, h in topo.placed_workers()
    ]
    return Job([], workers)


TF_RING_PORT = 23400  # + rank: a port of each worker's own in its namespace, which this run made (no other user)


def start_tf_ring(cluster: EmulatedCluster, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Job:
    """A TensorFlow MultiWorkerMirroredStrategy job on the worker hosts: TF_CONFIG names every worker (its host's
    address, a port of its own: TensorFlow needs them all before any starts), traffic over the emulated links."""
    topo = cluster.topology
    placed = topo.placed_workers()
    addresses = [f"{h.address}:{TF_RING_PORT + rank}" for rank, h in placed]
    base = dict(env or os.environ) | {"WORLD_SIZE": str(topo.workers), "PYTHONUNBUFFERED": "1"}
    workers = []
    for rank, h in placed:
        config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}}
        job_env = base | {"RANK": str(rank), "TF_CONFIG": json.dumps(config)}
        output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        workers.append(cluster.spawn(h, list(argv), job_env, **output))
    return Job([], workers)
