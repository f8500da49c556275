"""All configuration of gradwire, read from the environment in one place.

`Config.from_env()` is the only place that reads environment variables. Every variable, with its aliases (BytePS's
``DMLC_*`` and torchrun's ``RANK``/``WORLD_SIZE``/...), is listed in `ENV_VARS` (gradwire/env_vars.py); the table in
docs/env.md is checked against it by a test. CLI flags are a thin layer that sets the same variables.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from gradwire.env_vars import ENV_VARS, EnvVar
from gradwire.errors import ConfigError
from gradwire.tuning import Tuning, parse_rate

KiB = 1 << 10
MiB = 1 << 20
DATAPATHS = ("auto", "native", "python")  # GRADWIRE_DATAPATH's values (gradwire/native.py)


@dataclass(frozen=True)
class Config:
    """The configuration of one node. Immutable; build it with `from_env` or `dataclasses.replace`."""

    role: str = "worker"
    scheduler: str = "127.0.0.1:0"
    num_workers: int = 1
    num_servers: int = 1
    rank: int | None = None
    local_rank: int | None = None
    local_size: int | None = None
    host: str = "127.0.0.1"
    partition_bytes: int = 4 * MiB
    window: int = 4
    unanswered: int = 0
    credit_bytes: int = 256 * MiB
    pacing: int = 8
    fusion_bytes: int = 1 * MiB
    ring_slots: int = 16
    engines: int = 1
    secret: str = dataclasses.field(default="", repr=False)
    secret_file: str = ""
    timeout: float = 300.0
    max_frame_bytes: int = 64 * MiB
    max_declared_bytes: int = 64 * 1024 * MiB
    handshake_timeout: float = 10.0
    frame_timeout: float = 60.0
    max_pending_handshakes: int = 64
    transport: str = "auto"
    datapath: str = "auto"
    socket_buffer_bytes: int = 0
    switch_interval: float = 0.0005
    log_level: str = "WARNING"
    admin_host: str = "127.0.0.1"
    admin_port: int = 0
    heartbeat_interval: float = 5.0
    heartbeat_timeout: float = 30.0
    timeline: str = ""
    timeline_steps: int = 20
    stall_seconds: float = 60.0
    reinit_seconds: float = 60.0
    # how long nodes go on without a scheduler, waiting for one to start into the job (scheduler/recovery.py); 0: the
    # scheduler's loss ends the job at once
    scheduler_timeout: float = 60.0
    # standby schedulers' addresses, host:port[,host:port...]: nodes try them after GRADWIRE_SCHEDULER when their
    # scheduler is lost, and a scheduler acts only while it holds a majority's lease (scheduler/lease.py)
    scheduler_standby: str = ""
    # under torchrun: standby schedulers, one on each of the nodes after the first (launch/torchrun.py)
    standby_schedulers: int = 0
    servers_per_node: int = 1
    deterministic: bool = True
    server_failover: bool = True
    # the most a worker keeps of sums for a failover; tensors past it have their sums held in the workers' outputs
    # until every worker has them (or, with failover_hold off, kept by a replica server)
    failover_copy_bytes: int = 256 * MiB
    failover_hold: bool = True
    # tensors smaller than this travel uncompressed whatever compressor is asked for (BytePS's threshold)
    compression_min_bytes: int = 64 * KiB
    # the compressor DistributedOptimizer and the DDP wrappers use where none is passed ("": none), and its k
    compressor: str = ""
    compressor_k: float = 0.01
    num_standby: int = 0
    standby: bool = False
    min_workers: int = 0
    max_workers: int = 0
    colocated: bool = False
    placement: str = "auto"
    adapt: bool = True
    local_aggregation: bool = True
    host_id: str = ""
    server_efficiency: float = 1.0
    link_rate: str = ""
    # the fields set by the user (environment or overrides), which the scheduler's derived tuning never replaces
    explicit: frozenset[str] = dataclasses.field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> Config:
        """Read every `ENV_VARS` entry (the GRADWIRE_ name first, then its aliases in order)."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for var in ENV_VARS:
            raw = _lookup(env, var)
            if raw is None:
                continue
            values[var.field] = _parse(var, raw)
        if "scheduler" not in values and env.get("DMLC_PS_ROOT_URI"):
            values["scheduler"] = f"{env['DMLC_PS_ROOT_URI']}:{env.get('DMLC_PS_ROOT_PORT', '0')}"
        values.update(overrides)
        values.setdefault("explicit", frozenset(values))
        return cls(**values)  # type: ignore[arg-type]

    def tuned(self, tuning: Tuning | None) -> Config:
        """This config with the scheduler's derived settings (gradwire/tuning.py) for every field not set
        explicitly; unchanged without them."""
        if tuning is None:
            return self
        return dataclasses.replace(self, **{f: v for f, v in tuning.settings().items() if f not in self.explicit})

    def link_rate_bytes(self) -> float:
        """GRADWIRE_LINK_RATE in bytes per second (0.0 when unset)."""
        if not self.link_rate:
            return 0.0
        return parse_rate(self.link_rate) / 8

    @property
    def elastic(self) -> bool:
        """Elastic mode: workers may leave (down to min_workers) and join (up to max_workers)."""
        return self.min_workers > 0

    @property
    def worker_limit(self) -> int:
        return self.max_workers or self.num_workers

    @property
    def scheduler_address(self) -> tuple[str, int]:
        """The scheduler's (host, port)."""
        return split_address(self.scheduler)

    @property
    def scheduler_addresses(self) -> list[str]:
        """Where a scheduler of this job may run: GRADWIRE_SCHEDULER, then the standbys (GRADWIRE_SCHEDULER_STANDBY)."""
        return [self.scheduler] + [a.strip() for a in self.scheduler_standby.split(",") if a.strip()]

    @property
    def leased(self) -> bool:
        """The job has standby schedulers (this node knows their addresses, or is one): a scheduler acts for it only
        while it holds its lease, and one that loses it steps down (scheduler/lease.py)."""
        return bool(self.scheduler_standby) or (self.role == "scheduler" and self.standby)

    def secret_bytes(self) -> bytes:
        """The job secret: GRADWIRE_SECRET, else the contents of GRADWIRE_SECRET_FILE, else empty."""
        if self.secret:
            return self.secret.encode()
        if self.secret_file:
            try:
                with open(self.secret_file, "rb") as f:
                    return f.read().strip()
            except OSError as e:
                raise ConfigError(f"cannot read GRADWIRE_SECRET_FILE {self.secret_file!r}: {e}") from e
        return b""

    def _check(self) -> None:
        if self.role not in ("scheduler", "server", "worker"):
            raise ConfigError(f"GRADWIRE_ROLE must be scheduler, server or worker, not {self.role!r}")
        if self.num_workers < 1 or self.num_servers < 1:
            raise ConfigError(
                f"need at least one worker and one server, got GRADWIRE_NUM_WORKERS={self.num_workers} "
                f"GRADWIRE_NUM_SERVERS={self.num_servers}"
            )
        if self.partition_bytes < 8 or self.partition_bytes > self.max_frame_bytes:
            raise ConfigError(
                f"GRADWIRE_PARTITION_BYTES={self.partition_bytes} must lie in [8, "
                f"GRADWIRE_MAX_FRAME_BYTES={self.max_frame_bytes}]"
            )
        for name in ("window", "ring_slots", "engines"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.pacing < 0:
            raise ConfigError(f"GRADWIRE_PACING must be 0 (off) or more, got {self.pacing}")
        if self.credit_bytes < self.partition_bytes:
            raise ConfigError(
                f"GRADWIRE_CREDIT_BYTES={self.credit_bytes} must be at least one partition "
                f"(GRADWIRE_PARTITION_BYTES={self.partition_bytes})"
            )
        self._check_scheduler()
        self._check_wire()
        self._check_membership()

    def _check_wire(self) -> None:
        """What travels and how: compression, the failover copies, the transport."""
        if self.compressor not in ("", "none", "onebit", "topk", "randomk", "dithering", "powersgd"):
            raise ConfigError(
                "GRADWIRE_COMPRESSOR must be onebit, topk, randomk, dithering, powersgd or empty, "
                f"got {self.compressor!r}"
            )
        for name in ("compression_min_bytes", "failover_copy_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"GRADWIRE_{name.upper()} must be >= 0, got {getattr(self, name)}")
        if self.transport not in ("auto", "unix", "tcp"):
            raise ConfigError(f"GRADWIRE_TRANSPORT must be auto, unix or tcp, got {self.transport!r}")
        if self.datapath not in DATAPATHS:
            raise ConfigError(f"GRADWIRE_DATAPATH must be auto, native or python, got {self.datapath!r}")

    def _check_membership(self) -> None:
        """Who may join (elastic bounds, standby servers), where servers go, and how long anything may wait."""
        if self.min_workers < 0 or self.min_workers > self.num_workers:
            raise ConfigError(
                f"GRADWIRE_MIN_WORKERS={self.min_workers} must lie in [0, GRADWIRE_NUM_WORKERS={self.num_workers}]"
            )
        if self.max_workers and self.max_workers < self.num_workers:
            raise ConfigError(
                f"GRADWIRE_MAX_WORKERS={self.max_workers} must be at least GRADWIRE_NUM_WORKERS={self.num_workers}"
            )
        if not 0 < self.server_efficiency <= 1:
            raise ConfigError(f"GRADWIRE_SERVER_EFFICIENCY must lie in (0, 1], got {self.server_efficiency}")
        if self.placement not in ("model", "auto", "equal"):
            raise ConfigError(f"GRADWIRE_PLACEMENT must be model, auto or equal, got {self.placement!r}")
        if self.link_rate:
            try:
                self.link_rate_bytes()
            except ValueError as e:
                raise ConfigError(f"GRADWIRE_LINK_RATE: {e}") from None
        if self.num_standby < 0:
            raise ConfigError(f"GRADWIRE_NUM_STANDBY must be at least 0, got {self.num_standby}")
        if self.timeout <= 0:
            raise ConfigError(f"GRADWIRE_TIMEOUT must be positive, got {self.timeout}")

    def _check_scheduler(self) -> None:
        for address in self.scheduler_addresses:
            split_address(address)
        if self.scheduler_timeout < 0:
            raise ConfigError(f"GRADWIRE_SCHEDULER_TIMEOUT must be >= 0, got {self.scheduler_timeout}")
        if self.standby_schedulers < 0:
            raise ConfigError(f"GRADWIRE_STANDBY_SCHEDULERS must be at least 0, got {self.standby_schedulers}")
        if self.leased and self.heartbeat_timeout <= 0:
            raise ConfigError("standby schedulers need GRADWIRE_HEARTBEAT_TIMEOUT > 0 (the lease is half of it)")


def split_address(address: str) -> tuple[str, int]:
    """`host:port` (GRADWIRE_SCHEDULER's, a standby's) as (host, port); ConfigError if it is not one."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"GRADWIRE_SCHEDULER and GRADWIRE_SCHEDULER_STANDBY take host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _lookup(env: Mapping[str, str], var: EnvVar) -> str | None:
    for name in (var.name, *var.aliases):
        value = env.get(name)
        if value is not None and value != "":
            return value
    return None


def _parse(var: EnvVar, raw: str) -> object:
    kind = _FIELD_TYPES[var.field]  # from Config's annotations: one place says what type a setting is
    if kind == "bool":
        value = raw.strip().lower()
        if value not in _TRUE + _FALSE:
            raise ConfigError(f"{var.name} must be 1/0 (true/false, yes/no, on/off), got {raw!r}")
        return value in _TRUE
    try:
        if kind in ("int", "int | None"):
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise ConfigError(f"{var.name} must be a number, got {raw!r}") from None
    if var.field == "role":
        return raw.strip().lower()
    return raw


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_FIELD_TYPES = {f.name: str(f.type) for f in dataclasses.fields(Config)}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}


def default_of(var: EnvVar) -> str:
    """The default of `var`'s field, spelled as the variable would be set to it ("" where unset means none)."""
    return _spelled(_DEFAULTS[var.field])


def env_for(**fields: object) -> dict[str, str]:
    """The environment that sets these Config fields, by the table's variable names (the launchers make their
    children's environments with it): env_for(num_workers=4, standby=True) == {"GRADWIRE_NUM_WORKERS": "4",
    "GRADWIRE_STANDBY": "1"}. Unknown fields are an error (a misspelt setting must not vanish)."""
    unknown = sorted(set(fields) - _BY_FIELD.keys())
    if unknown:
        raise ConfigError(f"no GRADWIRE_* variable sets {', '.join(unknown)}")
    return {_BY_FIELD[f].name: _spelled(v) for f, v in fields.items()}


def _spelled(value: object) -> str:
    """A value as an environment variable spells it ("" for None)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    return f"{value:g}" if isinstance(value, float) else str(value)


_BY_FIELD = {v.field: v for v in ENV_VARS}

__all__ = ["ENV_VARS", "Config", "EnvVar", "default_of", "env_for"]


def worker_env(rank: int, size: int) -> dict[str, str]:
    """A worker's place in a one-host job, in gradwire's variables, torchrun's and horovodrun's (scripts, and Horovod's
    own tests, read them)."""
    r, n = str(rank), str(size)
    return env_for(role="worker", rank=rank, local_rank=rank, local_size=size) | {
        "RANK": r,
        "LOCAL_RANK": r,
        "WORLD_SIZE": n,
        "LOCAL_WORLD_SIZE": n,
        "HOROVOD_RANK": r,
        "HOROVOD_SIZE": n,
        "HOROVOD_LOCAL_RANK": r,
        "HOROVOD_LOCAL_SIZE": n,
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "1",
    }
