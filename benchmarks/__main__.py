"""`python -m benchmarks`: the lab's harnesses (benchmarks/__init__.py), with every option of `gradwire bench` too
(the job's size and settings, the emulated network's configurations, training); without a lab mode it runs what
`gradwire bench` runs.

    python -m benchmarks --floor -n 4 -s 4 --sizes 64              # the native floor's job beside gloo's
    python -m benchmarks --partitions 32,4096 --sizes 16           # CPU per GB by partition size
    python -m benchmarks --netem --scale                           # samples/s against n, replayed compute
    python -m benchmarks --failover --kill scheduler               # detection and recovery times
    python -m benchmarks --ps --compression                        # ServerOptimizer with compressors, on digits
"""

from __future__ import annotations

import argparse
import os
import sys

from gradwire.bench import cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_arguments(parser)
    _data_path_arguments(parser)
    _scale_arguments(parser)
    _fault_arguments(parser)
    _model_arguments(parser)


def _data_path_arguments(parser: argparse.ArgumentParser) -> None:
    """The data path's own cost: by partition size, and its floor."""
    parser.add_argument(
        "--partitions",
        default=None,
        metavar="KIB,...",
        help="CPU seconds per GB of workers and servers by partition size (KiB, comma-separated; TCP, the first of "
        "--sizes), beside the floor of a Python data path with nothing else in it (benchmarks/floor.py)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="the native floor (benchmarks/floor.py, gradwire-native) as a job of n workers and k servers over TCP "
        "loopback, at each of --partitions (default 32,4096 KiB), beside gloo and gradwire's own job, first of --sizes",
    )


def _scale_arguments(parser: argparse.ArgumentParser) -> None:
    """Scaling with a profiled model's compute replayed, on the emulated network."""
    parser.add_argument(
        "--scale",
        action="store_true",
        help="with --netem: samples/s against n (--scale-workers) with a profiled model's compute replayed, "
        "dedicated and colocated servers against DDP over gloo, each point beside the model's prediction",
    )
    parser.add_argument("--scale-workers", default="1,2,4,8", help="with --scale: the numbers of workers")
    parser.add_argument("--scale-rate", default="100mbit", help="with --scale: every link's rate (tc's spelling)")
    parser.add_argument(
        "--replay", default=None, help="with --scale: a profile (benchmarks/replay.py), not the default"
    )


