"""A worker's push_pull through the native worker's rule (gradwire-native's `worker_push_pull` and `WorkerLoop`) over
links a Python worker lends for the call (`ServerLink.hand_over`), in a job of real servers: the rule and its loop
measured and checked beside the Python worker in the same job, where the worker's own native path does not apply
(a job with server failover on: worker/native_path.py). Plain sums over sockets only (no shared memory, failover
copies, compression or pacing: what the worker's own native path adds).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator

import numpy as np

from gradwire import native
from gradwire.errors import GradwireError
from gradwire.worker import Worker
from gradwire.worker.native_path import refusal


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


def plan_of(worker: Worker, name: str) -> tuple[int, int, list[tuple[int, int, int, int, int]]]:
    """The next round of the declared tensor `name` (numbered as worker/launching.py numbers it) and its plan: (dtype
    code, round, [(key, server, send offset, bytes, out offset, bytes, partition index)])."""
    with worker.state.lock:
        tensor = worker.table.tensors[name]
        tensor.round += 1
        rnd = tensor.round
    size = tensor.dtype.itemsize
    plan = [
        (key, server, part.start * size, part.count * size, part.start * size, part.count * size, part.index)
        for part, key, server in zip(tensor.parts, tensor.keys, tensor.servers, strict=True)
    ]
    return tensor.dtype.code, rnd, plan


def push_pull(worker: Worker, fds: list[int], name: str, send: np.ndarray, out: np.ndarray, priority: int = 0) -> tuple:
    """The next round of the declared tensor `name` (plain sum), `send` summed over the job into `out`, through the
    native worker over the lent links `fds`. Returns (pushes, batches, ACKS frames)."""
    code, rnd, plan = plan_of(worker, name)
    wire_send, wire_out = send.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8)
    timeout = worker.state.config.timeout
    try:
        return native.require().worker_push_pull(
            fds, name, rnd, priority, code, wire_send, wire_out, plan, **settings_of(worker), timeout=timeout
        )
    except RuntimeError as e:
        raise refusal(name, str(e)) or e from None


def settings_of(worker: Worker) -> dict:
    """What the native worker takes of `worker`: its place in the job and its links' flow settings (the first link's:
    every link of a worker has the same), credit and largest frame."""
    link = worker.state.links[0]
    return {
        "rank": worker.rank,
        "epoch": worker.state.epoch,
        "window": link.window,
        "cap": link.unanswered_cap,
        "credit": link.credit.limit,
        "max_payload": link.conn.max_payload,
    }


class LoopCalls:
    """Calls through the native worker's own loop (gradwire-native's `WorkerLoop`: a thread that owns the lent links
    and moves every call's partitions while more are submitted), as a training step's tensors overlap."""

    def __init__(self, worker: Worker, fds: list[int]) -> None:
        self.worker = worker
        self.loop = native.require().WorkerLoop(fds, **settings_of(worker))
        self._calls = itertools.count(1)
        self._open: dict[int, tuple[str, np.ndarray, np.ndarray]] = {}  # the buffers stay alive until completed
        self._done: dict[int, str] = {}

    def submit(self, name: str, send: np.ndarray, out: np.ndarray, priority: int = 0) -> int:
        """Start the next round of the declared tensor `name`; returns the call's number (see `wait`)."""
        code, rnd, plan = plan_of(self.worker, name)
        call = next(self._calls)
        wire_send, wire_out = send.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8)
        self._open[call] = (name, wire_send, wire_out)
        self.loop.submit(call, name, rnd, priority, code, wire_send, wire_out, plan)
        return call

    def wait(self, calls: list[int], timeout: float) -> None:
        """Until every one of `calls` is done; raises the first one's error (a refusal as TensorError)."""
        deadline = time.monotonic() + timeout
        while not all(c in self._done for c in calls):
            left = deadline - time.monotonic()
            if left <= 0:
                raise GradwireError(f"worker {self.worker.rank}: native calls {calls} not done in {timeout:g} s")
            for call, error in self.loop.completions(min(left, 1.0)):
                self._done[call] = error
        for call in calls:
            error = self._done.pop(call)
            name, _, _ = self._open.pop(call)
            if error:
                raise refusal(name, error) or GradwireError(f"worker {self.worker.rank}: {name!r}: {error}")

    def close(self) -> None:
        """Stop the loop (its links' sockets stay open, for `take_back`)."""
        self.loop.stop()


