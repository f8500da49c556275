"""The native worker (native/cpp/worker.hpp, `worker_push_pull`) against real servers: a Python worker lends its links
(`ServerLink.hand_over`) and the native call pushes by the worker's rule; the sums are the Python path's bytes for every
dtype, size and flow setting, a server's refusal is an error naming the worker, the server's link and the tensor, and
the links go back to the Python worker (or close, after a failure)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import native_worker
from gradwire.errors import GradwireError, TensorError
from gradwire.protocol import dtypes
from gradwire.testing import LocalCluster

DTYPES = [np.float32, np.float16, np.float64, np.int32, np.int64, np.uint8]


def _data(rank: int, n: int, dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed * 100 + rank)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(0, 50, n).astype(dtype)


@pytest.fixture(scope="module")
def cluster(gn):
    # window 2 and a cap of 1 unanswered partition: the flow rule's cap and job-wide order at work. The workers' own
    # data path is the Python one: their links are lent to the loops these tests make
    options = dict(partition_bytes=4096, transport="tcp", window=2, unanswered=1, datapath="python")
    with LocalCluster(num_workers=3, num_servers=2, **options) as c:
        yield c


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 1023, 50_001])
def test_the_native_workers_sums_are_the_python_paths_bytes(cluster, dtype, n):
    name = f"native-{np.dtype(dtype).name}-{n}"

    def both(w):
        data = _data(w.rank, n, dtype, 1)
        by_python = w.push_pull(data, name)
        by_native = np.full_like(data, 7)
        with native_worker.lent_links(w) as fds:
            pushes, batches, acks = native_worker.push_pull(w, fds, name, data, by_native)
        again = w.push_pull(data, name)  # the links went back: the Python path goes on, a round later
        return by_python, by_native, again, pushes

    results = cluster.run(both)
    parts = len(cluster.workers[0].table.tensors[name].parts)
    for by_python, by_native, again, pushes in results:
        assert by_native.tobytes() == by_python.tobytes() == again.tobytes()
        assert pushes == parts


def test_a_servers_refusal_names_the_worker_server_and_tensor_and_the_links_close(cluster, gn):
    """A push the server refuses (here: a dtype the tensor was not declared with) fails the call with the server's
    message; the failed call's links close (their streams may be mid-frame) and the worker says so on its next call."""
    name = "native-refused"

    def refused(w):
        data = _data(w.rank, 2000, np.float32, 2)
        w.push_pull(data, name)
        tensor = w.table.tensors[name]
        tensor.dtype = dtypes.from_numpy(np.int32)  # what the pushes will claim; the servers know float32
        with pytest.raises(TensorError) as refusal:
            with native_worker.lent_links(w) as fds:
                native_worker.push_pull(w, fds, name, data, np.empty_like(data))
        with pytest.raises(GradwireError):
            w.push_pull(data, "native-after")
        assert refusal.value.context == {"tensor": name, "server": 0, "rank": 0}
        return str(refusal.value)

    with LocalCluster(num_workers=1, num_servers=1, transport="tcp", datapath="python") as c:
        (message,) = c.run(refused)
    assert message.startswith(f"server 0 refused {name!r} (key ") and "int32 pushed, but the key is" in message


def test_only_a_quiet_link_is_lent(gn):
    """A link with a partition unanswered is not lent (its stream is the Python path's until the answer is in); once
    quiet it is, shared memory and all, and comes back."""
    # one host: the links move bytes through shared memory; the Python path's links, lent here
    with LocalCluster(num_workers=2, num_servers=1, datapath="python") as c:
        a, b = c.workers
        c.run(lambda w: w.declare("busy", (10,), np.float32))
        handle = a.push_pull_async(np.ones(10, np.float32), "busy")  # b has not pushed: a's push waits for it
        (link,) = a.state.links
        assert link.arena is not None
        with pytest.raises(GradwireError, match="cannot be lent"):
            link.hand_over(1.0)
        b.push_pull(np.ones(10, np.float32), "busy")
        a.synchronize(handle)
        link.hand_over(1.0)
        link.take_back()
        c.run(lambda w: w.push_pull(np.ones(10, np.float32), "still-works"))


