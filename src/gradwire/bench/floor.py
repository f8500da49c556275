"""The floor under `gradwire bench --partitions`: what a partition costs a Python data path with nothing else in it.

One worker and one summation server over TCP loopback, each a process of its own; the worker pushes SIZE bytes in
partitions of P bytes (a window of 4, or fewer where 4 would pass 256 KiB), the server adds each into a sum buffer and
answers it at once, the worker receives every sum into its output. No flow-control state, metrics, handles, locks
or keys beyond a number: only the frames, the system calls and the summing. Three shapes of worker:

- `one-thread`: the thread that receives an answer sends the next push itself;
- `two-threads`: as gradwire's links were built before the link loop (transport/loop.py), a sender thread waits on a
  condition that the receiving thread notifies as each answer frees a window place;
- `batched`: as `one-thread`, but each frame carries several partitions back to back (up to 256 KiB: `per_frame`),
  which the server still sums one by one (as a server's engine sums each key) and answers in one frame: what a
  partition costs when frames, system calls and passes are paid per batch (gradwire has one frame per partition).

Their CPU seconds per GB by partition size, beside gradwire's own in the same run, say how much of gradwire's
per-partition cost Python itself sets and how much the data path's shape adds. Run as
`python -m gradwire.bench.floor PARTITION SIZE REPEATS MODE`: one JSON line.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time

import numpy as np

HEADER = struct.Struct("<QQ")  # the partition's number, its length
MODES = ("one-thread", "two-threads", "batched")
BATCHED_WINDOW = 2  # frames in flight in the `batched` shape


def window(partition: int) -> int:
    return max(1, min(4, (256 << 10) // partition))


def per_frame(partition: int, mode: str) -> int:
    """Partitions a frame carries: one, or in the `batched` shape as many as fit in 256 KiB (at most 8)."""
    return max(1, min(8, (256 << 10) // partition)) if mode == "batched" else 1


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
        self.window = window(partition) if parts == 1 else BATCHED_WINDOW
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
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the server: its CPU seconds down the pipe, or nothing if it failed
        code = 1
        try:
            worker_sock.close()
            cpu = time.process_time()
            for _ in range(repeats):
                serve(server_sock, size, partition, parts)
            os.write(write_end, str(time.process_time() - cpu).encode())
            code = 0
        finally:
            os._exit(code)
    server_sock.close()
    os.close(write_end)  # so that a server that died reads as an empty pipe, not a wait
    data = np.random.default_rng(0).random(size // 4, dtype=np.float32)
    out = np.empty_like(data)
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        for _ in range(repeats):
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


if __name__ == "__main__":
    part, nbytes, reps, how = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    print(json.dumps(measure(part, nbytes, reps, how)), flush=True)
