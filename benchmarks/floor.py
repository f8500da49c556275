"""The floor under `python -m benchmarks --partitions`: a partition's cost to a Python data path with nothing else.

One worker and one summation server over TCP loopback, each a process of its own; the worker pushes SIZE bytes in
partitions of P bytes (a window of 4, or fewer where 4 would pass 256 KiB), the server adds each into a sum buffer and
answers it at once, the worker receives every sum into its output. No flow-control state, metrics, handles, locks
or keys beyond a number: only the frames, the system calls and the summing. Three shapes of worker:

- `one-thread`: the thread that receives an answer sends the next push itself;
- `two-threads`: as gradwire's links were built before the link loop (transport/loop.py), a sender thread waits on a
  condition that the receiving thread notifies as each answer frees a window place;
- `batched`: as `one-thread`, but each frame carries several partitions back to back (up to 256 KiB: `per_frame`),
  which the server still sums one by one (as a server's engine sums each key) and answers in one frame: what a
  partition costs when frames, system calls and passes are paid per batch (gradwire has one frame per partition);
- `native` and `native-batched`: the `one-thread` and `batched` shapes in C++ (gradwire-native, native/cpp/floor.cpp),
  worker and server each: gradwire's own 40-byte header validated on every frame, an epoll loop over a non-blocking
  socket, several frames a sendmsg, each answer received straight into the output and each push into a slot of the
  server's ring, summed there by the server's native kernel and answered from it. Neither holds the GIL while it runs.

Their CPU seconds per GB by partition size, beside gradwire's own in the same run, say how much of gradwire's
per-partition cost Python itself sets and how much the data path's shape adds. Run as
`python -m benchmarks.floor PARTITION SIZE REPEATS MODE`: one JSON line.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import struct
import sys
import threading
import time

import numpy as np

from gradwire import native

HEADER = struct.Struct("<QQ")  # the partition's number, its length
PYTHON_MODES = ("one-thread", "two-threads", "batched")
NATIVE_MODES = ("native", "native-batched")  # need gradwire-native (gradwire/native.py)
MODES = PYTHON_MODES + NATIVE_MODES
BATCHED_WINDOW = 2  # frames in flight in the `batched` shape


def window(partition: int) -> int:
    return max(1, min(4, (256 << 10) // partition))


def per_frame(partition: int, mode: str) -> int:
    """Partitions a frame carries: one, or in the `batched` shape as many as fit in 256 KiB (at most 8)."""
    return max(1, min(8, (256 << 10) // partition)) if mode in ("batched", "native-batched") else 1


def frames_in_flight(partition: int, parts: int) -> int:
    """The worker's window, in frames of `parts` partitions: `window(partition)` for one, else BATCHED_WINDOW."""
    return window(partition) if parts == 1 else BATCHED_WINDOW


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the peer closed the connection")
        got += n


