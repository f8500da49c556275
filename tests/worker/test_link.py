"""A worker's link to one server, driven by hand over a socket pair (worker/link.py)."""

import socket
import time

import numpy as np

from gradwire.protocol import dtypes, frames
from gradwire.protocol.frames import FrameType
from gradwire.transport import tcp
from gradwire.worker.credit import Credit
from gradwire.worker.handle import Handle
from gradwire.worker.link import ServerLink
from gradwire.worker.work import Work


def test_an_answer_that_overtakes_the_senders_stamp_still_times_every_stage_from_the_push():
    """The server may answer before the sender thread has stamped the end of its send (a loaded machine): the
    partition's stages must still start at its push, not at time 0 (which put timeline events hours in the past and
    negative seconds into the stage histogram)."""
    ours, theirs = socket.socketpair()
    link = ServerLink(tcp.Connection(ours, 1 << 20), server=0, rank=0, epoch=1, window=4, credit=Credit(1 << 20))
    out = np.zeros(4, np.float32)
    handle = Handle("t", out, 1, lambda h: None)
    work = Work("t", 7, 1, dtypes.from_numpy(out.dtype).code, out, out, 1, handle)
    work.t_queued = work.t_sent = time.monotonic()  # taken to be sent; the socket has not taken it all yet
    link.flow.pending[7], link.flow.in_flight = work, 1
    header = bytearray(frames.HEADER_SIZE)
    frames.pack_header_into(header, FrameType.RESULT, out.nbytes, work.dtype, 1, 0, 7, 1)
    theirs.sendall(bytes(header) + np.full(4, 2, np.float32).tobytes())
    link._read_frames()
    assert handle.wait(1.0).tolist() == [2.0] * 4
    assert work.t_pushed >= work.t_sent
    assert min(link.metrics._seconds) >= 0.0 and link.metrics.bytes_pulled == out.nbytes
    ours.close()
    theirs.close()


def test_the_stage_histogram_and_counters_read_as_prometheus_did():
    """Counted as plain numbers on the data path, exposed in prometheus_client's types when /metrics is read."""
    from prometheus_client.parser import text_string_to_metric_families

    from gradwire.admin.metrics import Metrics

    metrics = Metrics("worker")
    metrics.pushed(100)
    metrics.partition(64, 0.0001, 0.002, 0.002, 20.0)  # queued, push, wait, pull
    metrics.partition(64, 0.0001, 0.0005, 0.5, 0.001)
    metrics.round_done()
    status, _, body = metrics.exposition()
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("gradwire_pushed_bytes_total", (("role", "worker"),))] == 100
    assert samples[("gradwire_pulled_bytes_total", (("role", "worker"),))] == 128
    assert samples[("gradwire_rounds_completed_total", (("role", "worker"),))] == 1
    bucket = "gradwire_partition_stage_seconds_bucket"
    assert samples[(bucket, (("le", "0.0005"), ("stage", "push")))] == 1  # an upper bound includes its value
    assert samples[(bucket, (("le", "0.0025"), ("stage", "push")))] == 2  # cumulative
    assert (
        samples[(bucket, (("le", "10.0"), ("stage", "pull")))] == 1
        and samples[(bucket, (("le", "+Inf"), ("stage", "pull")))] == 2
    )
    assert samples[("gradwire_partition_stage_seconds_count", (("stage", "wait"),))] == 2
    assert abs(samples[("gradwire_partition_stage_seconds_sum", (("stage", "wait"),))] - 0.502) < 1e-9
    assert status == 200 and "gradwire_partition_stage_seconds" not in Metrics("server").exposition()[2].decode()


def _works(count: int, size: int = 1024) -> tuple[list[Work], list[np.ndarray]]:
    """`count` partitions of `size` bytes (float32), each of its own key, with their outputs."""
    outs = [np.zeros(size // 4, np.float32) for _ in range(count)]
    code = dtypes.from_numpy(np.dtype(np.float32)).code
    works = [
        Work("t", key, 1, code, np.full(size // 4, key, np.float32), out, 1, Handle("t", out, 1, lambda h: None))
        for key, out in enumerate(outs)
    ]
    return works, outs


def _read_pushes(conn: tcp.Connection, count: int) -> list[int]:
    """The keys of the next `count` PUSHPULL frames, payloads checked."""
    keys = []
    for _ in range(count):
        header = conn.recv_header()
        assert header.type == FrameType.PUSHPULL
        data = np.empty(header.length // 4, np.float32)
        conn.recv_into(memoryview(data))
        assert (data == header.key).all()
        keys.append(header.key)
    return keys


def test_small_partitions_leave_several_to_a_send_and_the_window_still_bounds_what_is_unacknowledged():
    """Partitions flow control lets go together leave in one send (SEND_BATCH_BYTES), one ACKS frame frees several
    window places at once, and the window still bounds the pushes the server has not acknowledged."""
    ours, theirs = socket.socketpair()
    server = tcp.Connection(theirs, 1 << 20)
    link = ServerLink(tcp.Connection(ours, 1 << 20), server=0, rank=0, epoch=1, window=4, credit=Credit(1 << 20))
    sends = []
    send = link.conn.send_some
    link.conn.send_some = lambda parts: (sends.append(len(parts)), send(parts))[1]
    works, outs = _works(10)
    link.submit_all(works, 0)
    link.start()
    assert _read_pushes(server, 4) == [0, 1, 2, 3]  # the window's worth, in the order queued
    time.sleep(0.1)
    theirs.setblocking(False)
    try:
        assert not theirs.recv(1, socket.MSG_PEEK), "pushed past the window"
    except BlockingIOError:
        pass
    theirs.setblocking(True)
    assert sends == [8]  # four frames (header and data each) in one send
    body = b"".join(frames.ACK_ENTRY.pack(key, 1) for key in (0, 1, 2))
    server.send([frames.encode_header(FrameType.ACKS, len(body)), body])
    assert _read_pushes(server, 3) == [4, 5, 6]  # three places freed by one frame
    assert link.flow.in_flight == 4 and link.credit.used == 4 * 1024
    link.close(RuntimeError("done"))
    link.join(2)
    theirs.close()


def test_an_ack_for_a_partition_not_in_flight_or_of_another_round_breaks_the_link():
    import pytest

    from gradwire.errors import RemoteProtocolError

    ours, theirs = socket.socketpair()
    link = ServerLink(tcp.Connection(ours, 1 << 20), server=0, rank=0, epoch=1, window=4, credit=Credit(1 << 20))
    works, _ = _works(1)
    link.flow.push(works[0], 0)
    assert link.flow.next(0.0) is works[0]
    with pytest.raises(RemoteProtocolError, match="round 2"):
        link._on_acks(frames.ACK_ENTRY.pack(0, 2))
    with pytest.raises(RemoteProtocolError, match="not in flight"):
        link._on_acks(frames.ACK_ENTRY.pack(9, 1))
    ours.close()
    theirs.close()