def test_calls_overlap_on_the_native_workers_own_loop(cluster):
    """The native worker's loop (`WorkerLoop`): each worker submits five tensors at once, of several dtypes and sizes,
    and one its servers refuse; the others' sums are the Python path's bytes, the refused one fails alone, with the
    Python path's TensorError."""
    shapes = [(np.float32, 30_000), (np.float16, 5000), (np.int64, 1), (np.float32, 4096), (np.uint8, 70_000)]

    def overlapping(w):
        data = [_data(w.rank, n, dtype, 3 + i) for i, (dtype, n) in enumerate(shapes)]
        names = [f"loop-{i}" for i in range(len(shapes))]
        expected = [w.push_pull(d, name) for d, name in zip(data, names, strict=True)]
        w.push_pull(np.ones(100, np.float32), "loop-refused")
        outs = [np.zeros_like(d) for d in data]
        with native_worker.lent_links(w) as fds:
            calls = native_worker.LoopCalls(w, fds)
            try:
                ids = [
                    calls.submit(name, d, out, priority=i)
                    for i, (name, d, out) in enumerate(zip(names, data, outs, strict=True))
                ]
                w.table.tensors["loop-refused"].dtype = dtypes.from_numpy(np.int32)  # the servers know float32
                bad = calls.submit("loop-refused", np.ones(100, np.int32), np.empty(100, np.int32))
                calls.wait(ids, 30.0)
                with pytest.raises(TensorError, match="int32 pushed"):
                    calls.wait([bad], 30.0)
            finally:
                calls.close()
        return [o.tobytes() == e.tobytes() for o, e in zip(outs, expected, strict=True)]

    assert cluster.run(overlapping) == [[True] * len(shapes)] * 3


def test_a_stopped_loop_fails_what_is_submitted_after(cluster):
    def stopped(w):
        w.push_pull(np.ones(8, np.float32), "loop-stopped")
        with native_worker.lent_links(w) as fds:
            calls = native_worker.LoopCalls(w, fds)
            calls.close()
            call = calls.submit("loop-stopped", np.ones(8, np.float32), np.empty(8, np.float32))
            with pytest.raises(GradwireError, match="stopped"):
                calls.wait([call], 5.0)
        return w.push_pull(np.ones(8, np.float32), "loop-stopped-after")[0]  # the links went back whole

    assert cluster.run(stopped) == [3.0] * 3


