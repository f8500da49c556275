"""The worker of this process: `init()` makes it, `shutdown()` leaves the job, `current_worker()` finds it (or the
one a thread acts for, in an in-process cluster: `use_worker`). The public API (gradwire/__init__.py) and the
parameter-server calls (parameters.py) act through it."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Iterator

from gradwire import standalone
from gradwire.config import Config
from gradwire.errors import ConfigError
from gradwire.launch import torchrun
from gradwire.worker import Worker

_worker: Worker | None = None
_local = threading.local()


@contextlib.contextmanager
def use_worker(worker: Worker) -> Iterator[Worker]:
    """Make `worker` this thread's current worker (for in-process clusters: a thread per worker)."""
    previous = getattr(_local, "worker", None)
    _local.worker = worker
    try:
        yield worker
    finally:
        _local.worker = previous


def init(config: Config | None = None) -> None:
    """Join the job as a worker (blocks through rendezvous and the first barrier)."""
    global _worker
    if _worker is not None:
        return
    alone = None
    if config is None:
        env: dict[str, str] = dict(os.environ)
        if torchrun.detected(env):  # torchrun started us and no scheduler was given: start the job's roles
            env |= torchrun.bootstrap(env)
        config = Config.from_env(env)
        if standalone.needed(config, env):  # no job to join (`python train.py`): one of one worker, made here
            alone = standalone.Standalone(config)
            config = alone.worker_config
    if config.role != "worker":
        raise ConfigError(
            f"init() starts a worker, but GRADWIRE_ROLE={config.role}; run servers with `gradwire server`"
        )
    _worker = _start(config, alone)
    while _departed:  # registered anew: the last generation's connections may close now
        _departed.pop().leave()
    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)
        _atexit_registered.append(True)


def _start(config: Config, alone: standalone.Standalone | None) -> Worker:
    """The worker, started (in a job of its own where `alone` holds that job's other roles)."""
    worker = Worker(config)
    if alone is None:
        return worker.start()
    worker.state.standalone = True
    try:
        worker.start()
        alone.started()
    except BaseException:
        with contextlib.suppress(Exception):  # what stopped the start is the error to raise
            worker.shutdown()
        alone.stop()
        raise
    _standalone.append(alone)
    return worker


def shutdown() -> None:
    """Leave the job. Idempotent. `init()` may follow: every worker that shut down and inits again joins a new
    generation of the same job (same servers, tensors declared afresh), as with Horovod's shutdown()/init()."""
    global _worker
    if _worker is not None:
        worker, _worker = _worker, None
        worker.shutdown(final=False)
        _departed.append(worker)
    _end_standalone()


def _end_standalone() -> None:
    """A one-worker job made by `init` ends with its worker: its scheduler and server go too (a later `init` makes
    another)."""
    while _standalone:
        alone = _standalone.pop()
        while _departed:
            _departed.pop().leave()
        alone.stop()


def _shutdown_at_exit() -> None:
    global _worker
    if _worker is not None:
        worker, _worker = _worker, None
        # the process ends: no init() can follow, so the job may end at once; and why, if the script raised
        worker.shutdown(final=True, error=_uncaught())
    while _departed:
        _departed.pop().leave()
    _end_standalone()


def _uncaught() -> str | None:
    """The exception that ends this process, if the main script raised one (the interpreter keeps it in
    sys.last_value, 3.12+ also sys.last_exc, before it runs the atexit functions), with where it was raised."""
    error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if not isinstance(error, Exception):
        return None
    where = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ is not None else []
    at = f" ({where[0].filename}, line {where[0].lineno}, in {where[0].name})" if where else ""
    return f"{type(error).__name__}: {error}{at}"


_atexit_registered: list[bool] = []
_standalone: list[standalone.Standalone] = []  # the roles of the one-worker job `init` made, if it made one
_departed: list[Worker] = []  # shut down, their scheduler connection open until init() or exit (Worker.leave)


def is_initialized() -> bool:
    """True between init() and shutdown()."""
    return _worker is not None


def current_worker() -> Worker:
    """The worker this thread acts for: the one set by `use_worker`, else the one `init()` made."""
    worker = getattr(_local, "worker", None) or _worker
    if worker is None:
        raise ConfigError("gradwire is not initialized: call gradwire.init() first")
    return worker
