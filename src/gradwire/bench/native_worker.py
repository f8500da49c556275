"""A worker's push_pull through the native worker (gradwire-native's `worker_push_pull`, native/cpp/worker.hpp) in a job
of real servers: a Python worker declares the tensor and lends its links' sockets (`ServerLink.hand_over`); the native
call pushes every partition by the worker's rule and receives every sum into the output; the links then go back to
the worker's loop. The native path's next step, before it is the worker's own: what its per-partition rule costs
against the Python worker's, in the same job, and that the real servers' answers are the same bytes.

It moves plain sums of links over sockets only (no shared memory, failover copies, compression, or pacing yet).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator

import numpy as np

from gradwire import native
from gradwire.errors import TensorError
from gradwire.worker import Worker


@contextlib.contextmanager
def lent_links(worker: Worker, timeout: float = 10.0) -> Iterator[list[int]]:
    """Every link of `worker` lent for the block: their sockets' descriptors, by server index."""
    lent: list = []
    broken: BaseException | None = None
    try:
        for link in worker.state.links:
            lent.append((link, link.hand_over(timeout)))  # type: ignore[union-attr]
        yield [fd for _, fd in lent]
    except BaseException as e:
        broken = e  # a call that failed may leave a stream mid-frame: its links close
        raise
    finally:
        for link, _ in lent:
            link.take_back(broken)


def push_pull(worker: Worker, fds: list[int], name: str, send: np.ndarray, out: np.ndarray, priority: int = 0) -> tuple:
    """The next round of the declared tensor `name` (plain sum), `send` summed over the job into `out`, through the
    native worker over the lent links `fds`. Returns (pushes, batches, ACKS frames)."""
    module = native.require()
    with worker.state.lock:
        tensor = worker.table.tensors[name]
        tensor.round += 1  # the next round, numbered as worker/launching.py numbers it
        rnd = tensor.round
    size = tensor.dtype.itemsize
    plan = [
        (key, server, part.start * size, part.count * size, part.index)
        for part, key, server in zip(tensor.parts, tensor.keys, tensor.servers, strict=True)
    ]
    link = worker.state.links[0]
    try:
        return _call(module, worker, link, fds, name, rnd, priority, tensor.dtype.code, send, out, plan)
    except RuntimeError as e:  # a server refused the tensor: as the Python path says it (worker/answers.py)
        refused = re.fullmatch(r"worker (\d+): server (\d+) refused (.*) \(key (\d+)\): (\{.*\})", str(e), re.S)
        if refused is None:
            raise
        rank, server, _, key, body = refused.groups()
        message = json.loads(body).get("message")
        raise TensorError(
            f"server {server} refused {name!r} (key {int(key):016x}): {message}",
            tensor=name,
            server=int(server),
            rank=int(rank),
        ) from None


def _call(module, worker, link, fds, name, rnd, priority, code, send, out, plan) -> tuple:  # noqa: ANN001
    return module.worker_push_pull(
        fds,
        name,
        rnd,
        priority,
        code,
        send.reshape(-1).view(np.uint8),
        out.reshape(-1).view(np.uint8),
        plan,
        rank=worker.rank,
        epoch=worker.state.epoch,
        window=link.window,
        cap=link.unanswered_cap,
        credit=link.credit.limit,
        max_payload=link.conn.max_payload,
        timeout=worker.state.config.timeout,
    )


def measure(workers: int, servers: int, partition_kib: int, size_mib: int, calls: int, runs: int) -> list[dict]:
    """One in-process job (workers and servers as threads of this process, TCP loopback): `calls` push_pulls of
    `size_mib` MiB per worker through the Python worker and through the native worker, alternated `runs` times. Per
    way: the seconds per call and the process's CPU seconds per GB pushed by all workers (servers included: they are
    the same Python servers for both ways, so the difference is the workers')."""
    import time

    from gradwire.testing import LocalCluster

    n = size_mib * (1 << 20) // 4
    rows = []
    with LocalCluster(
        num_workers=workers, num_servers=servers, partition_bytes=partition_kib << 10, transport="tcp"
    ) as cluster:

        def python_way(w: Worker) -> None:
            data = np.random.default_rng(w.rank).standard_normal(n).astype(np.float32)
            for _ in range(calls):
                w.push_pull(data, "bench.native")

        def native_way(w: Worker) -> None:
            data = np.random.default_rng(w.rank).standard_normal(n).astype(np.float32)
            out = np.empty_like(data)
            with lent_links(w) as fds:
                for _ in range(calls):
                    push_pull(w, fds, "bench.native", data, out)

        cluster.run(python_way)  # declared, warmed
        for _ in range(runs):
            for way, fn in (("python", python_way), ("native", native_way)):
                wall, cpu = time.perf_counter(), time.process_time()
                cluster.run(fn)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                gb = workers * calls * n * 4 / 1e9
                rows.append({"way": way, "s_per_call": wall / calls, "cpu_s_per_gb": cpu / gb})
    return rows


def main() -> None:
    import argparse
    import statistics

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--num-workers", type=int, default=4)
    parser.add_argument("-s", "--num-servers", type=int, default=4)
    parser.add_argument("--partition-kib", type=int, default=32)
    parser.add_argument("--size-mib", type=int, default=16)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rows = measure(args.num_workers, args.num_servers, args.partition_kib, args.size_mib, args.calls, args.runs)
    med = {
        way: {k: statistics.median(r[k] for r in rows if r["way"] == way) for k in ("s_per_call", "cpu_s_per_gb")}
        for way in ("python", "native")
    }
    print(
        f"push_pull of {args.size_mib} MiB, n={args.num_workers} workers, k={args.num_servers} servers (Python), "
        f"{args.partition_kib} KiB partitions, TCP loopback, one process; medians of {args.runs} alternations"
    )
    print("| worker | s per call | x python | job CPU s/GB | x python |\n|---|---:|---:|---:|---:|")
    for way in ("python", "native"):
        m = med[way]
        print(
            f"| {way} | {m['s_per_call']:.4f} | {m['s_per_call'] / med['python']['s_per_call']:.2f}x | "
            f"{m['cpu_s_per_gb']:.2f} | {m['cpu_s_per_gb'] / med['python']['cpu_s_per_gb']:.2f}x |"
        )


if __name__ == "__main__":
    main()