def serve(sock: socket.socket, size: int, partition: int, parts: int = 1) -> None:
    """Answer one call: each frame pushed (of up to `parts` partitions) is summed partition by partition (onto zeros:
    one worker) and sent back at once."""
    zeros = np.zeros(partition // 4, np.float32)
    total = np.empty(parts * partition // 4, np.float32)
    pushed = np.empty_like(total)
    into, header = memoryview(pushed).cast("B"), memoryview(bytearray(HEADER.size))
    step = partition // 4
    done = 0
    while done < size:
        _recv_exactly(sock, header)
        index, n = HEADER.unpack(header)
        _recv_exactly(sock, into[:n])
        for at in range(0, n // 4, step):
            end = min(at + step, n // 4)
            np.add(zeros[: end - at], pushed[at:end], out=total[at:end])
        sock.sendmsg([HEADER.pack(index, n), memoryview(total).cast("B")[:n]])
        done += n


class Worker:
    """One push_pull of `data` into `out` through the server at the other end of `sock`."""

    def __init__(self, sock: socket.socket, data: np.ndarray, out: np.ndarray, partition: int, parts: int = 1) -> None:
        self.sock, self.partition = sock, partition
        self.frame = parts * partition  # bytes a frame carries at most
        self.window = frames_in_flight(partition, parts)
        self.send_view, self.out_view = memoryview(data).cast("B"), memoryview(out).cast("B")
        self.size = len(self.send_view)
        self.sent = self.index = self.in_flight = 0
        self.stopped = False
        self.cond = threading.Condition()

    def push(self) -> None:
        n = min(self.frame, self.size - self.sent)
        self.sock.sendmsg([HEADER.pack(self.index, n), self.send_view[self.sent : self.sent + n]])
        self.sent += n
        self.index += 1

    def answer(self, header: memoryview) -> int:
        """Receive the next sum into the output; its length."""
        _recv_exactly(self.sock, header)
        index, n = HEADER.unpack(header)
        at = index * self.frame
        _recv_exactly(self.sock, self.out_view[at : at + n])
        return n

    def one_thread(self) -> None:
        for _ in range(self.window):
            if self.sent < self.size:
                self.push()
        header, received = memoryview(bytearray(HEADER.size)), 0
        while received < self.size:
            received += self.answer(header)
            if self.sent < self.size:
                self.push()

    def two_threads(self) -> None:
        errors: list[OSError] = []
        sender = threading.Thread(target=self._send_loop, args=(errors,), daemon=True)
        sender.start()
        try:
            header, received = memoryview(bytearray(HEADER.size)), 0
            while received < self.size:
                received += self.answer(header)
                with self.cond:
                    self.in_flight -= 1
                    self.cond.notify()
        finally:  # a receive that failed stops the sender too
            with self.cond:
                self.stopped = True
                self.cond.notify()
            sender.join()
        if errors:
            raise errors[0]

    def _send_loop(self, errors: list[OSError]) -> None:
        try:
            while True:
                with self.cond:
                    while not self.stopped and self.sent < self.size and self.in_flight >= self.window:
                        self.cond.wait()
                    if self.stopped or self.sent >= self.size:
                        return
                    self.in_flight += 1
                self.push()
        except OSError as e:  # the server is gone: the receiver says so too
            errors.append(e)


def measure(partition: int, size: int, repeats: int, mode: str) -> dict:
    """CPU seconds per GB of the worker and of the server over `repeats` calls (this process forks the server)."""
    listener = socket.create_server(("127.0.0.1", 0))
    worker_sock = socket.create_connection(listener.getsockname())
    server_sock, _ = listener.accept()
    listener.close()
    for s in (worker_sock, server_sock):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    parts = per_frame(partition, mode)
    gn = native.require() if mode in NATIVE_MODES else None
    shape = gn.FloorShape(size, partition, parts, frames_in_flight(partition, parts)) if gn else None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the server: its CPU seconds down the pipe, or nothing if it failed
        code = 1
        try:
            worker_sock.close()
            cpu = time.process_time()
            if gn:
                gn.floor_serve([server_sock.fileno()], shape, 0, 1, repeats)
            else:
                for _ in range(repeats):
                    serve(server_sock, size, partition, parts)
            os.write(write_end, str(time.process_time() - cpu).encode())
            code = 0
        finally:
            os._exit(code)
    server_sock.close()
    os.close(write_end)  # so that a server that died reads as an empty pipe, not a wait
    data = np.random.default_rng(0).random(size // 4, dtype=np.float32)
    out = np.zeros_like(data)  # not empty_like: freed memory may hold a previous run's right answer
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        for r in range(repeats):
            if gn:
                gn.floor_push_pull([worker_sock.fileno()], shape, data, out, r)
                continue
            worker = Worker(worker_sock, data, out, partition, parts)
            worker.two_threads() if mode == "two-threads" else worker.one_thread()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:  # closing its end ends a server still waiting for pushes
        worker_sock.close()
        reported = os.read(read_end, 64)
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    if not reported:
        raise RuntimeError(f"the floor's server failed (wait status {status})")
    server_cpu = float(reported)
    if not np.array_equal(out, data):
        raise AssertionError("the sums came back wrong")
    gb = repeats * size / 1e9
    return {
        "mode": mode,
        "partition_bytes": partition,
        "worker_cpu_seconds_per_gb": cpu / gb,
        "server_cpu_seconds_per_gb": server_cpu / gb,
        "seconds_per_call": wall / repeats,
    }


def measure_job(workers: int, servers: int, partition: int, size: int, repeats: int, warmup: int, mode: str) -> dict:
    """The native floor as a job: `workers` worker and `servers` server processes over TCP loopback (a connection per
    pair), each one native loop; frame f of a call goes to server f % servers. The median seconds of a call (the
    slowest worker's, call by call) and CPU seconds per GB reduced (GB: every worker's SIZE, per timed call, as
    bench/runner.py's Timing counts it) of the workers and of the servers over the timed calls."""
    if mode not in NATIVE_MODES:
        raise ValueError(f"the floor runs as a job only in native code ({', '.join(NATIVE_MODES)}), not {mode!r}")
    gn = native.require()
    parts = per_frame(partition, mode)
    shape = gn.FloorShape(size, partition, parts, frames_in_flight(partition, parts))
    pairs = _connections(workers, servers)  # pairs[w][s]: (worker's socket, server's socket)
    children: list[tuple[str, int, int, int]] = []  # role, index, pid, the read end of its report
    try:
        for s in range(servers):
            own = [pairs[w][s][1] for w in range(workers)]
            children.append(
                (
                    "server",
                    s,
                    *_fork(own, pairs, lambda o=own, s=s: _serve_job(gn, o, shape, s, servers, repeats, warmup)),
                )
            )
        for w in range(workers):
            own = [pairs[w][s][0] for s in range(servers)]
            children.append(
                (
                    "worker",
                    w,
                    *_fork(own, pairs, lambda o=own, w=w: _work_job(gn, o, shape, w, workers, repeats, warmup)),
                )
            )
    finally:
        for row in pairs:
            for pair in row:
                for sock in pair:
                    sock.close()
    reports = {(role, i): _report(role, i, pid, fd) for role, i, pid, fd in children}
    calls = [max(reports["worker", w]["seconds"][r] for w in range(workers)) for r in range(repeats)]
    gb = workers * size * repeats / 1e9
    return {
        "mode": mode,
        "workers": workers,
        "servers": servers,
        "size_bytes": size,
        "partition_bytes": partition,
        "seconds_per_call": sorted(calls)[len(calls) // 2],
        "worker_cpu_seconds_per_gb": sum(reports["worker", w]["cpu"] for w in range(workers)) / gb,
        "server_cpu_seconds_per_gb": sum(reports["server", s]["cpu"] for s in range(servers)) / gb,
    }


def _connections(workers: int, servers: int) -> list[list[tuple[socket.socket, socket.socket]]]:
    listener = socket.create_server(("127.0.0.1", 0))
    pairs = []
    try:
        for _ in range(workers):
            row = []
            for _ in range(servers):
                a = socket.create_connection(listener.getsockname())
                b, _ = listener.accept()
                for sock in (a, b):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                row.append((a, b))
            pairs.append(row)
    finally:
        listener.close()
    return pairs


def _fork(own: list[socket.socket], pairs: list, body) -> tuple[int, int]:
    """Fork a child that keeps only its `own` sockets (so a peer that dies is an end of file, not a wait), runs
    `body` and writes its JSON report to a pipe; its pid and the pipe's read end."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            for row in pairs:
                for pair in row:
                    for sock in pair:
                        if sock not in own:
                            sock.close()
            os.write(write_end, json.dumps(body()).encode())
            code = 0
        except BaseException as e:  # the report says what failed; the exit code says that it did
            os.write(write_end, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        finally:
            os._exit(code)
    os.close(write_end)
    return pid, read_end


def _report(role: str, index: int, pid: int, fd: int) -> dict:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    report = json.loads(b"".join(chunks) or b"{}")
    if status or "error" in report or not report:
        why = report.get("error", "no report")
        raise RuntimeError(f"the floor's {role} {index} failed (wait status {status}): {why}")
    return report


def _serve_job(gn, socks: list[socket.socket], shape, index: int, servers: int, repeats: int, warmup: int) -> dict:
    fds = [s.fileno() for s in socks]
    if warmup:
        gn.floor_serve(fds, shape, index, servers, warmup)
    cpu = time.process_time()
    gn.floor_serve(fds, shape, index, servers, repeats)
    return {"cpu": time.process_time() - cpu}


def _work_job(gn, socks: list[socket.socket], shape, rank: int, workers: int, repeats: int, warmup: int) -> dict:
    # small whole numbers: every order of summing gives the same float32, so the check is exact
    base = (np.arange(shape.size // 4) % 1021).astype(np.float32)
    data, expected = base + rank, base * workers + workers * (workers - 1) // 2
    out = np.zeros_like(data)
    fds = [s.fileno() for s in socks]
    for r in range(warmup):
        gn.floor_push_pull(fds, shape, data, out, r)
    seconds, cpu = [], time.process_time()
    for r in range(warmup, warmup + repeats):
        start = time.perf_counter()
        gn.floor_push_pull(fds, shape, data, out, r)
        seconds.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu
    if not np.array_equal(out, expected):
        raise AssertionError(f"worker {rank}: the sums came back wrong")
    return {"seconds": seconds, "cpu": cpu}


def available_modes() -> tuple[str, ...]:
    """The shapes this installation can run: the native ones only where gradwire-native loads."""
    return MODES if native.load().module is not None else PYTHON_MODES


def run_job_bench(args, env: dict[str, str]) -> int:
    """`python -m benchmarks --floor`: the native floor as a job (n workers, k servers, TCP loopback) beside gloo's ring
    and gradwire's own job with its defaults (the native data path where gradwire-native is installed) over its default
    transport and over TCP, and each on the Python data path (GRADWIRE_DATAPATH=python), alternated round by round;
    ratios to gloo's time."""
    from gradwire.bench.runner import MiB, run_gloo, run_gradwire

    mod = native.load()
    if mod.module is None:
        print(f"the native floor cannot run: {mod.reason}")
        return 2
    n, k, size = args.num_workers, args.num_servers, int(float(args.sizes.split(",")[0]) * MiB)
    parts = [int(float(p) * 1024) for p in (args.partitions or "32,4096").split(",")]
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}

    def record(name: str, seconds: float, cpu_per_gb: float) -> None:
        times.setdefault(name, []).append(seconds)
        cpu.setdefault(name, []).append(cpu_per_gb)

    for _ in range(args.rounds):
        for p in parts:
            row = measure_job(n, k, p, size, args.repeats, args.warmup, "native")
            both = row["worker_cpu_seconds_per_gb"] + row["server_cpu_seconds_per_gb"]
            record(f"native floor, {p // 1024} KiB", row["seconds_per_call"], both)
        tcp = env | {"GRADWIRE_TRANSPORT": "tcp"}
        python = {"GRADWIRE_DATAPATH": "python"}  # the Python data path, workers' and servers'
        for name, job in (
            ("gradwire (defaults)", env),
            ("gradwire (defaults), Python data path", env | python),
            ("gradwire over TCP", tcp),
            ("gradwire over TCP, Python data path", tcp | python),
        ):
            for t in run_gradwire(n, k, [size], args.repeats, args.warmup, job):
                record(name, t.median, t.cpu_per_gb())
        for t in run_gloo(n, [size], args.repeats, args.warmup):
            record("gloo ring", t.median, t.cpu_per_gb())
    gloo = statistics.median(times["gloo ring"])
    rows = [
        {
            "job": name,
            "seconds": statistics.median(ts),
            "x_gloo_speed": gloo / statistics.median(ts),
            "cpu_seconds_per_gb": statistics.median(cpu[name]),
            "rounds": ts,
        }
        for name, ts in times.items()
    ]
    if args.json:
        for row in rows:
            print(json.dumps(row | {"workers": n, "servers": k, "size_bytes": size}))
        return 0
    print(f"push_pull of {size / MiB:g} MiB, n={n} workers, k={k} servers, one host; medians of {args.rounds} rounds")
    print()
    print("| job | s per call | x gloo's speed | CPU s per GB (all processes) | each round's s |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        each = ", ".join(f"{t:.4f}" for t in r["rounds"])
        cells = f"{r['seconds']:.4f} | {r['x_gloo_speed']:.2f}x | {r['cpu_seconds_per_gb']:.2f}"
        print(f"| {r['job']} | {cells} | {each} |")
    return 0


if __name__ == "__main__":
    part, nbytes, reps, how = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    print(json.dumps(measure(part, nbytes, reps, how)), flush=True)
