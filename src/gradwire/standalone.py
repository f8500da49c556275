"""A worker started with no job around it: `python train.py`, with no launcher and no scheduler given.

Horovod's scripts run that way as one process of size 1 (hvd.init() with no horovodrun), and BytePS needs "no
scheduler or server" for one worker; without this module a gradwire worker would wait for a scheduler at the default
address that nobody starts. So `init()` (session.py) makes the job itself when nothing names one: no GRADWIRE_SCHEDULER
(nor DMLC_PS_ROOT_URI), not under torchrun, the worker role. A job of one worker then runs in this process: a
scheduler and one server as threads (`Standalone`), so that every call works as in a launched job (the
parameter-server mode's server-side optimizer needs a server), and the worker marked `standalone`, so that its
reductions, gathers and reduce-scatters, whose result with one worker is its own input, are answered in place
(worker/single.py), with no frame and no server thread taking the training thread's interpreter.

More workers than one (GRADWIRE_NUM_WORKERS, DMLC_NUM_WORKER or WORLD_SIZE above 1, or another launcher's count of its
processes: `OTHER_LAUNCHERS`) with no scheduler is a mistake to say, not a job to start: every one of them would be a
job of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
from collections.abc import Mapping

from gradwire.config import Config
from gradwire.errors import ConfigError
from gradwire.scheduler import Scheduler
from gradwire.server import Server

log = logging.getLogger("gradwire")


# what other launchers set to the number of processes they started: any of them above 1 with no gradwire scheduler is
# a job started the wrong way (each process would train alone), not one worker
OTHER_LAUNCHERS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS")


def needed(config: Config, env: Mapping[str, str]) -> bool:
    """Whether a worker with `config` (read from `env`, not under torchrun) has no job to join, and must make one: no
    scheduler was given. Raises ConfigError where several processes are expected without one."""
    if config.role != "worker" or "scheduler" in config.explicit:
        return False
    expected = [(name, env[name]) for name in OTHER_LAUNCHERS if env.get(name, "1").strip() not in ("", "0", "1")]
    if config.num_workers > 1 or expected:
        said = f"{config.num_workers} workers expected (GRADWIRE_NUM_WORKERS, DMLC_NUM_WORKER or WORLD_SIZE)"
        if expected:
            said = f"started as one of {expected[0][1]} processes ({expected[0][0]}={expected[0][1]})"
        raise ConfigError(
            f"{said} but no gradwire scheduler given: start the job with `gradwire launch -n WORKERS -s SERVERS`, "
            "torchrun or as docs/deploy.md says, or set GRADWIRE_SCHEDULER (host:port) in every process"
        )
    return True


class Standalone:
    """The scheduler and the server of a one-worker job, as threads of this process. Its worker starts with
    `worker_config`, then `started` waits for the server's rendezvous (which needs the worker); `stop` ends both
    roles (after the worker has left)."""

    def __init__(self, config: Config) -> None:
        base = dataclasses.replace(config, num_workers=1, num_servers=1, num_standby=0, min_workers=0, max_workers=0)
        if not base.secret_bytes():  # nobody else is to join: a secret of its own, as `gradwire launch` makes one
            base = dataclasses.replace(base, secret=secrets.token_hex(16))
        self.scheduler = Scheduler(dataclasses.replace(base, role="scheduler", scheduler="127.0.0.1:0")).start()
        address = self.scheduler.address
        self.worker_config = dataclasses.replace(base, scheduler=address)
        self.server: Server | None = None
        self._error: BaseException | None = None
        server_config = dataclasses.replace(base, role="server", scheduler=address, rank=None)
        self._starting = threading.Thread(target=self._start_server, args=(server_config,), name="gw-standalone")
        self._starting.start()
        log.info("gradwire: no scheduler given: a job of one worker in this process (scheduler at %s)", address)

    def _start_server(self, config: Config) -> None:
        try:
            self.server = Server(config).start()
        except BaseException as e:  # noqa: BLE001 - raised by `started`, on the caller's thread
            self._error = e

    def started(self) -> None:
        """Wait for the server to have joined the job (the worker has started); raises what stopped it."""
        self._starting.join(self.worker_config.timeout)
        if self._error is not None:
            raise self._error
        if self.server is None:
            raise ConfigError(f"the one-worker job's server did not start in {self.worker_config.timeout:g}s")

    def stop(self) -> None:
        self.scheduler.wait(5)
        if self.server is not None:
            self.server.stop()
        self.scheduler.stop()