def measure(
    workers: int, servers: int, partition_kib: int, size_mib: int, tensors: int, steps: int, runs: int
) -> list[dict]:
    """One in-process job (workers and servers as threads of this process, TCP loopback): `steps` steps of `tensors`
    tensors (`size_mib` MiB in all) per worker, every tensor of a step started before any is waited for (as a training
    step's gradients are), through the Python worker and through the native worker's loop (`LoopCalls`), alternated
    `runs` times. Per way: the seconds per step and the process's CPU seconds per GB pushed by all workers (servers
    included: the same Python servers for both ways, so the difference is the workers')."""
    from gradwire.testing import LocalCluster

    n = size_mib * (1 << 20) // 4 // tensors
    names = [f"bench.native.{t}" for t in range(tensors)]
    rows = []
    with LocalCluster(
        num_workers=workers, num_servers=servers, partition_bytes=partition_kib << 10, transport="tcp"
    ) as cluster:

        def gradients(w: Worker) -> list[np.ndarray]:
            rngs = [np.random.default_rng(w.rank * 100 + t) for t in range(tensors)]
            return [rng.standard_normal(n).astype(np.float32) for rng in rngs]

        def python_way(w: Worker) -> None:
            data = gradients(w)
            for _ in range(steps):
                handles = [w.push_pull_async(d, names[t], priority=-t) for t, d in enumerate(data)]
                for h in handles:
                    w.synchronize(h)

        def native_way(w: Worker) -> None:
            data = gradients(w)
            outs = [np.empty_like(d) for d in data]
            with lent_links(w) as fds:
                calls = LoopCalls(w, fds)
                try:
                    for _ in range(steps):
                        ids = [
                            calls.submit(name, d, out, priority=-t)
                            for t, (d, out, name) in enumerate(zip(data, outs, names, strict=True))
                        ]
                        calls.wait(ids, w.state.config.timeout)
                finally:
                    calls.close()

        cluster.run(python_way)  # declared, warmed
        for _ in range(runs):
            for way, fn in (("python", python_way), ("native loop", native_way)):
                wall, cpu = time.perf_counter(), time.process_time()
                cluster.run(fn)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                gb = workers * steps * tensors * n * 4 / 1e9
                rows.append({"way": way, "s_per_step": wall / steps, "cpu_s_per_gb": cpu / gb})
    return rows


def main() -> None:
    import argparse
    import statistics

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--num-workers", type=int, default=4)
    parser.add_argument("-s", "--num-servers", type=int, default=4)
    parser.add_argument("--partition-kib", type=int, default=32)
    parser.add_argument("--size-mib", type=int, default=16)
    parser.add_argument("--tensors", type=int, default=1, help="tensors a step (SIZE_MIB in all)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rows = measure(
        args.num_workers, args.num_servers, args.partition_kib, args.size_mib, args.tensors, args.steps, args.runs
    )
    ways = ("python", "native loop")
    med = {
        way: {k: statistics.median(r[k] for r in rows if r["way"] == way) for k in ("s_per_step", "cpu_s_per_gb")}
        for way in ways
    }
    print(
        f"steps of {args.tensors} tensors, {args.size_mib} MiB in all, n={args.num_workers} workers, "
        f"k={args.num_servers} servers (Python), {args.partition_kib} KiB partitions, TCP loopback, one process; "
        f"medians of {args.runs} alternations"
    )
    print("| worker | s per step | x python | job CPU s/GB | x python |\n|---|---:|---:|---:|---:|")
    for way in ways:
        m, base = med[way], med["python"]
        print(
            f"| {way} | {m['s_per_step']:.4f} | {m['s_per_step'] / base['s_per_step']:.2f}x | "
            f"{m['cpu_s_per_gb']:.2f} | {m['cpu_s_per_gb'] / base['cpu_s_per_gb']:.2f}x |"
        )


if __name__ == "__main__":
    main()
