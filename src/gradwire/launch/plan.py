"""`gradwire plan`: the model's step time for a topology, for every way of placing the summation."""

from __future__ import annotations

import argparse
import os

from gradwire import split
from gradwire.tuning import ETHERNET_MTU, framing, parse_rate

MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--num-workers", type=int, default=0, help="(with --predict: the largest n, 1024)")
    parser.add_argument("-k", "--num-servers", type=int, default=0, help="dedicated servers")
    parser.add_argument("--worker-rate", default="100mbit", help="each worker host's link (tc spelling)")
    parser.add_argument("--server-rate", default="100mbit", help="each dedicated server's link")
    parser.add_argument("--size", type=float, default=16, help="MiB of gradient per worker per step")
    parser.add_argument(
        "--measured",
        default=None,
        help="JSON lines of `gradwire bench --netem --json` runs: their times are printed beside the model's",
    )
    parser.add_argument(
        "--predict",
        action="store_true",
        help="a training step's time and scaling efficiency for n = 1, 2, 4, ... workers and each link rate "
        "(--rates), from a profiled model's layers (gradwire/predict.py, docs/scaling.md)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="with --predict: a layer profile (gradwire/profiles/; benchmarks/replay.py writes them)",
    )
    parser.add_argument(
        "--compute-scale", type=float, default=1.0, help="with --predict: the profile's compute times divided by this"
    )
    parser.add_argument("--rates", default="1gbit,10gbit,100gbit,400gbit", help="with --predict: link rates")
    parser.add_argument(
        "--delay-ms", type=float, default=0.025, help="with --predict: one-way delay between two hosts (ms)"
    )
    parser.add_argument(
        "--mtu", type=int, default=ETHERNET_MTU, help="with --predict: the links' MTU in bytes (9000: jumbo)"
    )
    parser.add_argument(
        "--server-cpu-per-gb",
        type=float,
        default=None,
        help="with --predict: a server's CPU seconds per GB reduced (default: what `gradwire bench` measured for the "
        "data path GRADWIRE_DATAPATH gives here, native 0.5 or Python 0.7)",
    )


def main(args: argparse.Namespace) -> int:
    if args.predict:
        return predict_table(args)
    if args.num_workers < 1:
        raise SystemExit("gradwire plan: -n is required (the number of workers)")
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


def predict_table(args: argparse.Namespace) -> int:
    """`--predict`: per link rate and n (powers of two up to -n, default 1,024), the step of ring all-reduce (DDP), of
    gradwire with k = n dedicated servers and with colocated servers only, their scaling efficiencies, how many of
    the k servers the step's partitions keep busy, and the CPU cores each of those needs at that pace."""
    from gradwire import native, predict, profiles

    profile = profiles.load(args.profile or profiles.BENCH_MODEL)
    cpu_per_gb, path = args.server_cpu_per_gb, "as given"
    if cpu_per_gb is None:  # the measured figure of the data path a server started here would run
        native_here = os.environ.get("GRADWIRE_DATAPATH", "auto") != "python" and native.load().module is not None
        name = "native" if native_here else "python"
        cpu_per_gb, path = predict.SERVER_CPU_S_PER_GB[name], f"the {name} data path's, measured"
    scale = args.compute_scale
    layers = profiles.layers(profile, scale)
    total = sum(la.nbytes for la in layers)
    largest = args.num_workers or 1024
    ns = [1 << i for i in range(largest.bit_length()) if 1 << i <= largest]
    print(
        f"{profile['model']}: {total / MiB:.1f} MiB of gradient, compute {predict.compute_s(layers) * 1e3:.1f} ms per "
        f"step ({profile['device']}, divided by {scale:g}); one-way delay {args.delay_ms:g} ms, MTU {args.mtu}; "
        f"servers' CPU "
        f"{cpu_per_gb:g} s per GB ({path})"
    )
    print(
        f"{'rate':>8} {'n':>5} {'ring s':>8} {'eff':>5} {'k=n s':>8} {'eff':>5} {'x ring':>6} "
        f"{'coloc s':>8} {'eff':>5} {'servers':>7} {'cores each':>10}"
    )
    for rate in args.rates.split(","):
        links = predict.Links(parse_rate(rate) / 8, parse_rate(rate) / 8, args.delay_ms / 1e3, 1 / framing(args.mtu))
        one = {}
        for n in ns:
            ring = predict.ring_step(layers, n, links).step_s
            partition, window = predict.derived(n, n, links)
            dedicated = predict.gradwire_step(layers, n, n, links, False, partition, window).step_s
            colocated = predict.gradwire_step(layers, n, 0, links, True, *predict.derived(n, 0, links)).step_s
            one = one or {"ring": ring, "dedicated": dedicated, "colocated": colocated}
            used = predict.servers_used(n, layers, partition)
            cores = predict.server_cores(n, used, total, dedicated, cpu_per_gb)
            print(
                f"{rate:>8} {n:>5} {ring:8.4f} {one['ring'] / ring:5.2f} {dedicated:8.4f} "
                f"{one['dedicated'] / dedicated:5.2f} {ring / dedicated:6.2f} {colocated:8.4f} "
                f"{one['colocated'] / colocated:5.2f} {used:7d} {cores:10.2f}"
            )
    return 0
