"""All configuration of gradwire, read from the environment in one place.

`Config.from_env()` is the only place that reads environment variables. Every variable, with its
aliases (BytePS's ``DMLC_*`` and torchrun's ``RANK``/``WORLD_SIZE``/...), is listed in `ENV_VARS`; the
table in docs/env.md is checked against it by a test. CLI flags are a thin layer that sets the same
variables.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from gradwire.errors import ConfigError
from gradwire.tuning import parse_rate

MiB = 1 << 20


@dataclass(frozen=True)
class EnvVar:
    """One configuration variable: its name, the field of `Config` it sets, aliases and a one-line meaning. Its type
    and default are the field's, declared once there."""

    name: str
    field: str
    aliases: tuple[str, ...]
    doc: str

    @property
    def default(self) -> str:
        """The field's default, spelled as this variable would be set to it ("" where unset means none)."""
        value = _DEFAULTS[self.field]
        if value is None:
            return ""
        if isinstance(value, bool):
            return "1" if value else "0"
        return f"{value:g}" if isinstance(value, float) else str(value)


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("GRADWIRE_ROLE", "role", ("DMLC_ROLE",), "`scheduler`, `server` or `worker`"),
    EnvVar(
        "GRADWIRE_SCHEDULER",
        "scheduler",
        (),
        "scheduler address `host:port`; or give `DMLC_PS_ROOT_URI` and `DMLC_PS_ROOT_PORT`",
    ),
    EnvVar("GRADWIRE_NUM_WORKERS", "num_workers", ("DMLC_NUM_WORKER", "WORLD_SIZE"), "workers in the job"),
    EnvVar("GRADWIRE_NUM_SERVERS", "num_servers", ("DMLC_NUM_SERVER",), "summation servers in the job"),
    EnvVar(
        "GRADWIRE_RANK",
        "rank",
        ("DMLC_WORKER_ID", "RANK"),
        "this node's rank within its role; empty: the scheduler assigns one in order of arrival",
    ),
    EnvVar("GRADWIRE_LOCAL_RANK", "local_rank", ("LOCAL_RANK",), "rank among the workers on this host"),
    EnvVar("GRADWIRE_LOCAL_SIZE", "local_size", ("LOCAL_WORLD_SIZE",), "workers on this host"),
    EnvVar(
        "GRADWIRE_HOST",
        "host",
        (),
        "address this node binds its data port to and advertises to the others",
    ),
    EnvVar(
        "GRADWIRE_PARTITION_BYTES",
        "partition_bytes",
        ("BYTEPS_PARTITION_BYTES",),
        "largest partition in bytes (element-aligned); unset, it is derived from the measured links (about 3.5 ms "
        "of the link per partition, at most this default; docs/netem.md)",
    ),
    EnvVar(
        "GRADWIRE_WINDOW",
        "window",
        (),
        "partitions a worker keeps unacknowledged per server; unset, it is derived from the links (at least 4, "
        "128 KiB and twice the bandwidth-delay product)",
    ),
    EnvVar(
        "GRADWIRE_UNANSWERED",
        "unanswered",
        (),
        "partitions a worker may have pushed to one server whose sum has not come back, except ones earlier in the "
        "job-wide order; 0: no cap. Unset, it is derived: 4 where the servers' links are the bottleneck, else none",
    ),
    EnvVar(
        "GRADWIRE_CREDIT_BYTES",
        "credit_bytes",
        (),
        "bytes a worker keeps in flight over all servers",
    ),
    EnvVar(
        "GRADWIRE_PACING",
        "pacing",
        (),
        "how far (in partitions) a worker's link to one server on another host may run ahead of its share of "
        "the bytes still to send; 0 turns pacing off (docs/placement.md)",
    ),
    EnvVar(
        "GRADWIRE_FUSION_BYTES",
        "fusion_bytes",
        (),
        "gradients under 64 KiB are fused into messages of up to this many bytes (torch); 0 turns fusion off",
    ),
    EnvVar(
        "GRADWIRE_RING_SLOTS",
        "ring_slots",
        (),
        "receive slots per server engine ring; a full ring is backpressure",
    ),
    EnvVar("GRADWIRE_ENGINES", "engines", (), "engine threads per server (each owns a share of the keys)"),
    EnvVar(
        "GRADWIRE_SECRET",
        "secret",
        (),
        "job secret for the HMAC handshake; the launcher makes one per job",
    ),
    EnvVar("GRADWIRE_SECRET_FILE", "secret_file", (), "file holding the job secret"),
    EnvVar(
        "GRADWIRE_TIMEOUT",
        "timeout",
        (),
        "seconds any blocking call (rendezvous, barrier, push_pull) waits before raising",
    ),
    EnvVar("GRADWIRE_MAX_FRAME_BYTES", "max_frame_bytes", (), "largest frame accepted from a peer"),
    EnvVar(
        "GRADWIRE_MAX_DECLARED_BYTES",
        "max_declared_bytes",
        (),
        "most tensor bytes a job may declare (bounds the servers' accumulators)",
    ),
    EnvVar(
        "GRADWIRE_HANDSHAKE_TIMEOUT",
        "handshake_timeout",
        (),
        "seconds a new connection has to authenticate before it is dropped",
    ),
    EnvVar(
        "GRADWIRE_FRAME_TIMEOUT",
        "frame_timeout",
        (),
        "seconds a frame, once begun, has to arrive whole (a stalled peer cannot hold a server's slot)",
    ),
    EnvVar(
        "GRADWIRE_MAX_PENDING_HANDSHAKES",
        "max_pending_handshakes",
        (),
        "connections a server or scheduler authenticates at once; more are closed at once",
    ),
    EnvVar(
        "GRADWIRE_TRANSPORT",
        "transport",
        (),
        "`auto`: shared memory (over a Unix socket) to servers on the same host and network namespace, TCP "
        "otherwise; `unix`: Unix sockets without shared memory; `tcp`: always TCP",
    ),
    EnvVar(
        "GRADWIRE_SOCKET_BUFFER_BYTES",
        "socket_buffer_bytes",
        (),
        "SO_SNDBUF/SO_RCVBUF for data connections; 0 leaves the kernel's autotuning",
    ),
    EnvVar(
        "GRADWIRE_SWITCH_INTERVAL",
        "switch_interval",
        (),
        "sys.setswitchinterval for worker processes, so I/O threads get the GIL promptly; 0 leaves it",
    ),
    EnvVar("GRADWIRE_LOG_LEVEL", "log_level", (), "logging level of gradwire's loggers"),
    EnvVar("GRADWIRE_ADMIN_HOST", "admin_host", (), "address of every node's admin HTTP endpoint"),
    EnvVar(
        "GRADWIRE_ADMIN_PORT",
        "admin_port",
        (),
        "port of the admin endpoint (/metrics, /status, /healthz); 0 picks a free one, -1 turns it off",
    ),
    EnvVar(
        "GRADWIRE_HEARTBEAT_INTERVAL",
        "heartbeat_interval",
        (),
        "seconds between a node's heartbeats to the scheduler (they carry its counters for /status)",
    ),
    EnvVar(
        "GRADWIRE_HEARTBEAT_TIMEOUT",
        "heartbeat_timeout",
        (),
        "a node the scheduler has not heard from for this long is lost and the job aborts; 0: off",
    ),
    EnvVar(
        "GRADWIRE_TIMELINE",
        "timeline",
        (),
        "write each worker's Chrome-trace timeline here (`{rank}` is replaced, else `.rank<r>` is added)",
    ),
    EnvVar("GRADWIRE_TIMELINE_STEPS", "timeline_steps", (), "steps the timeline keeps (the most recent)"),
    EnvVar(
        "GRADWIRE_SERVERS_PER_NODE",
        "servers_per_node",
        (),
        "under torchrun with no GRADWIRE_SCHEDULER: servers that local rank 0 of each node starts beside its workers "
        "(docs/deploy.md)",
    ),
    EnvVar(
        "GRADWIRE_REINIT_SECONDS",
        "reinit_seconds",
        (),
        "after every worker called shutdown() in a process that lives on, the scheduler and servers wait up to "
        "this long for them to init() again (a new generation of the job, as Horovod's shutdown/init); the job "
        "ends sooner once every worker process has exited; 0: it ends at the last shutdown()",
    ),
    EnvVar(
        "GRADWIRE_STALL_SECONDS",
        "stall_seconds",
        (),
        "a round waiting this long is logged by its server (which ranks have not pushed which tensor); 0: off",
    ),
    EnvVar(
        "GRADWIRE_DETERMINISTIC",
        "deterministic",
        (),
        "servers add contributions in rank order whatever order they arrive in, so sums are bit-identical from "
        "run to run (and across a server failover); 0 adds in arrival order and stages nothing",
    ),
    EnvVar(
        "GRADWIRE_SERVER_FAILOVER",
        "server_failover",
        (),
        "a dead server's keys move to a standby or the surviving servers and workers resend what it lost; workers "
        "keep a copy of each partition's last sum for that (0: a dead server aborts the job, no copies)",
    ),
    EnvVar(
        "GRADWIRE_NUM_STANDBY",
        "num_standby",
        (),
        "standby servers (scheduler): they take over a dead server's keys whole; `gradwire launch --standby-servers`",
    ),
    EnvVar("GRADWIRE_STANDBY", "standby", (), "this server is a standby (idle until a server dies)"),
    EnvVar(
        "GRADWIRE_COLOCATED",
        "colocated",
        (),
        "this server runs on a worker host (`gradwire launch --colocate`): it gets that host's share of the bytes",
    ),
    EnvVar(
        "GRADWIRE_PLACEMENT",
        "placement",
        (),
        "how bytes are split over servers (scheduler): `auto`, the optimal split for link rates measured at "
        "start-up (which also set the partition size and window, gradwire/tuning.py; GRADWIRE_LINK_RATE given on "
        "every node is used instead); `model`, the same for GRADWIRE_LINK_RATE only (equal if unset); `equal`, "
        "every server alike (docs/placement.md)",
    ),
    EnvVar(
        "GRADWIRE_ADAPT",
        "adapt",
        (),
        "follow the links while the job runs (scheduler): when the measured rate stays 2x away from the one the "
        "partition size and window were derived for, derive them again and re-cut the tensors (docs/netem.md); 0: off",
    ),
    EnvVar(
        "GRADWIRE_SERVER_EFFICIENCY",
        "server_efficiency",
        (),
        "when the model's optimum mixes colocated and dedicated servers, the share of a dedicated server's link it "
        "counts on; below 1 leaves slack on the dedicated links (docs/placement.md)",
    ),
    EnvVar(
        "GRADWIRE_LINK_RATE",
        "link_rate",
        (),
        "this node's network rate for the placement model, tc's spelling (`25gbit`, `100mbit`); unset: equal",
    ),
    EnvVar(
        "GRADWIRE_MIN_WORKERS",
        "min_workers",
        (),
        "elastic mode when above 0: the job goes on while at least this many workers are alive "
        "(`gradwire launch --min-workers`; see docs/faults.md)",
    ),
    EnvVar(
        "GRADWIRE_MAX_WORKERS",
        "max_workers",
        (),
        "elastic mode: the most workers the job admits (new ones join at a commit); 0: GRADWIRE_NUM_WORKERS",
    ),
)


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
    servers_per_node: int = 1
    deterministic: bool = True
    server_failover: bool = True
    num_standby: int = 0
    standby: bool = False
    min_workers: int = 0
    max_workers: int = 0
    colocated: bool = False
    placement: str = "auto"
    adapt: bool = True
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

    def tuned(self, tuning: dict | None) -> Config:
        """This config with the scheduler's derived settings (gradwire/tuning.py) for every field not set
        explicitly; unchanged without them."""
        if not tuning:
            return self
        fields = {f: int(tuning[f]) for f in ("partition_bytes", "window", "unanswered") if f in tuning}
        return dataclasses.replace(self, **{f: v for f, v in fields.items() if f not in self.explicit})

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
        host, _, port = self.scheduler.rpartition(":")
        return host.strip("[]"), int(port)

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
        if ":" not in self.scheduler:
            raise ConfigError(f"GRADWIRE_SCHEDULER must be host:port, got {self.scheduler!r}")
        if self.transport not in ("auto", "unix", "tcp"):
            raise ConfigError(f"GRADWIRE_TRANSPORT must be auto, unix or tcp, got {self.transport!r}")
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
