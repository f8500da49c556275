"""`gradwire netem run|check`: a job, or a link test, on an emulated cluster."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading

from gradwire.netem.cluster import EmulatedCluster, NetemUnavailable, check_available
from gradwire.netem.jobs import start_gradwire
from gradwire.netem.topology import ETHERNET_MTU, Topology, framing, parse_rate

RECEIVER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; first = None
while (d := c.recv(1 << 20)):
    first = first or time.monotonic()
    n += len(d)
print(n * 8 / (time.monotonic() - first), flush=True)
"""
SENDER = (
    "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2]))).sendall(b'x' * int(sys.argv[3]))"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="netem_command", required=True)
    run = sub.add_parser("run", help="run a gradwire job with every role on its own emulated host")
    run.add_argument("-n", "--num-workers", type=int, required=True)
    run.add_argument("-s", "--num-servers", type=int, default=1)
    run.add_argument("--worker-rate", default="100mbit", help="each worker host's upload and download rate")
    run.add_argument("--server-rate", default="100mbit", help="each server host's upload and download rate")
    run.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added on every link")
    run.add_argument("--colocate", action="store_true", help="a server on each worker host too (-s may then be 0)")
    run.add_argument(
        "--per-host", type=int, default=1, help="workers per worker host, sharing its link (torchrun's nproc-per-node)"
    )
    run.add_argument("--mtu", type=int, default=ETHERNET_MTU, help="every link's MTU in bytes (9000: jumbo frames)")
    run.add_argument("--timeout", type=float, default=3600)
    run.add_argument("command", nargs=argparse.REMAINDER, help="the worker command, after --")
    check = sub.add_parser("check", help="measure one emulated link against its configured rate")
    check.add_argument("--rate", default="20mbit")
    check.add_argument("--megabytes", type=float, default=6)
    check.add_argument("--mtu", type=int, default=ETHERNET_MTU, help="the link's MTU in bytes")


def main(args: argparse.Namespace) -> int:
    try:
        check_available()
    except NetemUnavailable as e:
        print(f"gradwire netem: {e}", file=sys.stderr)
        return 2
    if args.netem_command == "check":
        return _check(args.rate, int(args.megabytes * (1 << 20)), args.mtu)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("gradwire netem run: give the worker command after --", file=sys.stderr)
        return 2
    topo = Topology(
        args.num_workers,
        args.num_servers,
        args.worker_rate,
        args.server_rate,
        args.delay_ms,
        colocate=args.colocate,
        per_host=args.per_host,
        mtu=args.mtu,
    )
    with EmulatedCluster(topo) as cluster:
        print(
            f"[gradwire netem] run {cluster.run_id}: {topo.workers} workers at {topo.worker_rate}, "
            f"{topo.servers} servers at {topo.server_rate}",
            flush=True,
        )
        with start_gradwire(cluster, command) as job:
            pumps = [threading.Thread(target=_pump, args=(p, f"[worker {r}] ")) for r, p in enumerate(job.workers)]
            for t in pumps:
                t.start()
            codes = [p.wait(args.timeout) for p in job.workers]
            for t in pumps:
                t.join()
    failed = [(r, c) for r, c in enumerate(codes) if c != 0]
    if failed:
        print(f"[gradwire netem] worker {failed[0][0]} exited with {failed[0][1]}", flush=True)
        return failed[0][1] if failed[0][1] > 0 else 1
    return 0


def _pump(proc: subprocess.Popen, prefix: str) -> None:
    assert proc.stdout is not None
    with proc.stdout:
        for line in proc.stdout:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()
    proc.stdout = None  # consumed here; Job.wait must not read it again


def measure_link(rate: str, nbytes: int, mtu: int = ETHERNET_MTU) -> float:
    """Bits per second of payload that one TCP stream gets across a two-host emulated link of `rate` and `mtu`."""
    topo = Topology(workers=1, servers=1, worker_rate=rate, server_rate=rate, mtu=mtu)
    with EmulatedCluster(topo) as c:
        worker, server = topo.of("worker")[0], topo.of("server")[0]
        rx = c.spawn(server, [sys.executable, "-c", RECEIVER, server.address], stdout=subprocess.PIPE, text=True)
        assert rx.stdout is not None
        port = rx.stdout.readline().strip()
        tx = c.spawn(worker, [sys.executable, "-c", SENDER, server.address, port, str(nbytes)])
        tx.wait(300)
        return float(rx.communicate(timeout=300)[0].strip())


def _check(rate: str, nbytes: int, mtu: int) -> int:
    measured = measure_link(rate, nbytes, mtu)
    configured = parse_rate(rate)
    print(
        f"configured {configured / 1e6:g} Mbit/s at MTU {mtu}, measured {measured / 1e6:.1f} Mbit/s "
        f"({measured / configured:.0%}; the headers' share {1 - 1 / framing(mtu):.1%}) for one TCP stream"
    )
    return 0 if 0.8 <= measured / configured <= 1.2 else 1
