"""The frame decoder (protocol/decoder.py) fed bytes cut anywhere, with no socket: every frame whole and in order,
payloads into the sink's buffers, backpressure, a sink that stops, frames whose payload lies in shared memory, bad
headers, a stream that ends mid-frame. tests/native/test_decoder.py feeds the native decoder the same streams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradwire.errors import RemoteProtocolError
from gradwire.protocol import dtypes, frames
from gradwire.protocol.decoder import READ_AHEAD, FrameDecoder
from gradwire.protocol.frames import FrameType
from gradwire.transport.tcp import PeerClosed

MAX_PAYLOAD = 1 << 20
FLOAT32 = dtypes.BY_NAME["float32"].code


class Recorder:
    """A sink that records what it is told: each header as a tuple of ints and each payload's bytes. The frames
    numbered in `refuse` are refused once ("not now") before they are taken; after `stop_after` frames it expects
    nothing more."""

    def __init__(self, refuse: frozenset[int] = frozenset(), stop_after: int | None = None) -> None:
        self.events: list[tuple] = []
        self.refuse = set(refuse)
        self.stop_after = stop_after
        self.frames = 0

    @property
    def expecting(self) -> bool:
        return self.stop_after is None or self.frames < self.stop_after

    def destination(self, header):
        if self.frames in self.refuse:
            self.refuse.discard(self.frames)
            return None
        self.events.append(("header", tuple(int(x) for x in header)))
        return np.zeros(header[8] + 3, np.uint8)  # larger than asked: only the payload's bytes are filled

    def arrived(self, header, data) -> None:
        self.frames += 1
        self.events.append(("payload", bytes(np.asarray(data)[: frames.wire_length(frames.Header(*header))])))


def chunked(data: bytes, chunk: int, end: bool):
    """A decoder's source over `data`: at most `chunk` bytes a receive; past the end, nothing now (or, with `end`, the
    peer closed); `taken()` says how many it gave."""
    at = 0

    def source(buffers: list[memoryview]) -> int:
        nonlocal at
        if at == len(data):
            if end:
                raise PeerClosed("the peer closed the connection")
            return 0
        got = 0
        for buf in buffers:
            take = min(len(buf), len(data) - at, chunk - got)
            buf[:take] = data[at : at + take]
            at, got = at + take, got + take
            if take < len(buf):
                break
        return got

    source.taken = lambda: at  # type: ignore[attr-defined]
    return source


def python_events(data: bytes, chunk: int, refuse=frozenset(), end=False, stop_after=None) -> list[tuple]:
    """Every event the Python decoder gives for `data` received `chunk` bytes at a time, a refused frame asked for
    again by the next receive; ends with ("error", kind, message) where it raised."""
    decoder, sink = FrameDecoder(MAX_PAYLOAD), Recorder(refuse, stop_after)
    source = chunked(data, chunk, end)
    try:
        for _ in range(len(data) + len(refuse) + 2):
            decoder.receive(source, sink)
    except RemoteProtocolError as e:
        kind = "closed" if isinstance(e, PeerClosed) else "protocol"
        sink.events.append(("error", kind, "" if kind == "closed" else str(e)))
    return sink.events


def frame(ftype: int, payload: bytes = b"", **fields) -> bytes:
    return frames.encode_header(ftype, len(payload), **fields) + payload


def result(key: int, values: np.ndarray, **fields) -> bytes:
    return frame(FrameType.RESULT, values.tobytes(), dtype=FLOAT32, key=key, **fields)


def acks(*pairs: tuple[int, int]) -> bytes:
    return frames.encode_entries(FrameType.ACKS, list(pairs))


STREAM = (
    result(1, np.arange(10, dtype=np.float32), round=3)
    + acks((1, 3), (2, 3))
    + result(2, np.arange(3000, dtype=np.float32))  # past the read-ahead
    + frame(FrameType.BYE)
    + result(3, np.ones(2, np.float32))
)


@pytest.mark.parametrize("chunk", [1, 7, 40, 41, 4096, 1 << 20])
def test_frames_cut_anywhere_arrive_whole_and_in_order(chunk):
    events = python_events(STREAM, chunk)
    headers = [e[1] for e in events if e[0] == "header"]
    payloads = [e[1] for e in events if e[0] == "payload"]
    assert [(h[0], h[5], h[8]) for h in headers] == [
        (FrameType.RESULT, 1, 40),
        (FrameType.ACKS, 0, 24),
        (FrameType.RESULT, 2, 12000),
        (FrameType.BYE, 0, 0),
        (FrameType.RESULT, 3, 8),
    ]
    assert payloads[0] == np.arange(10, dtype=np.float32).tobytes()
    assert payloads[2] == np.arange(3000, dtype=np.float32).tobytes()
    assert payloads[3] == b""
    assert [e[0] for e in events] == ["header", "payload"] * 5  # each payload arrives before the next header


def test_a_payload_lands_in_the_sinks_buffer_and_what_came_ahead_of_it_is_copied_once():
    """With the whole stream in one receive, the first frame's payload is read ahead and copied; a payload larger than
    the read-ahead goes straight into its destination."""
    decoder = FrameDecoder(MAX_PAYLOAD)
    big = np.arange(READ_AHEAD, dtype=np.float32)  # 4x the read-ahead
    dest = np.zeros(big.size, np.float32)
    got = []

    class Sink:
        expecting = True

        def destination(self, header):
            return dest if header.key == 9 else np.zeros(header.length, np.uint8)

        def arrived(self, header, data):
            got.append((header.key, len(data)))

    source = chunked(result(8, np.ones(4, np.float32)) + result(9, big), 1 << 30, end=False)
    decoder.receive(source, Sink())
    assert got == [(8, 16), (9, big.nbytes)] and np.array_equal(dest, big)
    assert not decoder.mid_frame


def test_a_sink_with_no_room_keeps_the_header_until_asked_again():
    events = python_events(STREAM, 1 << 20, refuse=frozenset({0, 2}))
    assert events == python_events(STREAM, 1 << 20)
    decoder, sink = FrameDecoder(MAX_PAYLOAD), Recorder(frozenset({1}))
    decoder.receive(chunked(STREAM, 1 << 20, end=False), sink)
    assert sink.frames == 1 and decoder.mid_frame  # the second frame's header waits for its destination


def test_a_sink_that_expects_nothing_more_stops_the_reading_between_frames():
    """A link that closed (or saw a BYE) reads no further: the frames after are not taken, and the end of the stream
    past them is no error."""
    events = python_events(STREAM, 13, stop_after=2, end=True)
    assert [e[0] for e in events] == ["header", "payload"] * 2


def test_a_payload_in_shared_memory_reads_nothing_from_the_stream():
    shared = frames.encode_header(
        FrameType.RESULT, 4096, dtype=FLOAT32, key=5, flags=frames.SHM_PAYLOAD, status=7
    )  # its 4096 bytes lie in a pull slot
    events = python_events(shared + acks((5, 0)), 5)
    assert events[0][1][1] == frames.SHM_PAYLOAD and events[1] == ("payload", b"")
    assert events[2][1][0] == FrameType.ACKS and len(events[3][1]) == 12


def test_fed_bytes_are_decoded_before_the_source_is_asked():
    """What a handshake's blocking reads took ahead (`feed`) comes first, whatever its size."""
    decoder, sink = FrameDecoder(MAX_PAYLOAD), Recorder()
    decoder.feed(STREAM[:10000])
    source = chunked(STREAM[10000:], 100, end=False)
    decoder.receive(source, sink)
    assert sink.frames == 2  # the fed bytes held two frames and the start of the third
    while source.taken() < len(STREAM) - 10000:  # a receive given less than it asked for ends (the socket is empty)
        decoder.receive(source, sink)
    assert sink.events == python_events(STREAM, 1 << 20)


