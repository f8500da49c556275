"""Frame timeouts on a connection (transport/tcp.py): kept by the kernel, without a poll() before every call."""

import socket
import threading
import time

import pytest

from gradwire.errors import GradwireTimeout
from gradwire.protocol import frames
from gradwire.protocol.frames import FrameType
from gradwire.transport import tcp


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair()
    tcp.set_frame_timeout(ours, 0.2)
    yield tcp.Connection(ours, 1 << 20), theirs
    ours.close()
    theirs.close()


def test_idle_between_frames_is_fine_but_a_frame_begun_must_arrive_within_the_timeout(pair):
    conn, peer = pair
    assert conn.sock.gettimeout() is None  # a blocking socket: no poll() before each recv and send
    got = []
    reader = threading.Thread(target=lambda: got.append(conn.recv_header(idle_ok=True)))
    reader.start()
    time.sleep(0.6)  # three timeouts of silence before any frame: idleness, not an error
    assert reader.is_alive()
    header = bytearray(frames.HEADER_SIZE)
    frames.pack_header_into(header, FrameType.RESULT, 16, 2, 1, 0, 7, 1)
    peer.sendall(bytes(header) + b"\0" * 8)  # the frame begins: half its payload, then silence
    reader.join(5)
    assert got and got[0].key == 7 and got[0].length == 16
    start = time.monotonic()
    with pytest.raises(GradwireTimeout):
        conn.recv_into(memoryview(bytearray(16)))
    assert time.monotonic() - start < 2.0


def test_a_peer_that_stops_reading_fails_a_send_within_the_timeout(pair):
    conn, _ = pair
    start = time.monotonic()
    with pytest.raises(GradwireTimeout):
        conn.send([bytearray(64 << 20)])  # far more than the socket buffers hold; the peer never reads
    assert time.monotonic() - start < 5.0


def test_replies_sent_at_once_never_overtake_queued_ones_and_every_frame_stays_whole():
    """A server's small replies go from the engine's thread at once when nothing is queued before them; a full
    socket sends the rest through the reply thread, in order (server.py WorkerLink.reply)."""
    import numpy as np

    from gradwire.server.replier import AckReply, ResultReply, WorkerLink
    from gradwire.transport.shm import NO_SLOT

    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # fills after a few small replies
    link = WorkerLink(tcp.Connection(ours, 1 << 20))
    replier = threading.Thread(target=link.reply_loop, args=(1, 0), daemon=True)
    replier.start()
    while link._ids is None:
        time.sleep(0.001)
    payloads = {"ack": None, "small": np.arange(1000, dtype=np.float32), "big": np.arange(200_000, dtype=np.float32)}
    order = ["ack", "small", "ack"] + ["small", "ack", "big", "ack", "small"] * 6
    for key, kind in enumerate(order):
        payload = payloads[kind]
        link.reply(
            AckReply(key, 1) if payload is None else ResultReply(key, 1, 2, memoryview(payload).cast("B"), NO_SLOT)
        )
        if key == 0:
            assert link._queued == 0  # sent at once: nothing was queued, and the socket took it
    peer = tcp.Connection(theirs, 1 << 22)
    for key, kind in enumerate(order):
        header = peer.recv_header()
        payload = payloads[kind]
        assert (header.key, header.type) == (key, FrameType.ACK if payload is None else FrameType.RESULT)
        if payload is not None:
            got = bytearray(header.length)
            peer.recv_into(memoryview(got))
            assert bytes(got) == payload.tobytes()
    link.replies.put(None)
    replier.join(5)
    assert link.metrics.bytes_pulled == sum(payloads[k].nbytes for k in order if payloads[k] is not None)
    ours.close()
    theirs.close()
