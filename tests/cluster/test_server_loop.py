"""A server's link loop (transport/loop.py, server/reader.py; and the native server loop, server/native_path.py): one
thread reads every worker connection and runs the engine after each pass. A connection cut off mid-frame is dropped at
the frame timeout without stalling the ring; more engines than one run as threads of their own and sum the same."""

import logging
import time

import numpy as np
import pytest

from gradwire.errors import GradwireError
from gradwire.protocol import frames
from gradwire.protocol.frames import FrameType
from gradwire.testing import LocalCluster
from gradwire.transport import endpoints


def _wait(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _as_worker(server, rank):
    """An authenticated raw connection to `server` as worker `rank`."""
    return endpoints.connect(
        ("127.0.0.1", server.port), secret=b"", role="worker", rank=rank, max_payload=1 << 20, timeout=5.0
    )


@pytest.mark.parametrize("datapath", ["python", "auto"])
def test_a_worker_cut_off_mid_frame_is_dropped_at_the_frame_timeout_and_the_loop_goes_on(caplog, datapath):
    """A blocking reader's receive timed out; the loop has no blocking receive: a frame begun and not continued within
    GRADWIRE_FRAME_TIMEOUT must fail its connection, and its claimed ring slot must go to the engine empty (else the
    engine waits on it forever, and with it every worker)."""
    with LocalCluster(num_workers=2, num_servers=1, transport="tcp", frame_timeout=0.5, datapath=datapath) as c:
        c.run(lambda w: w.push_pull(np.ones(1000, np.float32), "g"))
        server = c.servers[0]
        if server.state.native is not None:  # the native loop's key: 1000 float32
            ((key, _),) = server.state.native.names.items()
            length, code = 4000, 2
        else:
            ((key, state),) = server.engines[0].keys.items()
            length, code = state.length, state.dtype.code
        c.workers[1].links[0].close(GradwireError("test"), farewell=frames.encode_header(FrameType.BYE, 0))
        _wait(lambda: 1 not in server.state.links)

        cut = _as_worker(server, 1)
        header = frames.encode_header(
            FrameType.PUSHPULL, length, dtype=code, sender=1, epoch=server.epoch, key=key, round=2
        )
        with caplog.at_level(logging.WARNING, logger="gradwire.server"):
            cut.sock.sendall(header + bytes(length // 2))
            _wait(lambda: 1 in server.state.links)
            cut.sock.settimeout(10)
            assert cut.sock.recv(1) == b"", "the server should close a connection cut off mid-frame"
        assert any("frame begun" in r.getMessage() and "worker 1" in r.getMessage() for r in caplog.records)
        _wait(lambda: 1 not in server.state.links and server.engines[0].ring.occupancy == 0)

        # the loop goes on: a whole push from a new connection is taken (acknowledged: worker 0 has not pushed)
        whole = _as_worker(server, 1)
        whole.sock.sendall(header + np.ones(length // 4, np.float32).tobytes())
        reply = whole.recv_header()
        assert reply.type == FrameType.ACKS
        entries = list(frames.ACK_ENTRY.iter_unpack(whole.recv_body(reply)))
        assert entries == [(key, 2)]
        whole.close()
        cut.close()


@pytest.mark.parametrize("datapath", ["python", "auto"])
def test_a_connection_s_first_frames_read_ahead_by_its_handshake_are_not_left_unread(datapath):
    """The handshake reads ahead: a frame sent right behind it is in the connection's buffer, and epoll never says
    the socket is readable for it. The loop reads it on its first pass over the connection."""
    with LocalCluster(num_workers=1, num_servers=1, transport="tcp", datapath=datapath) as c:
        c.run(lambda w: w.push_pull(np.ones(10, np.float32), "g"))
        server = c.servers[0]
        c.workers[0].links[0].close(GradwireError("test"), farewell=frames.encode_header(FrameType.BYE, 0))
        _wait(lambda: 0 not in server.state.links)
        # the worker's side of the handshake, then a frame at once, before the server has taken the connection
        conn = _as_worker(server, 0)
        conn.sock.sendall(frames.encode_json(FrameType.SHM_ATTACH, {"path": "/nowhere", "push": 1, "pull": 1}))
        conn.sock.settimeout(10)
        _, body = conn.recv_json(FrameType.SHM_ATTACH)
        assert body["ok"] is False
        conn.close()


def test_engines_on_threads_of_their_own_sum_the_same():
    """GRADWIRE_ENGINES > 1: each engine is a thread (the loop only reads); sums and their bytes are the same. (The
    Python path's engines: the native loop sums on its own thread.)"""
    x = [np.arange(50_000, dtype=np.float32) * (r + 1) for r in range(3)]
    sums = []
    for engines in (1, 3):
        options = dict(engines=engines, partition_bytes=16384, datapath="python")
        with LocalCluster(num_workers=3, num_servers=2, **options) as c:
            server = c.servers[0]
            assert [e.inline for e in server.engines] == ([True] if engines == 1 else [False] * 3)
            for step in range(3):
                out = c.run(lambda w, step=step: w.push_pull(x[w.rank] + step, "g"))
                assert all(o.tobytes() == out[0].tobytes() for o in out)
            sums.append(out[0])
    np.testing.assert_array_equal(sums[0], sums[1])
    np.testing.assert_allclose(sums[0], sum(x) + 6, rtol=1e-6)
