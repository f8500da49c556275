"""`gradwire plan`: the model's step time for a topology, for every way of placing the summation."""

from __future__ import annotations

import argparse

from gradwire import split
from gradwire.netem.topology import parse_rate

MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--num-workers", type=int, required=True)
    parser.add_argument("-k", "--num-servers", type=int, default=0, help="dedicated servers")
    parser.add_argument("--worker-rate", default="100mbit", help="each worker host's link (tc spelling)")
    parser.add_argument("--server-rate", default="100mbit", help="each dedicated server's link")
    parser.add_argument("--size", type=float, default=16, help="MiB of gradient per worker per step")


def main(args: argparse.Namespace) -> int:
    s = args.size * MiB
    workers = [parse_rate(args.worker_rate) / 8] * args.num_workers
    servers = [parse_rate(args.server_rate) / 8] * args.num_servers
    best = split.optimal(s, workers, servers)
    ring = split.ring_seconds(s, workers)
    rows = [("ring all-reduce", ring, "-")]
    if servers:
        rows.append(("dedicated servers only", split.service_seconds(s, workers, servers), "100% dedicated"))
    rows.append(("colocated servers only", split.optimal(s, workers, []).seconds, "0% dedicated"))
    rows.append(("gradwire's mix (optimal)", best.seconds, f"{best.dedicated_fraction:.1%} dedicated"))
    print(
        f"n={args.num_workers} workers at {args.worker_rate}, k={args.num_servers} dedicated servers at "
        f"{args.server_rate}, {args.size:g} MiB per worker per step (model: docs/placement.md)"
    )
    print(f"{'placement':<26} {'seconds':>9} {'x ring':>7}  split")
    for name, seconds, share in rows:
        print(f"{name:<26} {seconds:9.3f} {seconds / ring if ring else 0:7.2f}  {share}")
    return 0