def _fault_arguments(parser: argparse.ArgumentParser) -> None:
    """Failover and elastic runs: what is killed, when, how often."""
    parser.add_argument(
        "--failover",
        action="store_true",
        help="SIGKILL a server (with and without a standby) and a worker mid-run: detection and recovery times",
    )
    parser.add_argument(
        "--kill",
        choices=("server", "worker", "scheduler"),
        default=None,
        help="with --failover: only this process's trials (default: server and worker; scheduler: SIGKILLed and "
        "restarted, or its standby taking the job over)",
    )
    parser.add_argument("--failover-mib", type=float, default=2.0, help="with --failover: MiB per tensor (8 tensors)")
    parser.add_argument(
        "--failover-rate", default="100mbit", help="with --failover --netem: every emulated link's rate (tc's spelling)"
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="the elastic example with worker 2 SIGKILLed at a random moment, --runs times: completions, hangs, "
        "times to the re-formed job and to the replacement, accuracy",
    )
    parser.add_argument("--runs", type=int, default=20, help="with --elastic: runs with a kill")
    parser.add_argument("--seed", type=int, default=0, help="with --elastic: the moments' random seed")
    parser.add_argument("--timeout", type=float, default=180, help="with --elastic: a run's deadline (then: a hang)")


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    """Parameter-server mode, accuracy to the same epochs, and large models."""
    parser.add_argument(
        "--ps",
        action="store_true",
        help="parameter-server mode: worker memory (25M-parameter MLP, Adam) and digits training, sync and async, "
        "against DistributedOptimizer; with --compression: ServerOptimizer on digits with onebit and top-k 1%% beside "
        "uncompressed (accuracy, bytes pushed), on --async-runs seeds",
    )
    parser.add_argument("--slow-ms", type=float, default=20.0, help="with --ps: the slow worker's sleep per step")
    parser.add_argument("--epochs", type=int, default=16, help="with --ps, --elastic or --accuracy: training epochs")
    parser.add_argument("--async-runs", type=int, default=3, help="with --ps: runs of each asynchronous way")
    parser.add_argument(
        "--dc",
        type=float,
        default=0.0,
        metavar="LAMBDA",
        help="with --ps: only the slowed digits runs, synchronous, asynchronous and asynchronous with delay "
        "compensation LAMBDA, on --async-runs seeds each",
    )
    parser.add_argument(
        "--accuracy",
        action="store_true",
        help="the digits CNN to the same epochs, uncompressed and with onebit, top-k 1%% and PowerSGD rank 2: test "
        "accuracy per way (docs/compression.md); with --netem: time to accuracy on the emulated network, against DDP "
        "over gloo plain and with torch's PowerSGD hook",
    )
    parser.add_argument("--accuracy-runs", type=int, default=4, help="with --accuracy: runs (seeds) per way")
    parser.add_argument(
        "--task",
        choices=["digits", "mnist1d"],
        default="digits",
        help="with --accuracy: the README demo's digits CNN, or the larger MNIST-1D task (the bench extra's mnist1d)",
    )
    parser.add_argument(
        "--large",
        action="store_true",
        help="a 1.2 GB tensor and a 0.35B-parameter transformer: first and steady calls, peak RSS per worker, against "
        "gloo and DDP",
    )
    parser.add_argument(
        "--gil",
        action="store_true",
        help="a training thread's step while its process's data path is busy, against the same step alone, on the "
        "native and the Python path (benchmarks/gil.py; --sizes' first is the busy tensor's MiB, --steps the steps)",
    )
    parser.add_argument("--gil-rate", type=float, default=100.0, help="with --gil: the busy thread's MB per second")
    parser.add_argument("--large-elements", type=int, default=300_000_000, help="with --large: the tensor's elements")
    parser.add_argument(
        "--calls", type=int, default=4, help="with --large: calls on the tensor (steady: the median from the third on)"
    )


def run(args: argparse.Namespace) -> int:
    os.environ["GRADWIRE_BENCH_COLLECTIVE"] = args.collective  # read by the benchmark's worker processes
    code = _run_mode(args, cli.job_env(args))
    return cli.run(args) if code is None else code


def _run_mode(args: argparse.Namespace, env: dict[str, str]) -> int | None:
    """The harness a lab option names, run (its exit code); None: none named, `gradwire bench`'s own."""
    if args.floor:
        from benchmarks.floor import run_job_bench

        return run_job_bench(args, env)
    if args.partitions:
        from benchmarks.partitions import run_partitions

        return run_partitions(args, env)
    if args.gil:
        from benchmarks.gil import run_gil

        return run_gil(args, env)
    if args.large:
        from benchmarks.large import run_large

        return run_large(args)
    if args.accuracy and args.netem:
        from benchmarks.time_to_accuracy import run_time_to_accuracy

        return run_time_to_accuracy(args, env)
    if args.accuracy:
        from benchmarks.accuracy import run_accuracy

        return run_accuracy(args)
    if args.ps:
        from benchmarks.ps import run_ps

        return run_ps(args)
    if args.elastic:
        from benchmarks.elastic import run_elastic

        return run_elastic(args)
    if args.failover and args.netem:
        from benchmarks.failover_netem import run_failover_netem

        return run_failover_netem(args)
    if args.failover:
        from benchmarks.failover import run_failover

        return run_failover(args)
    if args.netem and args.scale:
        from benchmarks.scale import run_scale

        return run_scale(args, env)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
