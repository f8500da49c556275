"""The native header decoder against protocol/frames.py, the reference: the same fields or the same refusal for the
same bytes, on generated headers, the security suite's mutations, and junk fed through a native link."""

import random
import socket
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradwire.errors import RemoteProtocolError
from gradwire.protocol import frames
from tests.security.test_fuzz import _mutations

MAX_PAYLOAD = 1 << 20


def both(gn, raw: bytes, max_payload: int = MAX_PAYLOAD):
    """What each decoder makes of `raw`: the fields, or the refusal's message."""
    try:
        python = tuple(int(f) for f in frames.decode_header(raw, max_payload))
    except RemoteProtocolError as e:
        python = str(e)
    try:
        native = gn.decode_header(raw, max_payload)
    except ValueError as e:
        native = str(e)
    return python, native


headers = st.builds(
    lambda magic, version, ftype, flags, dtype, epoch, sender, key, rnd, status, length: frames.HEADER.pack(
        magic, version, ftype, flags, dtype, epoch, sender, key, rnd, status, length
    ),
    st.sampled_from([frames.MAGIC, frames.MAGIC, frames.MAGIC, 0, frames.MAGIC ^ 1]),
    st.sampled_from([1, 1, 1, 0, 2, 255]),
    st.integers(0, 16),
    st.integers(0, 255),
    st.integers(0, 12),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.one_of(
        st.integers(0, 64),
        st.sampled_from([MAX_PAYLOAD - 1, MAX_PAYLOAD, MAX_PAYLOAD + 1, MAX_PAYLOAD + 12, 2**64 - 1, 2**63]),
        st.integers(0, 2**64 - 1),
    ),
)


@given(headers)
def test_generated_headers_decode_alike(gn, raw):
    python, native = both(gn, raw)
    assert python == native


@given(st.binary(min_size=frames.HEADER_SIZE, max_size=frames.HEADER_SIZE), st.integers(0, 2**64 - 1))
def test_any_bytes_decode_alike_under_any_maximum(gn, raw, max_payload):
    python, native = both(gn, raw, max_payload)
    assert python == native


def test_the_security_suites_mutations_decode_alike(gn):
    mutations, compared = _mutations(random.Random(3)), 0
    for _ in range(5000):
        frame = next(mutations)
        if len(frame) >= frames.HEADER_SIZE:
            python, native = both(gn, frame[: frames.HEADER_SIZE])
            assert python == native, frame[: frames.HEADER_SIZE].hex()
            compared += 1
    assert compared > 2000


@given(
    st.integers(1, 13), st.integers(0, 255), st.integers(1, 10), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
)
def test_encoding_is_protocol_frames_encoding(gn, ftype, flags, dtype, sender, key):
    kw = {"flags": flags, "dtype": dtype, "epoch": 7, "sender": sender, "key": key, "round": 9, "status": 3}
    assert gn.encode_header(ftype, 1234, **kw) == frames.encode_header(ftype, 1234, **kw)


def test_a_header_of_the_wrong_size_is_refused(gn):
    with pytest.raises(ValueError, match="40 bytes, not 39"):
        gn.decode_header(bytes(39), MAX_PAYLOAD)


def test_junk_at_a_native_link_is_refused_never_a_crash(gn):
    """Each mutation, then the end of the stream, at a native server's link: a protocol error (a header that does
    not validate, a frame it does not hold) or a closed link (a frame cut short), whichever applies; nothing else."""
    mutations, outcomes = _mutations(random.Random(4)), {}
    shape = gn.FloorShape(1 << 16, 1 << 14, 1, 4)
    for _ in range(1500):
        ours, theirs = socket.socketpair()
        with ours, theirs:
            theirs.sendall(next(mutations))
            theirs.shutdown(socket.SHUT_WR)
            with pytest.raises((ValueError, ConnectionError)) as refused:
                gn.floor_serve([ours.fileno()], shape, 0, 1, 1)
            outcomes[refused.type.__name__] = outcomes.get(refused.type.__name__, 0) + 1
    assert set(outcomes) == {"ValueError", "ConnectionError"}, outcomes


def test_a_refused_header_names_what_was_wrong(gn):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(struct.pack("<I", 0xDEADBEEF) + bytes(36))
        with pytest.raises(ValueError, match="bad magic 0xdeadbeef"):
            gn.floor_serve([ours.fileno()], gn.FloorShape(1 << 16, 1 << 14, 1, 4), 0, 1, 1)
