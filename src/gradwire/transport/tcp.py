"""Connections (TCP or Unix sockets) that move frames with `sendmsg` and `recv_into`: blocking, for a thread per
direction (servers, the scheduler, control connections), or without waiting (`*_nowait`, `send_some`), for a worker's
link loop (transport/loop.py). How connections begin is transport/endpoints.py's.

On this machine's loopback, prototypes of the data path measured (shared/MEASUREMENTS.md) blocking sockets with a
thread per connection at 0.89x gloo's throughput, the same as epoll, and far ahead of pyzmq (0.62x, a copy per
receive) and asyncio (0.57x). 75-95% of the CPU goes to kernel copies, and socket calls release the GIL, so threads
are not the limit at partition sizes of 64 KiB and up (below that they are: transport/loop.py).
`sendmsg([header, memoryview])` sends the array's own memory and `recv_into` writes straight into the destination: no
payload copy in user space on either side.

A blocking connection reads ahead as protocol/decoder.py's `FrameDecoder` does (each receive of a payload scatters past
it into a small read-ahead buffer, so the next header usually comes in the same system call); a link loop reads with a
`FrameDecoder` of its own, whose source is `recv_nowait`, and takes over what the blocking reads read ahead
(`take_read_ahead`: a handshake's replies may come with the first frames behind them).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence

from gradwire.errors import GradwireTimeout, RemoteProtocolError
from gradwire.protocol import frames
from gradwire.protocol.decoder import READ_AHEAD
from gradwire.protocol.frames import FrameType, Header
from gradwire.protocol.handshake import Handshake
from gradwire.protocol.messages import Message

MAX_PARTS = 512  # buffers handed to one sendmsg at most (Linux refuses more than IOV_MAX = 1024)


class ConnectionClosed(RemoteProtocolError):
    """The peer closed the connection (cleanly or not)."""


class PeerClosed(ConnectionClosed):
    """The peer's end closed: an end of stream, or a reset (its process closed the socket, or died), as against a
    connection that broke or went silent on the way."""


class Connection:
    """One framed TCP connection.

    Thread-safety: `send` may be called from any thread (a lock keeps frames whole); receiving is for
    one thread only. Buffers passed to `send` are owned by the caller and may be reused once it returns
    (the kernel has copied them); `recv_into` writes into the caller's buffer.
    """

    def __init__(self, sock: socket.socket, max_payload: int, peer: str = "?") -> None:
        self.sock = sock
        self.max_payload = max_payload
        self.peer = peer
        self.peer_role = "?"
        self.peer_rank = -1
        self.closed = False  # set before the socket closes: the peer may see the end only after this is set
        self._send_lock = threading.Lock()
        # read ahead (module docstring): bytes [_start, _end) of _ahead are received and not yet consumed
        self._ahead = bytearray(2 * READ_AHEAD)
        self._ahead_view = memoryview(self._ahead)
        self._start = self._end = 0
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def __repr__(self) -> str:
        return f"<Connection {self.peer_role} {self.peer_rank} at {self.peer}>"

    def segment_bytes(self) -> int | None:
        """The TCP segment size this connection settled on: its path's MTU less the headers (1448 bytes at Ethernet's
        1500, 8948 with jumbo frames), or None off TCP (a Unix socket) and once closed."""
        if self.sock.family == socket.AF_UNIX:
            return None
        try:
            return self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
        except OSError:
            return None

    # -- sending ---------------------------------------------------------------------------------

    def send(self, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        """Send the buffers (one frame, or several whole ones) contiguously. Blocks until the kernel has taken every
        byte."""
        with self._send_lock:
            _sendmsg_all(self.sock, [memoryview(p).cast("B") for p in parts])

    def send_nowait(self, parts: Sequence[bytes | bytearray | memoryview]) -> list[memoryview]:
        """Send what the socket takes of the buffers (one frame, or several whole ones) without waiting; returns the
        rest (empty: all of it went), which must be sent with `send` before any other frame. A broken connection takes
        nothing (the next `send` says)."""
        views = [memoryview(p).cast("B") for p in parts]
        with self._send_lock:
            try:
                sent = self.sock.sendmsg(views[:MAX_PARTS], [], socket.MSG_DONTWAIT)
            except OSError:  # full (EAGAIN), or broken
                sent = 0
        _advance(views, sent)
        return views

    def send_some(self, views: list[memoryview]) -> None:
        """Send what the socket takes now of `views` (whole frames, in order, cast to bytes), and drop it from the list:
        what is left must go before any other frame. For one sending thread (a worker's link loop: transport/loop.py).
        Raises ConnectionClosed."""
        try:
            sent = self.sock.sendmsg(views[:MAX_PARTS], [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as e:
            raise ConnectionClosed(f"send to {self.peer_role} {self.peer_rank} failed: {e}") from None
        _advance(views, sent)

    def send_json(self, ftype: int, body: dict, **fields: int) -> None:
        """Send a control frame with a JSON body."""
        self.send([frames.encode_json(ftype, body, **fields)])

    def send_message(self, message: Message) -> None:
        """Send a control message (protocol/messages.py)."""
        self.send([frames.encode_json(FrameType.CONTROL, message.encode())])

    # -- receiving (one thread) ------------------------------------------------------------------

    def recv_header(self, idle_ok: bool = False) -> Header:
        """Read and validate the next header. Raises ConnectionClosed or RemoteProtocolError.

        With a socket timeout set and `idle_ok`, a timeout before the first byte of a frame is idleness and the
        wait goes on; a timeout once the frame has begun raises GradwireTimeout.
        """
        size = frames.HEADER_SIZE
        while self._end - self._start < size:
            self._fill(idle_ok and self._end == self._start)
        start = self._start
        self._start = start + size
        return frames.decode_header(self._ahead_view[start : start + size], self.max_payload)

    def recv_into(self, view: memoryview) -> None:
        """Fill `view` completely: from what was read ahead, then from the socket, each receive scattering into what
        is left of `view` and, past it, into the read-ahead buffer (the next frames' headers come in the same call)."""
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self._scatter_into(view)

    # -- receiving without waiting (one thread: a link loop, transport/loop.py) ------------------------------

    def recv_nowait(self, buffers: list[memoryview]) -> int:
        """One receive into `buffers`, in order, without waiting: the bytes received (0: the socket holds none now). A
        `FrameDecoder`'s source. Raises ConnectionClosed."""
        return self._recv(buffers, False, wait=False)

    def take_read_ahead(self) -> bytes:
        """What the blocking reads received past the last frame they read (for the decoder that reads on)."""
        ahead = bytes(self._ahead_view[self._start : self._end])
        self._start = self._end = 0
        return ahead

    def _scatter_into(self, view: memoryview) -> None:
        """Fill `view`: what was read ahead first, then receives scattering into the rest of `view` and past it into
        the read-ahead buffer."""
        total = len(view)
        got = min(self._end - self._start, total)
        if got:
            view[:got] = self._ahead_view[self._start : self._start + got]
            self._start += got
        while got < total:
            self._make_room()
            n = self._recv([view[got:], self._ahead_view[self._end : self._end + READ_AHEAD]], False)
            took = min(n, total - got)
            got += took
            self._end += n - took

    def _fill(self, idle_ok: bool) -> None:
        """Receive more into the read-ahead buffer (at least one byte, at most READ_AHEAD)."""
        self._make_room()
        self._end += self._recv([self._ahead_view[self._end : self._end + READ_AHEAD]], idle_ok)

    def _make_room(self) -> None:
        """READ_AHEAD bytes free after what is read ahead and not yet consumed (less than a header: moved to the
        front where need be)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end + READ_AHEAD > len(self._ahead):
            rest = self._end - self._start
            self._ahead_view[:rest] = self._ahead_view[self._start : self._end]
            self._start, self._end = 0, rest

    def _recv(self, buffers: list[memoryview], idle_ok: bool, wait: bool = True) -> int:
        """One receive into `buffers`, in order; at least one byte. `idle_ok`: a timeout is waited through. Without
        `wait`: 0 if the socket holds nothing now."""
        while True:
            try:
                n = self.sock.recvmsg_into(buffers, 0, 0 if wait else socket.MSG_DONTWAIT)[0]
            except (TimeoutError, BlockingIOError):  # BlockingIOError: the kernel's timeout (`set_frame_timeout`)
                if not wait:
                    return 0
                if idle_ok:
                    continue
                raise GradwireTimeout(f"timed out reading from {self.peer_role} {self.peer_rank}") from None
            except ConnectionResetError as e:
                raise self._peer_closed(f"reset the connection ({e})") from None
            except OSError as e:
                raise ConnectionClosed(f"connection to {self.peer_role} {self.peer_rank} broke: {e}") from None
            if n == 0:
                raise self._peer_closed("closed the connection")
            return n

    def _peer_closed(self, how: str) -> PeerClosed:
        return PeerClosed(f"{self.peer_role} {self.peer_rank} at {self.peer} {how}")

    def recv_body(self, header: Header) -> bytes:
        """Read a control frame's body (its length was checked by `recv_header`)."""
        body = bytearray(header.length)
        self.recv_into(memoryview(body))
        return bytes(body)

    def recv_json(self, expect: FrameType | None = None) -> tuple[Header, dict]:
        """Read one control frame; with `expect`, any other type is a protocol error."""
        header = self.recv_header()
        if expect is not None and header.type != expect:
            raise RemoteProtocolError(f"expected {expect.name}, got {header.type.name} from {self.peer}")
        if header.type in frames.DATA_TYPES:
            raise RemoteProtocolError(f"expected a control frame, got {header.type.name}")
        return header, frames.decode_json(self.recv_body(header))

    # -- life cycle ------------------------------------------------------------------------------

    def handshake(self, secret: bytes, role: str, rank: int, initiator: bool) -> None:
        """Run the mutual HMAC handshake (protocol/handshake.py); sets peer_role and peer_rank."""
        hs = Handshake(secret=secret, role=role, rank=rank, initiator=initiator)
        self.send_json(FrameType.HELLO, hs.hello())
        _, hello = self.recv_json(FrameType.HELLO)
        self.send_json(FrameType.PROOF, hs.receive_hello(hello))
        _, proof = self.recv_json(FrameType.PROOF)
        hs.receive_proof(proof)
        assert hs.peer is not None
        self.peer_role, self.peer_rank = hs.peer["role"], hs.peer["rank"]

    def close(self) -> None:
        """Close the socket; a thread blocked in recv on it wakes with ConnectionClosed."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    # sendmsg may take fewer bytes than offered (signals, a full buffer with a timeout); resume there.
    while views:
        try:
            sent = sock.sendmsg(views[:MAX_PARTS])
        except (TimeoutError, BlockingIOError):
            raise GradwireTimeout("timed out sending") from None
        except OSError as e:
            raise ConnectionClosed(f"send failed: {e}") from None
        _advance(views, sent)


def _advance(views: list[memoryview], sent: int) -> None:
    """Drop the first `sent` bytes of `views` (what a send took)."""
    while views and sent >= len(views[0]):
        sent -= len(views[0])
        views.pop(0)
    if views and sent:
        views[0] = views[0][sent:]
