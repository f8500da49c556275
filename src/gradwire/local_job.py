"""`gradwire.run(fn, np=N)`: Horovod's `horovod.run`, a function run on N workers of a job on this machine, each
result returned in rank order.

    import gradwire

    def train(epochs):
        import gradwire.torch as gw
        gw.init()
        ...
        return gw.rank(), final_loss

    results = gradwire.run(train, args=(3,), np=2)      # [(0, loss), (1, loss)]

The job is `gradwire launch`'s: a scheduler (in this process), `num_servers` server processes, and N worker
processes started as multiprocessing's spawn starts them (a fresh interpreter; the function and its arguments are
pickled, so a function of the script's `__main__` works under `if __name__ == "__main__":`, as with multiprocessing).
Each worker has the variables a launched worker has (gradwire's, torchrun's, horovodrun's), so `init()` finds the job.
A worker that raises, or dies, ends the job: the others are stopped and a GradwireError names the rank and what
happened (the worker's traceback). Several hosts are `gradwire launch`'s and the cluster launchers' (docs/deploy.md).
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import subprocess
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from gradwire.config import Config, env_for, worker_env
from gradwire.errors import GradwireError, NotSupported
from gradwire.scheduler import Scheduler

LOCAL_HOSTS = ("localhost", "127.0.0.1")
SERVER_GRACE_SECONDS = 5.0  # after the results: time for the servers to see every worker leave


def run(
    func: Callable[..., Any],
    args: tuple = (),
    kwargs: dict | None = None,
    np: int = 1,
    hosts: str | None = None,
    num_servers: int = 1,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    verbose: int | None = None,
    start_timeout: float | None = None,
    env: dict[str, str] | None = None,
    **horovod_only: Any,
) -> list[Any]:
    """Run `func(*args, **kwargs)` on `np` workers of a new job on this machine (`num_servers` servers); the workers'
    results, by rank. `hosts` may name this machine only ("localhost:N"). `use_gloo`, `use_mpi` and `verbose` are
    accepted for Horovod's signature and change nothing (gradwire moves bytes through its servers either way);
    `start_timeout` is the job's timeout for every wait (GRADWIRE_TIMEOUT); `env`, variables for every process.
    Horovod's elastic and remote options (`min_np`, `ssh_port`, ...) raise NotSupported."""
    if horovod_only:
        raise NotSupported(
            f"gradwire.run: {', '.join(sorted(horovod_only))} not supported: it runs a job on this machine "
            "(for several hosts or an elastic job, gradwire launch: docs/deploy.md)"
        )
    if np < 1 or num_servers < 1:
        raise ValueError(f"gradwire.run: np and num_servers at least 1, got {np} and {num_servers}")
    _check_hosts(hosts, np)
    base = dict(os.environ) | dict(env or {})
    base |= env_for(num_workers=np, num_servers=num_servers, host="127.0.0.1", secret=secrets.token_hex(32))
    if start_timeout is not None:
        base |= env_for(timeout=start_timeout)
    scheduler = Scheduler(Config.from_env(base, role="scheduler")).start()
    base |= env_for(scheduler=scheduler.address)
    servers: list[subprocess.Popen] = []
    workers: list[multiprocessing.process.BaseProcess] = []
    finished = False
    try:
        servers = [
            subprocess.Popen([sys.executable, "-m", "gradwire", "server"], env=base | env_for(role="server", rank=r))
            for r in range(num_servers)
        ]
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe(duplex=False) for _ in range(np)]
        for rank, (_, sender) in enumerate(pipes):
            process = context.Process(
                target=_worker,
                args=(func, args, kwargs or {}, base | worker_env(rank, np), sender),
                name=f"gradwire-worker-{rank}",
            )
            process.start()
            sender.close()  # the worker's end: a worker that dies closes the pipe
            workers.append(process)
        results = _results([receiver for receiver, _ in pipes], workers)
        finished = True
        return results
    finally:
        for process in workers:
            process.join(10 if finished else 0)
            if process.is_alive():
                process.terminate()
                process.join(10)
        for server in servers:
            try:
                server.wait(SERVER_GRACE_SECONDS if finished else 0)  # it exits once every worker has left the job
            except subprocess.TimeoutExpired:
                server.kill()  # a function that never joined the job, or a failed one
                server.wait()
        scheduler.stop()


def _check_hosts(hosts: str | None, np: int) -> None:
    if hosts is None:
        return
    for entry in hosts.split(","):
        name, _, slots = entry.strip().partition(":")
        if name not in LOCAL_HOSTS:
            raise NotSupported(
                f"gradwire.run runs on this machine only, not on {name!r}: for several hosts, gradwire launch "
                "(docs/deploy.md)"
            )
        if slots and int(slots) < np:
            raise ValueError(f"gradwire.run: hosts={hosts!r} has {slots} slots for np={np}")


def _worker(func: Callable[..., Any], args: tuple, kwargs: dict, env: dict[str, str], sender: Connection) -> None:
    """(A worker process.) Run the function with the job's variables; send back ("ok", result) or ("error", text)."""
    os.environ.clear()
    os.environ.update(env)
    try:
        outcome: tuple[str, Any] = ("ok", func(*args, **kwargs))
    except BaseException:  # noqa: BLE001 - every failure goes back to the caller, named
        outcome = ("error", traceback.format_exc())
    try:
        sender.send(outcome)
    except Exception:  # noqa: BLE001 - a result that does not pickle is the caller's to hear of
        sender.send(("error", f"its result could not be sent back:\n{traceback.format_exc()}"))
    finally:
        sender.close()
        _shutdown_if_initialized()


def _shutdown_if_initialized() -> None:
    """Leave the job (a function that did not call shutdown itself): the servers exit once every worker has."""
    from gradwire.session import is_initialized, shutdown

    if is_initialized():
        shutdown()


def _results(receivers: list[Connection], workers: list[multiprocessing.process.BaseProcess]) -> list[Any]:
    """Each worker's result, by rank; GradwireError at the first worker that raised or died."""
    results: dict[int, Any] = {}
    pending = dict(enumerate(receivers))
    while pending:
        for ready in wait(list(pending.values())):
            rank = next(r for r, c in pending.items() if c is ready)
            del pending[rank]
            try:
                kind, value = ready.recv()
            except EOFError:
                workers[rank].join(10)
                raise GradwireError(
                    f"gradwire.run: worker {rank} died before returning (exit code {workers[rank].exitcode})",
                    rank=rank,
                ) from None
            if kind == "error":
                raise GradwireError(f"gradwire.run: worker {rank} raised:\n{value}", rank=rank)
            results[rank] = value
    return [results[rank] for rank in range(len(receivers))]
