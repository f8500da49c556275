"""`gradwire` command line. Flags are a thin layer that sets GRADWIRE_* variables (see docs/env.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from gradwire.config import Config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradwire", description="Gradient aggregation through summation servers.")
    sub = parser.add_subparsers(dest="subcommand", required=True)
    sub.add_parser("scheduler", help="run the job's scheduler (GRADWIRE_SCHEDULER gives host:port)")
    sub.add_parser("server", help="run one summation server")
    launch = sub.add_parser("launch", help="start a whole job on this machine")
    _add_launch_arguments(launch)
    netem = sub.add_parser("netem", help="an emulated cluster on this machine (root): run a job, check a link")
    from gradwire.netem.cli import add_arguments as add_netem_arguments

    add_netem_arguments(netem)
    plan = sub.add_parser("plan", help="the model's step time for a topology: ring, service, colocated, the mix")
    from gradwire.launch.plan import add_arguments as add_plan_arguments

    add_plan_arguments(plan)
    top = sub.add_parser("top", help="a refreshing view of a running job (the scheduler's /status)")
    top.add_argument("url", help="the scheduler's admin URL, as printed at its start")
    top.add_argument("--interval", type=float, default=1.0)
    top.add_argument("--once", action="store_true", help="print one view and exit")
    bench = sub.add_parser("bench", help="push_pull against gloo all_reduce, same sizes, same run")
    from gradwire.bench.cli import add_arguments

    add_arguments(bench)
    args = parser.parse_args(argv)
    role = args.subcommand
    config = Config.from_env(role=role) if role in ("scheduler", "server") else Config.from_env()
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if role == "scheduler":
        return run_scheduler(config)
    if role == "server":
        return run_server(config)
    if role == "launch":
        return launch_from_args(args)
    if role == "plan":
        from gradwire.launch.plan import main as plan_main

        return plan_main(args)
    if role == "top":
        from gradwire.admin.top import main as top_main

        return top_main(args.url, args.interval, args.once)
    if role == "netem":
        from gradwire.netem.cli import main as netem_main

        return netem_main(args)
    from gradwire.bench.cli import run

    return run(args)


def _add_launch_arguments(launch: argparse.ArgumentParser) -> None:
    """`gradwire launch`'s flags: the job's shape, its spares (standby servers and schedulers), elasticity."""
    launch.add_argument("-n", "--num-workers", type=int, required=True)
    launch.add_argument("-s", "--num-servers", type=int, default=1)
    launch.add_argument(
        "--standby-servers",
        type=int,
        default=0,
        help="idle servers that take a dead server's keys whole (without one they move onto the survivors)",
    )
    launch.add_argument(
        "--standby-schedulers",
        type=int,
        default=0,
        help="schedulers that take the job over when the scheduler is lost (without one, a dead one is restarted)",
    )
    launch.add_argument(
        "--colocate",
        action="store_true",
        help="also run a server beside each worker (BytePS's colocated servers); -s counts the dedicated ones (0 ok)",
    )
    launch.add_argument(
        "--min-workers",
        type=int,
        default=0,
        help="elastic: the job goes on while this many workers live (gradwire.torch.elastic); 0: not elastic",
    )
    launch.add_argument(
        "--max-workers",
        type=int,
        default=0,
        help="elastic: a dead worker is replaced by a new one that joins, keeping the job at most this size",
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="processes started again at most: a dead scheduler (always), dead workers (elastic)",
    )
    launch.add_argument("--host", default="127.0.0.1", help="address every node binds and advertises")
    launch.add_argument("--timeout", type=float, default=None, help="seconds any blocking call may wait")
    launch.add_argument("command", nargs=argparse.REMAINDER, help="the worker command, after --")


def run_scheduler(config: Config) -> int:
    """Run the scheduler until the job ends; the first line printed is its address (the launcher reads it). Exits 0
    when the job ended cleanly, STEPPED_DOWN when it stopped acting for the job (scheduler/lease.py), else 1."""
    import threading

    from gradwire.scheduler import Scheduler

    scheduler = Scheduler(config).start()
    what = "standby scheduler" if config.standby else "scheduler"
    print(f"gradwire {what} listening on {scheduler.address} (pid {os.getpid()})", flush=True)
    if scheduler.admin_url:
        print(f"gradwire scheduler admin on {scheduler.admin_url} (/status, /metrics)", flush=True)
    threading.Thread(target=_say_resumed, args=(scheduler,), name="gw-sched-resumed", daemon=True).start()
    reason = scheduler.wait()
    scheduler.stop()
    if scheduler.stepped_down:
        print(f"gradwire scheduler: stepped down: {scheduler.stepped_down}", file=sys.stderr, flush=True)
        return STEPPED_DOWN
    if reason:
        print(f"gradwire scheduler: job aborted: {reason}", file=sys.stderr, flush=True)
    return 1 if reason else 0


STEPPED_DOWN = 3  # a scheduler's exit code when it stopped acting for the job: another one may act for it


def _say_resumed(scheduler) -> None:
    """One line once this scheduler has resumed a running job (the launcher and tests read which process is in
    charge from it)."""
    recovery = scheduler.recovery
    while not recovery.done.wait(0.5):
        if scheduler.roster.done.is_set():
            return
    from gradwire.scheduler.recovery import RESUMED_LINE

    print(f"{RESUMED_LINE}{scheduler.roster.term} (pid {os.getpid()})", flush=True)


def run_server(config: Config) -> int:
    """Run one summation server until the scheduler says the job is over."""
    from gradwire.server import Server

    try:
        server = Server(config).start()
    except Exception as e:  # noqa: BLE001 - a clear one-line message instead of a traceback
        print(f"gradwire server: cannot join the job at {config.scheduler}: {e}", file=sys.stderr, flush=True)
        return 1
    role = f"standby server (pid {os.getpid()})" if server.standby else f"server {server.rank} (pid {os.getpid()})"
    print(f"gradwire {role} serving on {config.host}:{server.port}", flush=True)
    reason = server.wait()
    server.stop()
    if reason:
        print(f"gradwire server {server.rank}: {reason}", file=sys.stderr, flush=True)
    return 1 if reason else 0


if __name__ == "__main__":
    os._exit(main())


def launch_from_args(args: argparse.Namespace) -> int:
    """`gradwire launch`: check the settings, then run the whole job (launch/launcher.py)."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    # fail early on bad settings
    if args.standby_schedulers < 0:
        raise SystemExit("gradwire launch: --standby-schedulers must be at least 0")
    if args.num_servers < (0 if args.colocate else 1):
        raise SystemExit("gradwire launch: -s must be at least 1 (0 only with --colocate)")
    Config.from_env(
        num_workers=args.num_workers,
        num_servers=args.num_servers + (args.num_workers if args.colocate else 0),
        num_standby=args.standby_servers,
        min_workers=args.min_workers,
        max_workers=args.max_workers,
    )
    from gradwire.launch.launcher import Launcher

    return Launcher(
        args.num_workers,
        args.num_servers,
        command,
        args.host,
        args.timeout,
        standby=args.standby_servers,
        min_workers=args.min_workers,
        max_workers=args.max_workers,
        max_restarts=args.max_restarts,
        colocate=args.colocate,
        standby_schedulers=args.standby_schedulers,
    ).run()
