"""Connections (transport/tcp.py): frame timeouts kept by the kernel, reading ahead, and a server's replies in order."""

import socket
import threading
import time

import pytest

from gradwire.errors import GradwireTimeout, RemoteProtocolError
from gradwire.protocol import frames
from gradwire.protocol.frames import FrameType
from gradwire.transport import endpoints, tcp


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair()
    endpoints.set_frame_timeout(ours, 0.2)
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
    socket sends the rest through the reply thread, in order (server.py Replier.reply)."""
    import numpy as np

    from gradwire.server.replier import AckReply, Replier, ResultReply
    from gradwire.transport.shm import NO_SLOT

    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # fills after a few small replies
    link = Replier(tcp.Connection(ours, 1 << 20))
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
    assert _replies(peer, len(order), payloads) == [(key, kind) for key, kind in enumerate(order)]
    link.replies.put(None)
    replier.join(5)
    assert link.metrics.bytes_pulled == sum(payloads[k].nbytes for k in order if payloads[k] is not None)
    ours.close()
    theirs.close()


def _replies(peer: tcp.Connection, count: int, payloads: dict) -> list[tuple[int, str]]:
    """(key, kind) of the next `count` replies a worker reads (each ACK of an ACKS frame apart), payloads checked."""
    got: list[tuple[int, str]] = []
    while len(got) < count:
        header = peer.recv_header()
        if header.type == FrameType.ACKS:
            for key, rnd in frames.ACK_ENTRY.iter_unpack(peer.recv_body(header)):
                assert rnd == 1
                got.append((key, "ack"))
            continue
        assert header.type == FrameType.RESULT
        data = bytearray(header.length)
        peer.recv_into(memoryview(data))
        kind = next(k for k, p in payloads.items() if p is not None and p.nbytes == header.length)
        assert bytes(data) == payloads[kind].tobytes()
        got.append((header.key, kind))
    return got


def test_replies_held_over_a_batch_go_in_one_send_in_order_with_their_acks_in_one_frame():
    """An engine holds its replies over a batch of its ring (server/replier.py HeldReplies); at the batch's end each
    worker's go in order, consecutive ACKs in one ACKS frame; a reply from another thread goes behind what is held."""
    import numpy as np

    from gradwire.server.replier import AckReply, HeldReplies, Replier, ResultReply
    from gradwire.transport.shm import NO_SLOT

    ours, theirs = socket.socketpair()
    link = Replier(tcp.Connection(ours, 1 << 20))
    replier = threading.Thread(target=link.reply_loop, args=(1, 0), daemon=True)
    replier.start()
    while link._ids is None:
        time.sleep(0.001)
    small = np.arange(1000, dtype=np.float32)
    payloads = {"ack": None, "small": small}
    held = HeldReplies()
    held.begin()
    order = ["ack", "ack", "ack", "small", "ack", "ack"]
    for key, kind in enumerate(order):
        item = AckReply(key, 1) if kind == "ack" else ResultReply(key, 1, 2, memoryview(small).cast("B"), NO_SLOT)
        held.reply(link, item)
    theirs.setblocking(False)
    with pytest.raises(BlockingIOError):
        theirs.recv(1, socket.MSG_PEEK)  # held: nothing sent yet
    theirs.setblocking(True)
    other = threading.Thread(target=held.reply, args=(link, AckReply(len(order), 1)))  # not the engine's thread
    other.start()
    other.join(5)
    held.flush()
    peer = tcp.Connection(theirs, 1 << 22)
    assert _replies(peer, len(order) + 1, payloads) == [(k, kind) for k, kind in enumerate([*order, "ack"])]
    link.replies.put(None)
    replier.join(5)
    ours.close()
    theirs.close()


def test_a_batch_of_acks_is_one_frame_and_a_torn_one_is_refused():
    body = b"".join(frames.ACK_ENTRY.pack(key, 7) for key in range(5))
    header = frames.encode_header(FrameType.ACKS, len(body))
    assert frames.decode_header(header, 0).length == 5 * frames.ACK_ENTRY.size
    with pytest.raises(RemoteProtocolError, match="whole number of entries"):
        frames.decode_header(frames.encode_header(FrameType.ACKS, len(body) - 1), 0)


def test_frames_read_whole_however_the_bytes_arrive_several_to_a_receive_or_one_byte_at_a_time():
    """Reading ahead (transport/tcp.py): headers and payloads come out right whether the peer's bytes arrive many
    frames to a receive, split anywhere, or a byte at a time, and a large payload lands whole past the read-ahead."""
    import random

    rng = random.Random(5)
    sizes = [0, 4, 40, 1000, 4096, 5000, 70_000, 300_000] * 3
    rng.shuffle(sizes)
    stream = b""
    for key, size in enumerate(sizes):
        payload = bytes(rng.getrandbits(8) for _ in range(min(size, 64))) * (size // 64) + bytes(size % 64)
        stream += frames.encode_header(FrameType.PUSHPULL, len(payload), dtype=2 if size % 4 == 0 else 0, key=key)
        stream += payload
    for chunking in ("all", "random", "bytes"):
        ours, theirs = socket.socketpair()
        conn = tcp.Connection(ours, 1 << 20)

        def feed(chunking=chunking, theirs=theirs):
            at = 0
            while at < len(stream):
                step = {"all": len(stream), "random": rng.randint(1, 9000), "bytes": 1}[chunking]
                if chunking == "bytes" and at > 2000:
                    step = 7000  # a byte at a time through the first frames, then faster
                theirs.sendall(stream[at : at + step])
                at += step

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        at = 0
        for key, size in enumerate(sizes):
            header = conn.recv_header()
            assert (header.key, header.length) == (key, size)
            at += frames.HEADER_SIZE
            got = bytearray(size)
            conn.recv_into(memoryview(got))
            assert bytes(got) == stream[at : at + size]
            at += size
        feeder.join(10)
        ours.close()
        theirs.close()


def test_a_connection_the_kernel_gave_its_own_port_is_refused_and_frees_the_port(monkeypatch):
    """TCP's simultaneous open: a socket connecting to a port nobody listens on, given that same port as its own end,
    is connected to itself. `connect` refuses it as nothing listened, so the port is free for a restarted listener."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()

    def to_itself(address, timeout=None):  # what the kernel does now and then on a reconnect loop
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.connect(address)
        return sock

    monkeypatch.setattr(endpoints.socket, "create_connection", to_itself)
    with pytest.raises(ConnectionRefusedError, match="connected to itself"):
        endpoints.connect(("127.0.0.1", port), secret=b"", role="worker", rank=0, max_payload=1024, timeout=1.0)
    monkeypatch.undo()
    endpoints.listen("127.0.0.1", port).close()  # the port is free at once


def test_a_listener_at_a_given_port_waits_for_it_to_be_free_only_as_long_as_asked():
    holder = endpoints.listen("127.0.0.1")
    port = holder.getsockname()[1]
    with pytest.raises(OSError, match="in use"):
        endpoints.listen("127.0.0.1", port)
    threading.Timer(0.3, holder.close).start()
    began = time.monotonic()
    endpoints.listen("127.0.0.1", port, in_use_wait=10.0).close()
    assert 0.2 < time.monotonic() - began < 5.0
