"""gradwire on a Ray cluster: Horovod's `RayExecutor` shape, and a Ray Train backend (docs/deploy.md).

    import ray, gradwire.ray
    ray.init()
    executor = gradwire.ray.RayExecutor(num_workers=4, num_servers=2)
    executor.start()
    results = executor.run(train)            # train() calls gradwire.torch.init(): one result per worker, rank order
    executor.shutdown()

    from ray.train.torch import TorchTrainer
    trainer = TorchTrainer(train_loop, scaling_config=ScalingConfig(num_workers=4),
                           torch_config=gradwire.ray.GradwireConfig(num_servers=2))   # was TorchConfig()

The scheduler runs in a small actor (no CPU reserved) and every server in an actor of its own (`cpus_per_server`
CPUs, and `server_resources`, a custom resource such as {"server_node": 1} that only the CPU machines meant for
servers advertise); workers are actors (RayExecutor) or Ray Train's workers. Each actor advertises its node's
address, so the job spans the cluster's nodes. The job has a fresh secret, handed to every actor. A server actor
that dies is a server failure (failover: its keys move on, docs/faults.md); a worker that dies ends the run with the
other workers' WorkerLost naming it, not a hang; the scheduler's actor, pinned to the driver's node, is restarted there
by Ray at its port and resumes the job.

Ray is an optional dependency (`pip install gradwire[ray]`): nothing else in gradwire imports this module.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import ray
from gradwire.config import Config, env_for
from gradwire.errors import ConfigError, GradwireError


def _node_address() -> str:
    return ray.util.get_node_ip_address()


SCHEDULER_RESTARTS = 3  # a scheduler actor whose process dies is started again (on its node, at its port) this often


@ray.remote(num_cpus=0, max_restarts=SCHEDULER_RESTARTS)
class _SchedulerActor:
    """The job's scheduler, in this actor's process, listening on every address of its node. Pinned to one node: when
    its process dies, Ray starts the actor again there, and it listens on the port it had (kept in `port_file`, on the
    node), so the job's nodes, training on meanwhile, find it and it resumes the job (scheduler/recovery.py)."""

    def __init__(self, env: dict[str, str], port_file: str) -> None:
        from gradwire.scheduler import Scheduler

        self.port_file = port_file
        try:
            with open(port_file) as f:
                port = int(f.read())  # a restart: the port the job's nodes know
        except (OSError, ValueError):
            port = 0
        config = Config.from_env(env | {"GRADWIRE_SCHEDULER": f"0.0.0.0:{port}", "GRADWIRE_ROLE": "scheduler"})
        self.scheduler = Scheduler(config).start()
        with open(port_file, "w") as f:
            f.write(self.scheduler.address.rsplit(":", 1)[1])

    def address(self) -> str:
        return f"{_node_address()}:{self.scheduler.address.rsplit(':', 1)[1]}"

    def term(self) -> int:
        """The scheduler's term: 1, or one more for each time it resumed the job after a restart."""
        return self.scheduler.roster.term

    def stop(self) -> None:
        self.scheduler.stop()
        try:
            os.remove(self.port_file)
        except OSError:
            pass


class _ServerActor:
    """One summation server, in this actor's process; `serve` returns when the job ends (or its error)."""

    def serve(self, env: dict[str, str]) -> str | None:
        from gradwire.server import Server

        config = Config.from_env(env | {"GRADWIRE_HOST": _node_address(), "GRADWIRE_ROLE": "server"})
        self.server = Server(config).start()
        return self.server.wait()


class _WorkerActor:
    """A training process: the job's variables in its environment; runs what it is given."""

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env | {"GRADWIRE_HOST": _node_address()})
        self.executable: Any = None

    def setup(self, cls: type | None, args: tuple, kwargs: dict) -> None:
        self.executable = cls(*args, **kwargs) if cls is not None else None

    def run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        return fn(*args, **kwargs)

    def execute(self, fn: Callable) -> Any:
        return fn(self.executable)

    def pid(self) -> int:
        return os.getpid()


