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
    parser.add_argument(
        "--measured",
        default=None,
        help="JSON lines of `gradwire bench --netem --json` runs: their times are printed beside the model's",
    )


def main(args: argparse.Namespace) -> int:
    s = args.size * MiB
    workers = [parse_rate(args.worker_rate) / 8] * args.num_workers
    servers = [parse_rate(args.server_rate) / 8] * args.num_servers
    best = split.optimal(s, workers, servers)
    ring = split.ring_seconds(s, workers)
    measured = _measured(args, s) if args.measured else {}
    rows = [("ring all-reduce", ring, "-", measured.get("gloo"))]
    if servers:
        service = split.service_seconds(s, workers, servers)
        rows.append(("dedicated servers only", service, "100% dedicated", measured.get("service")))
    rows.append(("colocated servers only", split.optimal(s, workers, []).seconds, "0% dedicated", measured.get("k0")))
    mix = f"{best.dedicated_fraction:.1%} dedicated"
    rows.append(("gradwire's mix (optimal)", best.seconds, mix, measured.get("mix")))
    print(
        f"n={args.num_workers} workers at {args.worker_rate}, k={args.num_servers} dedicated servers at "
        f"{args.server_rate}, {args.size:g} MiB per worker per step (model: docs/placement.md)"
    )
    print(f"{'placement':<26} {'seconds':>9} {'x ring':>7}  {'split':<16}" + (" measured  x model" if measured else ""))
    for name, seconds, share, got in rows:
        line = f"{name:<26} {seconds:9.3f} {seconds / ring if ring else 0:7.2f}  {share:<16}"
        if got is not None:
            line += f" {got:8.3f}  {got / seconds:7.2f}"
        print(line)
    return 0


def _measured(args: argparse.Namespace, nbytes: float) -> dict[str, float]:
    """The bench runs that match this topology and size: gloo, the pure service, colocated only, the mix."""
    import json

    wr, sr = parse_rate(args.worker_rate), parse_rate(args.server_rate)
    out: dict[str, float] = {}
    with open(args.measured) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r["workers"] != args.num_workers or r["bytes"] != int(nbytes) or r["worker_rate_bps"] != wr:
                continue
            if r["system"] == "gloo":
                out["gloo"] = r["seconds_median"]
            elif r["server_rate_bps"] == sr or (r["servers"] == 0 and r.get("colocated")):
                if not r.get("colocated") and r["servers"] == args.num_servers:
                    out["service"] = r["seconds_median"]
                elif r.get("colocated") and r["servers"] == 0:
                    out["k0"] = r["seconds_median"]
                elif r.get("colocated") and r["servers"] == args.num_servers:
                    out["mix"] = r["seconds_median"]
    return out
