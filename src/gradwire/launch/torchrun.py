"""Under torchrun, `gradwire.init()` starts the job itself: no scheduler or server to start by hand.

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint host:29400 train.py

With torchrun's variables present (TORCHELASTIC_RUN_ID and friends) and no GRADWIRE_SCHEDULER given:
- the process torchrun makes global rank 0 starts the scheduler (a `gradwire scheduler` child process, on a port the
  kernel picks, on MASTER_ADDR's side) and makes a fresh job secret;
- local rank 0 of every node starts GRADWIRE_SERVERS_PER_NODE (default 1) colocated servers beside its workers;
- every worker then joins with the scheduler's address, the secret, WORLD_SIZE workers and GROUP_WORLD_SIZE x
  GRADWIRE_SERVERS_PER_NODE servers;
- with GRADWIRE_STANDBY_SCHEDULERS=k, local rank 0 of nodes 1..k each starts a standby scheduler first (the job
  then survives its scheduler's host: docs/faults.md); a scheduler child that dies while the job runs is started
  again at its port by the process that started it, as a standby where the job has them (at most SCHEDULER_RESTARTS
  times).
The address and the secret travel through torchrun's own store (the TCPStore at MASTER_ADDR:MASTER_PORT, the one
`init_process_group("env://")` uses), under keys of this run and restart, so a restarted worker group starts a new
job. The children live and die with the job: they end with it (the servers when the scheduler ends it or is gone,
the scheduler once every worker has left), and the process that started them stops them at its exit.

This is how Slurm (`srun torchrun ...`) and Kubernetes (Kubeflow's PyTorchJob runs torchrun) run gradwire too: see
docs/deploy.md.
"""

from __future__ import annotations

import atexit
import logging
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from datetime import timedelta

from gradwire.config import Config, env_for
from gradwire.errors import ConfigError
from gradwire.scheduler.recovery import RESUMED_LINE

log = logging.getLogger("gradwire.torchrun")
CHILDREN: list[subprocess.Popen] = []  # started by this process: stopped at its exit
SCHEDULER_RESTARTS = 3
_stopping = threading.Event()  # this process is stopping its children: none is started again
_IDLE: set[int] = set()  # the standby schedulers started here that have not taken the job over: they never end alone


def detected(env: Mapping[str, str]) -> bool:
    """True where torchrun started this process and the user gave no scheduler."""
    return "TORCHELASTIC_RUN_ID" in env and "MASTER_ADDR" in env and not env.get("GRADWIRE_SCHEDULER")


def bootstrap(env: Mapping[str, str], timeout: float = 300.0) -> dict[str, str]:
    """Start what this process must start (scheduler, servers) and return the GRADWIRE_* variables of the job.

    Blocks until the scheduler's address is published (at most `timeout`). Raises ConfigError when torchrun's
    variables are incomplete or PyTorch is missing (its store carries the address)."""
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank, nodes = int(env["LOCAL_RANK"]), int(env.get("GROUP_WORLD_SIZE", "1"))
        master, master_port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError) as e:
        raise ConfigError(f"torchrun's variables are incomplete or malformed ({e}); set GRADWIRE_SCHEDULER") from None
    per_node = Config.from_env(env).servers_per_node
    prefix = f"gradwire/{env['TORCHELASTIC_RUN_ID']}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store = _store(master, master_port, rank, env, timeout)
    # where the other nodes reach this one: MASTER_ADDR is not that (c10d rendezvous gives each node "localhost")
    host = env.get("GRADWIRE_HOST") or this_host_address(master)
    job = env_for(
        num_workers=world,
        # the colocated servers, unless the user counts dedicated server machines in too
        num_servers=env.get("GRADWIRE_NUM_SERVERS") or nodes * per_node,
        rank=rank,
        timeout=env.get("GRADWIRE_TIMEOUT", int(timeout)),
    )
    standbys = [prefix + f"standby{n}" for n in range(1, min(Config.from_env(env).standby_schedulers, nodes - 1) + 1)]
    wait = timedelta(seconds=timeout)
    if rank == 0:
        store.set(prefix + "secret", env.get("GRADWIRE_SECRET") or secrets.token_hex(32))
    store.wait([prefix + "secret"], wait)
    job |= env_for(secret=store.get(prefix + "secret").decode())
    group_rank = int(env.get("GROUP_RANK", "0"))
    if local_rank == 0 and 1 <= group_rank <= len(standbys):  # this node's standby scheduler
        port = _start_scheduler(env | job | env_for(standby=True))
        store.set(prefix + f"standby{group_rank}", f"{host}:{port}")
    if standbys:
        store.wait(standbys, wait)
        job |= env_for(scheduler_standby=",".join(store.get(key).decode() for key in standbys))
    if rank == 0:
        port = _start_scheduler(env | job)
        store.set(prefix + "scheduler", f"{host}:{port}")
    store.wait([prefix + "scheduler"], wait)
    job |= env_for(scheduler=store.get(prefix + "scheduler").decode(), host=host)
    if local_rank == 0:
        for _ in range(per_node):
            _spawn([sys.executable, "-m", "gradwire", "server"], env | job | {"GRADWIRE_COLOCATED": "1"}, "server")
    return job