def test_a_stopped_loop_gives_the_sockets_back_as_they_were(gn):
    """The loop makes its sockets non-blocking while it runs and, once stopped, restores their flags at once (not when
    the loop object is collected: by then the caller has closed the socket and another may have its number; that set a
    later cluster's sockets blocking and hung its link loop)."""
    import fcntl
    import os
    import socket

    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(True)
        loop = gn.WorkerLoop([ours.fileno()], rank=0, epoch=0, window=2, cap=0, credit=0, max_payload=1 << 20)
        assert fcntl.fcntl(ours.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK
        loop.stop()
        assert not fcntl.fcntl(ours.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK
        fd = ours.fileno()
        ours.close()
        reused, other = socket.socketpair()  # the lowest free numbers: most likely `fd` again
        with reused, other:
            reused.setblocking(False)
            del loop  # the loop object collected now must not touch `fd`
            assert fcntl.fcntl(reused.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK, (fd, reused.fileno())


def test_bytes_pushed_and_not_acknowledged_are_counted_as_credit_in_use(gn):
    """The loop's credit in use (the worker's /status and gauge on the native path): a push the server has not
    acknowledged counts until it is, or until the call fails."""
    import socket
    import time

    ours, server = socket.socketpair()
    with ours, server:
        loop = gn.WorkerLoop([ours.fileno()], rank=0, epoch=0, window=2, cap=0, credit=0, max_payload=1 << 20)
        send, out = np.ones(1024, np.float32), np.empty(1024, np.float32)
        loop.submit(
            1,
            "t",
            1,
            0,
            dtypes.BY_NAME["float32"].code,
            send.view(np.uint8),
            out.view(np.uint8),
            [(7, 0, 0, 4096, 0, 4096, 0)],
        )
        deadline = time.monotonic() + 5
        while loop.credit_used == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.credit_used == 4096  # pushed, never acknowledged by this silent server
        loop.stop("done")
        assert loop.completions(1.0) == [(1, "done")]


def _completions(loop, want: int, seconds: float = 5.0) -> list:
    import time

    got, deadline = [], time.monotonic() + seconds
    while len(got) < want and time.monotonic() < deadline:
        got += loop.completions(0.1)
    return got


@pytest.mark.parametrize("failover", [False, True], ids=["failed", "kept"])
def test_a_part_waiting_for_credit_when_its_link_dies_is_counted_once(gn, failover):
    """A part let go by the flow and waiting for credit is among the link's parts in flight: when the link dies it is
    failed once (the call completes once) or, with failover on, kept once (pushed once to the key's next server)."""
    import socket
    import time

    ours, server = socket.socketpair()
    with ours:
        options = dict(rank=0, epoch=0, window=4, cap=0, credit=6000, max_payload=1 << 20, failover=failover)
        loop = gn.WorkerLoop([ours.fileno()], **options)
        send, out = np.ones(2048, np.float32), np.empty(2048, np.float32)
        plan = [(7, 0, 0, 4096, 0, 4096, 0), (8, 0, 4096, 4096, 4096, 4096, 1)]  # the second waits for credit
        code = dtypes.BY_NAME["float32"].code
        loop.submit(1, "t", 1, 0, code, send.view(np.uint8), out.view(np.uint8), plan, [1, 1] if failover else [])
        server.settimeout(5)
        got = b""
        while len(got) < 40 + 4096:  # the first push, whole
            got += server.recv(1 << 16)
        deadline = time.monotonic() + 5
        while loop.credit_used != 4096 and time.monotonic() < deadline:  # as of the loop's next pass
            time.sleep(0.01)
        assert loop.credit_used == 4096
        server.close()  # the server dies
        if failover:
            (lost,) = _completions(loop, 1)  # the link's loss, said as call 0's completion
            assert lost[0] == 0 and lost[1].startswith("server 0: "), lost
            assert sorted(loop.orphans(0)) == [(7, 1), (8, 1)]
            assert sorted(loop.unanswered([7, 8, 9])) == [(7, 1), (8, 1)]
            loop.stop("done")
            assert _completions(loop, 1) == [(1, "done")]
        else:
            done = _completions(loop, 2, seconds=1.0)
            assert len(done) == 1 and done[0][0] == 1 and done[0][1].startswith("server 0: "), done
            loop.stop("done")
        assert loop.credit_used == 0


def test_a_payload_under_way_holds_the_sockets_readiness_until_more_of_it_is_in(gn):
    """Over TCP, a payload arriving a segment at a time would wake the loop for each; while one is under way the
    link sets SO_RCVLOWAT to the rest of it (at most 16 KiB), 1 again between frames, and a stopped loop gives the
    socket back with the kernel's default mark (a blocking receive would otherwise wait for it)."""
    import socket
    import time

    from gradwire.protocol import frames

    def mark(s):
        return s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)

    def until(predicate):
        deadline = time.monotonic() + 5
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.01)
        return predicate()

    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    with ours, server:
        n = 16384  # float32: a 64 KiB partition
        loop = gn.WorkerLoop([ours.fileno()], rank=0, epoch=0, window=2, cap=0, credit=0, max_payload=1 << 20)
        send, out = np.ones(n, np.float32), np.zeros(n, np.float32)
        code = dtypes.BY_NAME["float32"].code
        loop.submit(1, "t", 1, 0, code, send.view(np.uint8), out.view(np.uint8), [(7, 0, 0, 4 * n, 0, 4 * n, 0)])
        total = (2 * np.ones(n, np.float32)).tobytes()

        def pushed_and_answered_in_part(rnd: int, part: int) -> bytes:
            pushed = bytearray()
            while len(pushed) < frames.HEADER_SIZE + 4 * n:
                pushed += server.recv(1 << 20)
            assert mark(ours) == 1  # between frames
            answer = frames.encode_header(frames.FrameType.RESULT, 4 * n, dtype=code, key=7, round=rnd)
            server.sendall(answer + total[:part])  # the header and a part of the payload
            return answer

        pushed_and_answered_in_part(1, 20000)
        assert until(lambda: mark(ours) == 16384), mark(ours)  # the rest is 45,536 bytes: the cap
        server.sendall(total[20000:60000])
        assert until(lambda: mark(ours) == 5536), mark(ours)  # the rest exactly, over kLowatMin
        server.sendall(total[60000:])
        assert _completions(loop, 1) == [(1, "")] and (out == 2).all()
        # back to 1 once the loop is done with the frame, which is just after the call it completes is reported
        assert until(lambda: mark(ours) == 1), mark(ours)
        loop.submit(2, "t", 2, 0, code, send.view(np.uint8), out.view(np.uint8), [(7, 0, 0, 4 * n, 0, 4 * n, 0)])
        pushed_and_answered_in_part(2, 30000)
        assert until(lambda: mark(ours) == 16384)
        loop.stop("done")
        assert mark(ours) == 1  # given back as it was
