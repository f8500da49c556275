import pytest

from gradwire.errors import AuthenticationError, RemoteProtocolError
from gradwire.protocol.handshake import Handshake


def _pair(secret_a=b"s3cret", secret_b=b"s3cret"):
    a = Handshake(secret=secret_a, role="worker", rank=1, initiator=True)
    b = Handshake(secret=secret_b, role="server", rank=0, initiator=False)
    return a, b


def _run(a, b):
    proof_a = a.receive_hello(b.hello())
    proof_b = b.receive_hello(a.hello())
    b.receive_proof(proof_a)
    a.receive_proof(proof_b)
    return proof_a, proof_b


def test_same_secret_authenticates_both_ways():
    a, b = _pair()
    _run(a, b)
    assert a.peer["role"] == "server" and b.peer["rank"] == 1


def test_wrong_secret_is_refused_on_both_sides():
    a, b = _pair(b"right", b"wrong")
    proof_a = a.receive_hello(b.hello())
    proof_b = b.receive_hello(a.hello())
    with pytest.raises(AuthenticationError, match="wrong job secret"):
        b.receive_proof(proof_a)
    with pytest.raises(AuthenticationError):
        a.receive_proof(proof_b)


def test_a_replayed_proof_fails_against_a_fresh_nonce():
    a, b = _pair()
    proof_a, _ = _run(a, b)
    # an eavesdropper replays worker a's HELLO and PROOF to a new server session
    fresh = Handshake(secret=b"s3cret", role="server", rank=0, initiator=False)
    fresh.receive_hello(a.hello())
    with pytest.raises(AuthenticationError):
        fresh.receive_proof(proof_a)


def test_reflecting_our_own_nonce_is_refused():
    a, _ = _pair()
    with pytest.raises(AuthenticationError, match="reflection"):
        a.receive_hello(a.hello())


def test_reflected_proof_is_refused():
    # a peer that copies our proof back cannot pass: the direction is part of the MAC
    a, b = _pair()
    proof_a = a.receive_hello(b.hello())
    b.receive_hello(a.hello())
    with pytest.raises(AuthenticationError):
        a.receive_proof(proof_a)


def test_the_secret_is_not_in_any_message():
    a, b = _pair(b"topsecret-value", b"topsecret-value")
    proof_a, proof_b = _run(a, b)
    wire = repr([a.hello(), b.hello(), proof_a, proof_b, a, b])
    assert "topsecret" not in wire and b"topsecret".hex() not in wire


@pytest.mark.parametrize(
    "hello", [{}, {"role": "w", "rank": 0, "nonce": "zz"}, {"role": "w", "rank": 0, "nonce": "00"}]
)
def test_malformed_hello_is_a_protocol_error(hello):
    a, _ = _pair()
    with pytest.raises(RemoteProtocolError):
        a.receive_hello(hello)