class Cluster:
    """The scheduler and server actors of one gradwire job on Ray, and the variables its workers need."""

    def __init__(
        self,
        num_workers: int,
        num_servers: int = 1,
        cpus_per_server: float = 1.0,
        server_resources: dict[str, float] | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if not ray.is_initialized():
            raise ConfigError("call ray.init() before starting gradwire on Ray")
        if num_workers < 1 or num_servers < 1:
            raise ConfigError(f"need at least one worker and one server, got {num_workers} and {num_servers}")
        _check_resources({"CPU": cpus_per_server * num_servers, **_scaled(server_resources, num_servers)}, "servers")
        self.env = dict(env or {}) | env_for(
            num_workers=num_workers, num_servers=num_servers, secret=secrets.token_hex(32), timeout=int(timeout_s)
        )
        here = ray.get_runtime_context().get_node_id()  # the driver's node: it outlives the job
        port_file = os.path.join(tempfile.gettempdir(), f"gradwire-scheduler-{secrets.token_hex(8)}.port")
        pinned = NodeAffinitySchedulingStrategy(node_id=here, soft=False)
        self.scheduler = _SchedulerActor.options(scheduling_strategy=pinned).remote(self.env, port_file)
        self.env |= env_for(scheduler=ray.get(self.scheduler.address.remote(), timeout=timeout_s))
        server_cls = ray.remote(num_cpus=cpus_per_server, resources=server_resources or {})(_ServerActor)
        self.servers = [server_cls.remote() for _ in range(num_servers)]
        self.serving = [s.serve.remote(self.env) for s in self.servers]  # each returns when the job ends

    def worker_env(self, rank: int) -> dict[str, str]:
        return self.env | env_for(rank=rank)

    def stop(self) -> None:
        try:
            ray.get(self.scheduler.stop.remote(), timeout=10)  # frees its port and removes its port file
        except Exception:  # noqa: BLE001 - dead or restarting: killed below all the same
            pass
        for actor in [*self.servers, self.scheduler]:
            ray.kill(actor, no_restart=True)


class RayExecutor:
    """Horovod's `horovod.ray.RayExecutor`, for gradwire: `start()`, `run(fn)`, `execute(fn)`, `shutdown()`.

    `num_workers` training actors (each `cpus_per_worker` CPUs, `gpus_per_worker` GPUs if `use_gpu`) and
    `num_servers` server actors (see the module's docstring). Call `ray.init()` first. The function given to `run`
    calls `gradwire.torch.init()` (or `gradwire.init()`) itself, as under horovod.ray.
    """

    def __init__(
        self,
        settings: Any = None,
        num_workers: int = 1,
        num_servers: int = 1,
        cpus_per_worker: float = 1.0,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        cpus_per_server: float = 1.0,
        server_resources: dict[str, float] | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.num_workers, self.num_servers = num_workers, num_servers
        self.cpus_per_worker, self.cpus_per_server = cpus_per_worker, cpus_per_server
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.server_resources, self.env = server_resources, dict(env or {})
        self.timeout_s = float(getattr(settings, "timeout_s", timeout_s))
        self.cluster: Cluster | None = None
        self.workers: list = []

    @staticmethod
    def create_settings(timeout_s: float = 300.0, **_: Any) -> Any:
        """Horovod's settings object; only the timeout means something here."""
        return _Settings(timeout_s)

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: tuple | list | None = None,
        executable_kwargs: dict | None = None,
        extra_env_vars: dict[str, str] | None = None,
    ) -> None:
        """Start the scheduler, the servers and the worker actors (each with an `executable_cls` instance, if given)."""
        self.cluster = Cluster(
            self.num_workers, self.num_servers, self.cpus_per_server, self.server_resources,
            self.env | (extra_env_vars or {}), self.timeout_s,
        )  # fmt: skip
        need = {"CPU": self.cpus_per_worker * self.num_workers, "GPU": self.gpus_per_worker * self.num_workers}
        need["CPU"] += self.cpus_per_server * self.num_servers
        _check_resources(need, f"{self.num_workers} workers and {self.num_servers} servers")
        worker_cls = ray.remote(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker)(_WorkerActor)
        self.workers = [worker_cls.remote(self.cluster.worker_env(r)) for r in range(self.num_workers)]
        args, kwargs = tuple(executable_args or ()), dict(executable_kwargs or {})
        ray.get([w.setup.remote(executable_cls, args, kwargs) for w in self.workers], timeout=self.timeout_s)

    def run_remote(self, fn: Callable, args: tuple | list | None = None, kwargs: dict | None = None) -> list:
        """Start `fn(*args, **kwargs)` on every worker; its object refs, in rank order."""
        self._check_started()
        return [w.run.remote(fn, tuple(args or ()), dict(kwargs or {})) for w in self.workers]

    def run(self, fn: Callable, args: tuple | list | None = None, kwargs: dict | None = None) -> list:
        """Run `fn(*args, **kwargs)` on every worker; one result per worker, in rank order. If a worker fails, the
        error raised is gradwire's (the survivors' WorkerLost naming the lost rank, or the worker's own)."""
        return _gather(self.run_remote(fn, args, kwargs))

    def execute(self, fn: Callable) -> list:
        """Run `fn(executable)` on every worker (the `executable_cls` instance); results in rank order."""
        self._check_started()
        return _gather([w.execute.remote(fn) for w in self.workers])

    def execute_single(self, fn: Callable) -> Any:
        """Run `fn(executable)` on worker 0 only."""
        self._check_started()
        return ray.get(self.workers[0].execute.remote(fn))

    def shutdown(self) -> None:
        """Stop every actor of the job."""
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    def _check_started(self) -> None:
        if self.cluster is None:
            raise ConfigError("call RayExecutor.start() first")


def _scaled(resources: dict[str, float] | None, times: int) -> dict[str, float]:
    return {k: v * times for k, v in (resources or {}).items()}


def _check_resources(need: dict[str, float], what: str) -> None:
    """Fail at once, saying what is missing, where the cluster cannot hold the job's actors (Ray would otherwise
    leave them pending, and the job waiting, without a word)."""
    have = ray.cluster_resources()
    short = {k: (v, have.get(k, 0.0)) for k, v in need.items() if v > 0 and have.get(k, 0.0) < v - 1e-9}
    if short:
        detail = ", ".join(f"{k}: needs {v:g}, the cluster has {h:g}" for k, (v, h) in short.items())
        raise ConfigError(
            f"the Ray cluster cannot hold gradwire's {what} ({detail}): lower cpus_per_worker / cpus_per_server, or "
            "add nodes (ray.init(num_cpus=...) on one machine)"
        )


@dataclass
class _Settings:
    timeout_s: float = 300.0


def _gather(refs: list) -> list:
    """Every result, in order; on failure the most telling error: a gradwire error a surviving worker raised (it
    names the rank that was lost) before a dead actor's bare RayActorError."""
    results: list = [None] * len(refs)
    errors: list[BaseException] = []
    for i, ref in enumerate(refs):
        try:
            results[i] = ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            errors.append(e.as_instanceof_cause())
        except ray.exceptions.RayActorError as e:
            errors.append(e)
    if errors:
        telling = [e for e in errors if isinstance(e, GradwireError)]
        raise (telling or errors)[0]
    return results


# -- Ray Train --------------------------------------------------------------------------------------------------

try:
    from ray.train.torch import TorchConfig
except ImportError:  # Ray without its Train library: RayExecutor only
    TorchConfig = None  # type: ignore[assignment,misc]


if TorchConfig is not None:

    @dataclass
    class GradwireConfig(TorchConfig):  # type: ignore[valid-type,misc]
        """A Ray Train backend: TorchTrainer's `torch_config=GradwireConfig(num_servers=2)` instead of
        `TorchConfig()`. It sets up torch.distributed as TorchConfig does (so `prepare_model`, DDP and gradwire's
        DDP comm hook keep working), then starts gradwire's scheduler and server actors and gives every training
        worker the job's variables: the training function calls `gradwire.torch.init()`."""

        num_servers: int = 1
        cpus_per_server: float = 1.0
        server_resources: dict[str, float] | None = None
        gradwire_env: dict[str, str] = field(default_factory=dict)
        timeout_s: float = 300.0

        @property
        def backend_cls(self) -> type:
            return _GradwireBackend

    class _GradwireBackend(TorchConfig().backend_cls):  # type: ignore[misc]
        """Ray Train's torch backend, plus a gradwire job for the worker group."""

        def on_start(self, worker_group: Any, backend_config: GradwireConfig) -> None:
            super().on_start(worker_group, backend_config)
            self._cluster = Cluster(
                len(worker_group), backend_config.num_servers, backend_config.cpus_per_server,
                backend_config.server_resources, backend_config.gradwire_env, backend_config.timeout_s,
            )  # fmt: skip
            for rank in range(len(worker_group)):
                worker_group.execute_single(rank, _set_env, self._cluster.worker_env(rank))

        def on_shutdown(self, worker_group: Any, backend_config: GradwireConfig) -> None:
            try:
                worker_group.execute(_leave)
            finally:
                cluster = getattr(self, "_cluster", None)
                if cluster is not None:
                    cluster.stop()
                super().on_shutdown(worker_group, backend_config)


def _set_env(env: dict[str, str]) -> None:
    os.environ.update(env | {"GRADWIRE_HOST": _node_address()})


def _leave() -> None:
    import gradwire

    if gradwire.is_initialized():
        gradwire.shutdown()