@pytest.mark.parametrize(
    ("junk", "message"),
    [
        (b"\0" * 40, "bad magic"),
        (frames.encode_header(99, 0), "unknown frame type 99"),
        (frames.encode_header(FrameType.RESULT, MAX_PAYLOAD + 4, dtype=FLOAT32), "exceeds the maximum"),
        (frames.encode_header(FrameType.ACKS, 13), "not a whole number of entries"),
    ],
)
def test_a_bad_header_after_good_frames_is_a_protocol_error(junk, message):
    events = python_events(acks((1, 1)) + junk, 3)
    assert [e[0] for e in events] == ["header", "payload", "error"]
    assert events[-1][1] == "protocol" and message in events[-1][2]


def test_a_stream_that_ends_is_a_closed_connection_and_a_short_destination_a_bug():
    events = python_events(STREAM[:100], 8, end=True)
    assert events[-1][:2] == ("error", "closed")

    class Short:
        expecting = True

        def destination(self, header):
            return np.zeros(1, np.uint8)

        def arrived(self, header, data): ...

    with pytest.raises(ValueError, match="a destination of 1 bytes for a payload of 40"):
        FrameDecoder(MAX_PAYLOAD).receive(chunked(STREAM, 100, end=False), Short())


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(STREAM)), st.integers(1, 5000), st.frozensets(st.integers(0, 5)))
def test_any_cut_and_any_refusals_give_the_same_frames(cut, chunk, refuse):
    decoder, sink = FrameDecoder(MAX_PAYLOAD), Recorder(refuse)
    decoder.feed(STREAM[:cut])
    source = chunked(STREAM[cut:], chunk, end=False)
    for _ in range(len(STREAM) + 10):
        decoder.receive(source, sink)
    assert sink.events == python_events(STREAM, 1 << 20)
