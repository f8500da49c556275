"""The frame decoder: bytes in, frames out, knowing no socket and no role (h11's `receive_data`/`next_event`, with the
payload's destination asked of the caller so that it lands where it belongs without a copy). A worker's link reads its
server's answers with it (worker/answers.py), a server its workers' pushes (server/reader.py); native/cpp/link.hpp's
`Decoder` is the same state machine in C++, and the tests feed both the same bytes.

Whoever holds the bytes is the `source`: one receive into the buffers it is handed, in order, returning how many bytes
came (0: none now; a closed stream raises). A socket is `lambda buffers: sock.recvmsg_into(buffers, 0,
MSG_DONTWAIT)[0]` (tcp.Connection.recv_nowait); a test's is a list of chunks cut anywhere. Each receive scatters into
what is left of the payload being received and, past it, into a small read-ahead buffer, so the next header (and the
whole of a frame without a payload, such as a batch of acknowledgements) usually comes in the same system call: one
call a frame in the steady state, where a header and a payload apart took two (docs/benchmarks.md, CPU per GB by
partition size). A payload still lands in its destination directly, but for the part of it that came with the previous
receive (at most READ_AHEAD bytes, copied once more).

What the bytes are for is the `sink`'s (`Sink`): for each header, validated, `destination(header)` names where its
payload goes (checking the frame and raising to refuse it), or None: not now (no room: backpressure; the header is
kept and asked for again at the next `receive`); `arrived(header, data)` follows once the payload is whole. Every frame
passes both, an empty one too (its destination is then only a yes: any buffer). Between frames the decoder stops once
`sink.expecting` is false (a link closing, a peer that said goodbye).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gradwire.protocol import frames
from gradwire.protocol.frames import Header

READ_AHEAD = 4 << 10  # bytes read ahead per receive at most (module docstring)
EMPTY = memoryview(bytearray(0))  # a destination for a frame without a payload

Source = Callable[[list[memoryview]], int]


class Sink(Protocol):
    """What a frame's bytes are for (module docstring)."""

    expecting: bool  # whether to go on reading between frames

    def destination(self, header: Header) -> memoryview | None: ...

    def arrived(self, header: Header, data: memoryview) -> None: ...


class FrameDecoder:
    """One stream's frames, decoded as its bytes come (module docstring). Not thread-safe: one reader."""

    __slots__ = ("_ahead", "_end", "_got", "_header", "_into", "_start", "_view", "max_payload")

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload
        # bytes [_start, _end) of _ahead are received and not yet decoded
        self._ahead = bytearray(2 * READ_AHEAD)
        self._view = memoryview(self._ahead)
        self._start = self._end = 0
        self._header: Header | None = None  # decoded; its payload not yet whole
        self._into: memoryview | None = None  # where that payload goes, once the sink has said
        self._got = 0  # its bytes in so far

    @property
    def mid_frame(self) -> bool:
        """Whether a frame has begun and is not whole: a header waiting for its destination, a payload being received,
        or bytes of the next frame read ahead."""
        return self._header is not None or self._end > self._start

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes received by someone else (a handshake's blocking reads took them ahead), decoded before any more."""
        data = memoryview(data).cast("B")
        self._make_room(len(data))
        self._view[self._end : self._end + len(data)] = data
        self._end += len(data)

    def receive(self, source: Source, sink: Sink) -> None:
        """Decode what was fed and what `source` has now into `sink`'s frames (module docstring). Returns once the
        source is empty, the sink has no room, or it expects nothing more. Raises RemoteProtocolError for a header that
        does not validate, and what the source or the sink raises."""
        drained = False  # the source gave less than asked: no receive to learn it is empty
        while True:
            header = self._header
            if header is None:
                if self._end - self._start < frames.HEADER_SIZE:
                    if drained or not sink.expecting:
                        return
                    self._make_room(READ_AHEAD)
                    n = source([self._view[self._end : self._end + READ_AHEAD]])
                    self._end += n
                    drained = n < READ_AHEAD
                    continue
                if not sink.expecting:
                    return
                start = self._start
                self._start = start + frames.HEADER_SIZE
                header = self._header = frames.decode_header(self._view[start : self._start], self.max_payload)
            into = self._into
            if into is None:
                named = sink.destination(header)
                if named is None:
                    return  # no room: asked again at the next receive
                into = self._into = self._destination(header, named)
                self._got = self._take_ahead(into)
            want = len(into) - self._got
            if want:
                if drained:
                    return
                self._make_room(READ_AHEAD)
                n = source([into[self._got :], self._view[self._end : self._end + READ_AHEAD]])
                drained = n < want + READ_AHEAD
                took = min(n, want)
                self._got += took
                self._end += n - took
                if took < want:
                    continue
            self._header = self._into = None
            sink.arrived(header, into)

    @staticmethod
    def _destination(header: Header, named: memoryview | bytearray) -> memoryview:
        """The bytes of `named` that the frame's payload on the stream fills (none for one in shared memory)."""
        wire = 0 if header.flags & frames.SHM_PAYLOAD and header.type in frames.DATA_TYPES else header.length
        into = memoryview(named).cast("B")
        if len(into) < wire:
            raise ValueError(f"a destination of {len(into)} bytes for a payload of {wire}")
        return into[:wire]

    def _take_ahead(self, into: memoryview) -> int:
        """Copy what was read ahead of `into`'s payload into it; returns how far it is filled."""
        ahead = min(self._end - self._start, len(into))
        if ahead:
            into[:ahead] = self._view[self._start : self._start + ahead]
            self._start += ahead
        return ahead

    def _make_room(self, room: int) -> None:
        """`room` bytes free after what is read ahead and not yet decoded (moved to the front, or the buffer grown,
        where need be)."""
        if self._start == self._end:
            self._start = self._end = 0
        if self._end + room <= len(self._ahead):
            return
        rest = self._end - self._start
        if rest + room > len(self._ahead):  # only `feed` asks for more than READ_AHEAD
            grown = bytearray(rest + room)
            grown[:rest] = self._view[self._start : self._end]
            self._ahead, self._view = grown, memoryview(grown)
        else:
            self._view[:rest] = self._view[self._start : self._end]
        self._start, self._end = 0, rest
