"""The native frame decoder (native/cpp/link.hpp's `Decoder`) against protocol/decoder.py's, on the same streams: the
same frames in the same order, the same payload bytes, the same refusals and stops, the same protocol errors (word for
word) and closed streams; streams made by hypothesis, cut anywhere, and the security suite's mutations."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gradwire.protocol import dtypes, frames
from gradwire.protocol.frames import FrameType
from tests.protocol.test_decoder import MAX_PAYLOAD, STREAM, Recorder, python_events
from tests.security.test_fuzz import _mutations


def native_events(gn, data: bytes, chunk: int, refuse=frozenset(), end=False, stop_after=None) -> list[tuple]:
    """`python_events`, from the native decoder."""
    decoder, sink = gn.FrameDecoder(MAX_PAYLOAD), Recorder(refuse, stop_after)
    at = 0
    try:
        for _ in range(len(data) + len(refuse) + 2):
            at += decoder.feed(data[at:], sink, chunk=chunk, end=end)
    except ValueError as e:
        sink.events.append(("error", "protocol", str(e)))
    except ConnectionError:
        sink.events.append(("error", "closed", ""))
    return sink.events


def test_the_python_decoders_stream_decodes_alike(gn):
    for chunk in (1, 7, 40, 41, 4096, 1 << 20):
        for refuse in (frozenset(), frozenset({0, 2, 4})):
            assert native_events(gn, STREAM, chunk, refuse) == python_events(STREAM, chunk, refuse)
    assert native_events(gn, STREAM, 13, stop_after=2, end=True) == python_events(STREAM, 13, stop_after=2, end=True)
    assert native_events(gn, STREAM[:100], 8, end=True) == python_events(STREAM[:100], 8, end=True)


TYPES = [FrameType.RESULT, FrameType.PUSHPULL, FrameType.ACKS, FrameType.EVERYONE, FrameType.ERROR, FrameType.BYE]


@st.composite
def streams(draw) -> bytes:
    """Whole frames of the data path's kinds: payloads of any dtype, shared-memory ones with none on the stream."""
    out = b""
    for _ in range(draw(st.integers(1, 6))):
        ftype = draw(st.sampled_from(TYPES))
        dtype = draw(st.sampled_from(sorted(dtypes.BY_CODE)))
        flags = draw(st.sampled_from([0, frames.SHM_PAYLOAD, frames.HELD | frames.AVERAGED]))
        if ftype in frames.ENTRY_TYPES:
            length = 12 * draw(st.integers(0, 5))
        elif ftype in frames.DATA_TYPES:
            length = dtypes.BY_CODE[dtype].itemsize * draw(st.integers(0, 3000))
        else:
            length = draw(st.integers(0, 300))
        fields = {"flags": flags, "dtype": dtype, "key": draw(st.integers(0, 2**64 - 1))}
        out += frames.encode_header(ftype, length, **fields, round=draw(st.integers(0, 2**32 - 1)))
        if not (ftype in frames.DATA_TYPES and flags & frames.SHM_PAYLOAD):
            out += draw(st.binary(min_size=length, max_size=length)) if length < 200 else np.random.bytes(length)
    return out


@settings(max_examples=300, deadline=None)
@given(streams(), st.integers(1, 9000), st.frozensets(st.integers(0, 6)), st.booleans())
def test_generated_streams_decode_alike(gn, data, chunk, refuse, end):
    assert native_events(gn, data, chunk, refuse, end) == python_events(data, chunk, refuse, end)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(1, 64))
def test_any_bytes_decode_alike(gn, junk, chunk):
    data = frames.encode_entries(FrameType.ACKS, [(1, 2)]) + junk
    assert native_events(gn, data, chunk, end=True) == python_events(data, chunk, end=True)


def test_the_security_suites_mutations_decode_alike(gn):
    mutations = _mutations(random.Random(5))
    for _ in range(2000):
        data = next(mutations)
        assert native_events(gn, data, 29, end=True) == python_events(data, 29, end=True)
