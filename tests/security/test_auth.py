"""Authentication on live sockets: no secret, a wrong secret, or a replayed handshake gets nowhere."""

import socket

import numpy as np
import pytest

from gradwire import AuthenticationError
from gradwire.protocol import frames
from gradwire.protocol.frames import FrameType
from gradwire.protocol.handshake import Handshake
from gradwire.testing import LocalCluster
from gradwire.transport import endpoints, tcp

SECRET = "correct horse battery staple"


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(num_workers=2, num_servers=1, secret=SECRET, handshake_timeout=2.0) as c:
        yield c


def _addresses(c):
    host, port = c.scheduler.address.rsplit(":", 1)
    return {"scheduler": (host, int(port)), "server": ("127.0.0.1", c.servers[0].port)}


def _closed_by_peer(sock, timeout=5.0):
    """True if the peer closes the connection (EOF or reset) within `timeout`."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def _still_works(c):
    results = c.run(lambda w: w.push_pull(np.arange(10, dtype=np.int64) * (w.rank + 1), "auth-check"))
    assert all(np.array_equal(r, np.arange(10) * 3) for r in results)


@pytest.mark.parametrize("target", ["scheduler", "server"])
def test_a_peer_without_the_secret_is_dropped_before_anything_else_is_read(cluster, target):
    with socket.create_connection(_addresses(cluster)[target]) as s:
        s.sendall(frames.encode_json(FrameType.CONTROL, {"op": "register", "role": "worker", "host": "x", "port": 0}))
        assert _closed_by_peer(s)
    _still_works(cluster)


@pytest.mark.parametrize("target", ["scheduler", "server"])
def test_a_wrong_secret_is_refused_on_both_sides(cluster, target):
    with pytest.raises(AuthenticationError):
        endpoints.connect(_addresses(cluster)[target], secret=b"wrong", role="worker", rank=0, max_payload=0, timeout=5)
    _still_works(cluster)


def _handshake(sock, hs):
    """Run our side of the handshake over a raw socket; returns (our hello, our proof, the peer's reply)."""
    conn = tcp.Connection(sock, 0)
    hello = hs.hello()
    conn.send_json(FrameType.HELLO, hello)
    _, peer_hello = conn.recv_json(FrameType.HELLO)
    proof = hs.receive_hello(peer_hello)
    conn.send_json(FrameType.PROOF, proof)
    return hello, proof


def test_a_replayed_handshake_is_refused(cluster):
    address = _addresses(cluster)["scheduler"]
    with socket.create_connection(address) as s:  # a legitimate session, recorded
        hello, proof = _handshake(s, Handshake(secret=SECRET.encode(), role="worker", rank=0, initiator=True))
        assert not _closed_by_peer(s, timeout=0.5)  # accepted: the scheduler now waits for a registration
    with socket.create_connection(address) as s:  # the recording, replayed against a fresh nonce
        conn = tcp.Connection(s, 0)
        conn.send_json(FrameType.HELLO, hello)
        conn.recv_json(FrameType.HELLO)
        conn.send_json(FrameType.PROOF, proof)
        assert _closed_by_peer(s)
    _still_works(cluster)


def test_a_silent_peer_is_dropped_after_the_handshake_timeout(cluster):
    with socket.create_connection(_addresses(cluster)["server"]) as s:
        assert _closed_by_peer(s, timeout=10)  # handshake_timeout is 2 s here


def test_the_secret_never_appears_in_reprs_errors_or_logs(cluster, caplog):
    caplog.set_level("DEBUG", logger="gradwire")
    texts = [repr(cluster.config), repr(cluster.workers[0].config), repr(cluster.scheduler), repr(cluster.servers[0])]
    texts += [repr(link.conn) for link in cluster.workers[0].links]
    for target in ("scheduler", "server"):
        try:
            endpoints.connect(
                _addresses(cluster)[target], secret=b"wrong", role="worker", rank=0, max_payload=0, timeout=5
            )
        except AuthenticationError as e:
            texts.append(str(e))
    texts += [r.getMessage() for r in caplog.records]
    assert len(texts) >= 7
    assert not any(SECRET in t or SECRET.encode().hex() in t for t in texts)
