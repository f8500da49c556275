"""Every configuration variable gradwire reads, with its aliases (BytePS's ``DMLC_*`` and torchrun's
``RANK``/``WORLD_SIZE``/...) and meaning: a table of data. Each sets one field of `gradwire.config.Config`, where its
type and default are declared; docs/env.md is checked against this table by a test.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    """One configuration variable: its name, the field of `Config` it sets, aliases and a one-line meaning. Its type
    and default are the field's, declared once there (gradwire/config.py: `default_of`)."""

    name: str
    field: str
    aliases: tuple[str, ...]
    doc: str


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
        "partitions a worker keeps unacknowledged per server; unset, it is derived from the links (at least 2, "
        "128 KiB per worker over all its servers, and twice the bandwidth-delay product)",
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
    EnvVar(
        "GRADWIRE_ENGINES",
        "engines",
        (),
        "engines per server, each owning a share of the keys: one runs on the server's link loop; more, on threads",
    ),
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
        "GRADWIRE_DATAPATH",
        "datapath",
        (),
        "`auto`: the native data path (gradwire-native) where it is installed at gradwire's version, else the Python "
        "one (an info line says why); `native`: the native one or an error saying why not; `python`: the Python one. "
        "Today the native path covers the servers' float16 and bfloat16 sums, and every worker's calls (a worker "
        "started with `GRADWIRE_TIMELINE` keeps the Python one) (docs/native.md)",
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
        "GRADWIRE_STANDBY_SCHEDULERS",
        "standby_schedulers",
        (),
        "under torchrun with no GRADWIRE_SCHEDULER: standby schedulers, started by local rank 0 of the second node "
        "(and the next ones); without one, global rank 0 restarts a scheduler that dies (docs/faults.md)",
    ),
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
        "GRADWIRE_SCHEDULER_TIMEOUT",
        "scheduler_timeout",
        (),
        "when the scheduler dies, how long workers and servers go on without it (the data path does not need it) "
        "waiting for a scheduler to start into the job at GRADWIRE_SCHEDULER and rebuild it from their reports "
        "(`gradwire launch` restarts it); past it the job ends naming the scheduler; 0: its loss ends the job at once",
    ),
    EnvVar(
        "GRADWIRE_SCHEDULER_STANDBY",
        "scheduler_standby",
        (),
        "standby schedulers' addresses, `host:port[,host:port...]`: a node whose scheduler is lost reports to the next "
        "one, which takes the job over once a majority of the job's nodes have (`gradwire launch "
        "--standby-schedulers`); a scheduler of such a job steps down when it loses its majority (docs/faults.md)",
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
        "a dead server's keys move to a standby or the surviving servers and workers resend what it lost (0: a "
        "dead server aborts the job, no copies)",
    ),
    EnvVar(
        "GRADWIRE_COMPRESSOR",
        "compressor",
        ("BYTEPS_COMPRESSOR",),
        "the compressor of DistributedOptimizer and the DDP wrappers where the code passes none: onebit, topk, "
        "randomk, dithering or powersgd, with their defaults and GRADWIRE_COMPRESSOR_K (docs/compression.md); "
        "empty: none",
    ),
    EnvVar(
        "GRADWIRE_COMPRESSOR_K",
        "compressor_k",
        ("BYTEPS_COMPRESSOR_K",),
        "with GRADWIRE_COMPRESSOR: topk's and randomk's k (a fraction, or a count per partition), dithering's levels, "
        "powersgd's rank",
    ),
    EnvVar(
        "GRADWIRE_COMPRESSION_MIN_BYTES",
        "compression_min_bytes",
        ("BYTEPS_MIN_COMPRESS_BYTES",),
        "tensors smaller than this travel uncompressed, whatever compressor is asked for (docs/compression.md)",
    ),
    EnvVar(
        "GRADWIRE_FAILOVER_COPY_BYTES",
        "failover_copy_bytes",
        (),
        "the most each worker keeps of the sums it received, for a failover: the job's first tensors up to this "
        "many bytes are copied on the workers; the sums of those past it are held in the workers' outputs instead, "
        "each call completing once every worker has its sums (GRADWIRE_FAILOVER_HOLD; no copy anywhere). 0: held "
        "for all",
    ),
    EnvVar(
        "GRADWIRE_FAILOVER_HOLD",
        "failover_hold",
        (),
        "past GRADWIRE_FAILOVER_COPY_BYTES, workers hold each sum in the call's output until every worker has it (1); "
        "0: a replica server keeps each sum instead, and answers a round only once it has it. Compressed and sliced "
        "tensors always have replicas (with one server, or once a server has died, workers copy their sums)",
    ),
    EnvVar(
        "GRADWIRE_NUM_STANDBY",
        "num_standby",
        (),
        "standby servers (scheduler): they take over a dead server's keys whole; `gradwire launch --standby-servers`",
    ),
    EnvVar(
        "GRADWIRE_STANDBY",
        "standby",
        (),
        "this server is a standby (idle until a server dies); this scheduler is a standby (it only takes a running "
        "job over)",
    ),
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
        "GRADWIRE_LOCAL_AGGREGATION",
        "local_aggregation",
        (),
        "where several workers share each host and every worker host has a colocated server, sum on the host first "
        "(through the colocated server's shared memory) and send each host's sum once each way, a share per worker "
        "(docs/local-aggregation.md); 0: every worker pushes its own copy",
    ),
    EnvVar(
        "GRADWIRE_HOST_ID",
        "host_id",
        (),
        "which host this node is on, as the job groups nodes (shared memory, a host's link, local aggregation); "
        "empty: detected (hostname, boot id, network namespace). Different values make processes of one machine "
        "act as different hosts (tests, benchmarks)",
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