def _store(master: str, port: int, rank: int, env: Mapping[str, str], timeout: float):
    try:
        from torch.distributed import TCPStore
    except ImportError:
        raise ConfigError("under torchrun gradwire needs PyTorch to share the scheduler's address") from None
    # the agent's store (torchrun's default), else rank 0 hosts it, as init_process_group("env://") does
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
    return TCPStore(master, port, is_master=rank == 0 and not agent, timeout=timedelta(seconds=timeout))


def _start_scheduler(env: Mapping[str, str], port: int = 0, restarts: int = SCHEDULER_RESTARTS) -> int:
    """A scheduler of the job (a standby, with GRADWIRE_STANDBY), listening on every address at `port` (0: one the
    kernel picks); returns its port (read from its first line). Started again at that port if it dies while the job
    runs: as a standby where the job has them (`_keep`)."""
    child = _spawn(
        [sys.executable, "-m", "gradwire", "scheduler"],
        dict(env) | {"GRADWIRE_SCHEDULER": f"0.0.0.0:{port}"},
        "scheduler",
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None
    first = child.stdout.readline()
    if " listening on " not in first:
        child.kill()
        raise ConfigError(f"the gradwire scheduler did not start under torchrun: {first.strip()!r}")
    if first.startswith("gradwire standby scheduler"):
        _IDLE.add(child.pid)
    threading.Thread(target=_drain, args=(child.stdout, child.pid), daemon=True).start()
    port = int(first.split(" listening on ", 1)[1].split()[0].rsplit(":", 1)[1])
    threading.Thread(target=_keep, args=(child, env, port, restarts), name="gw-keep-scheduler", daemon=True).start()
    return port


def _keep(child: subprocess.Popen, env: Mapping[str, str], port: int, restarts: int) -> None:
    """A scheduler child that ends with an error while this process lives (killed, or stepped down) is started again
    at its port; the job's nodes, training on, report to it (scheduler/recovery.py)."""
    code = child.wait()
    if code == 0 or restarts <= 0 or _stopping.is_set():
        return
    again = dict(env) | (env_for(standby=True) if env.get("GRADWIRE_SCHEDULER_STANDBY") else {})
    log.warning("the job's scheduler (pid %d) ended with %s: starting it again at port %d", child.pid, code, port)
    try:
        _start_scheduler(again, port, restarts - 1)
    except (ConfigError, OSError) as e:
        log.error("could not start the job's scheduler again at port %d: %s", port, e)


def _spawn(argv: list[str], env: Mapping[str, str], what: str, stdout: int | None = None) -> subprocess.Popen:
    # the worker's rank is not the child's: servers take theirs in order of arrival
    env = {k: v for k, v in env.items() if k not in ("GRADWIRE_RANK", "RANK", "DMLC_WORKER_ID")}
    child = subprocess.Popen(argv, env={**env, "GRADWIRE_ROLE": what}, stdout=stdout, text=True)
    if not CHILDREN:
        atexit.register(stop_children)
    CHILDREN.append(child)
    log.info("started the job's %s (pid %d)", what, child.pid)
    return child


def stop_children(grace: float = 5.0) -> None:
    """Wait a moment for the children to end with the job, then stop those still running."""
    _stopping.set()
    for child in CHILDREN:
        if child.pid in _IDLE:
            child.terminate()  # a standby that never took the job over: the job has ended without it
        try:
            child.wait(grace)
        except subprocess.TimeoutExpired:
            child.terminate()
            try:
                child.wait(grace)
            except subprocess.TimeoutExpired:
                child.kill()


def this_host_address(towards: str) -> str:
    """This host's address as other hosts see it: the source address of the route to `towards` (a UDP connect sends
    nothing), or, where that is loopback (`towards` is this host), the first non-loopback IPv4 address of an
    interface; 127.0.0.1 if there is none (a single machine)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((towards, 9))
            address = s.getsockname()[0]
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    for _, name in socket.if_nameindex():
        address = _interface_address(name)
        if address and not address.startswith("127."):
            return address
    return "127.0.0.1"


def _interface_address(name: str) -> str | None:
    import fcntl
    import struct

    SIOCGIFADDR = 0x8915  # noqa: N806 - Linux's name
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None  # no IPv4 address on it
    return socket.inet_ntoa(packed[20:24])


def _drain(stream, pid: int = 0) -> None:
    """Read a child's output to its end (a full pipe would block it); a standby scheduler that says it resumed the job
    is idle no longer."""
    with stream:
        for line in stream:
            if line.startswith(RESUMED_LINE):
                _IDLE.discard(pid)
