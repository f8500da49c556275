"""The native floor (benchmarks/floor.py's native shapes, native/cpp/floor.cpp): every sum right in every shape of job,
and a peer that dies or lies is an error, never a wait."""

import os
import socket

import numpy as np
import pytest

from benchmarks import floor

KiB = 1 << 10


@pytest.mark.parametrize("mode", floor.NATIVE_MODES)
@pytest.mark.parametrize("partition", [32 * KiB, 1 << 20])
def test_one_worker_and_one_server_sum_into_place(gn, mode, partition):
    row = floor.measure(partition, (3 << 20) + 4 * KiB, 2, mode)  # the last partition is short
    assert row["mode"] == mode and row["worker_cpu_seconds_per_gb"] > 0


@pytest.mark.parametrize("mode", floor.NATIVE_MODES)
@pytest.mark.parametrize(("workers", "servers"), [(2, 1), (1, 3), (3, 2), (4, 4)])
def test_every_shape_of_job_sums_exactly(gn, mode, workers, servers):
    # small partitions, many frames in flight: contributions arrive in every order (a worker's check is exact)
    row = floor.measure_job(workers, servers, 16 * KiB, (2 << 20) + 4 * KiB, 3, 1, mode)
    assert row["workers"] == workers and row["servers"] == servers and row["seconds_per_call"] > 0


def test_small_socket_buffers_cut_frames_anywhere(gn):
    """Buffers of a few KiB: every send and receive stops mid-header or mid-payload and resumes."""
    ours, theirs = socket.socketpair()
    for s in (ours, theirs):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    shape = gn.FloorShape(1 << 20, 48 * KiB, 2, 3)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ours.close()
            gn.floor_serve([theirs.fileno()], shape, 0, 1, 2)
            code = 0
        finally:
            os._exit(code)
    theirs.close()
    data = np.random.default_rng(1).random(shape.size // 4, dtype=np.float32)
    out = np.zeros_like(data)
    with ours:
        for r in range(2):
            gn.floor_push_pull([ours.fileno()], shape, data, out, r)
    assert os.waitpid(pid, 0)[1] == 0
    assert np.array_equal(out, data)


def test_a_server_that_dies_is_an_error_at_once(gn):
    ours, theirs = socket.socketpair()
    theirs.close()  # a server gone before answering
    shape = gn.FloorShape(1 << 20, 32 * KiB, 1, 4)
    data = np.ones(shape.size // 4, np.float32)
    with ours, pytest.raises(ConnectionError):
        gn.floor_push_pull([ours.fileno()], shape, data, np.empty_like(data), 0)


def test_an_answer_that_matches_nothing_pushed_is_refused(gn):
    ours, theirs = socket.socketpair()
    shape = gn.FloorShape(64 * KiB, 32 * KiB, 1, 4)
    # a RESULT for a key past the call's frames
    theirs.sendall(gn.encode_header(5, 32 * KiB, dtype=2, key=99) + bytes(32 * KiB))
    data = np.ones(shape.size // 4, np.float32)
    with ours, theirs, pytest.raises(ValueError, match="matches no frame pushed.*key 99"):
        gn.floor_push_pull([ours.fileno()], shape, data, np.empty_like(data), 0)


def test_the_job_refuses_python_shapes(gn):
    with pytest.raises(ValueError, match="only in native code"):
        floor.measure_job(2, 2, 32 * KiB, 1 << 20, 1, 0, "one-thread")
