"""Where connections begin: listening sockets (TCP, and Unix sockets between processes of one host), connecting and
accepting with the mutual handshake, socket options, and the identity of a host whose Unix sockets can be reached.
What a connection then moves is transport/tcp.py's `Connection`.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

from gradwire.transport.tcp import Connection


def set_frame_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound every receive and send on `sock` to `seconds` without progress, in the kernel (SO_RCVTIMEO and
    SO_SNDTIMEO; the calls then fail with EAGAIN, which the connection reads as a timeout).

    Why not `sock.settimeout`: with a Python-level timeout, every recv and send first waits in poll(), a syscall more
    per call on the data path (3.6% of a server's and workers' CPU at 64 KiB partitions, perf, loopback TCP)."""
    sock.settimeout(None)
    seconds = max(seconds, 1e-3)
    timeval = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def configure(sock: socket.socket, buffer_bytes: int) -> None:
    """Set socket buffer sizes when configured (0 keeps the kernel's autotuning)."""
    if buffer_bytes > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def host_identity(given: str = "") -> str:
    """Names this host and network namespace: equal identities can reach each other's Unix sockets. `given`
    (GRADWIRE_HOST_ID) wins where set."""
    if given:
        return given
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""  # not Linux: never use Unix sockets
    return f"{socket.gethostname()}/{boot}/{netns}"


def listen_unix(backlog: int = 128) -> tuple[socket.socket, str]:
    """A listening Unix socket in the abstract namespace (no file to clean up); returns it and its name.

    Why: between processes of one host, a Unix socket moves bytes 20-25% faster than TCP loopback
    (measured here: 4.3-4.5 GB/s against 3.4-3.8 GB/s, 4 MiB sends), and on a 2-core machine the
    summation service is bound by exactly these kernel copies.
    """
    name = f"\0gradwire-{os.getpid()}-{os.urandom(6).hex()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(name)
    sock.listen(backlog)
    return sock, name


def listen(host: str, port: int = 0, backlog: int = 128, in_use_wait: float = 0.0) -> socket.socket:
    """A listening socket; port 0 lets the kernel pick (read it back with getsockname).

    A given port still in use is tried again for up to `in_use_wait` seconds: a process restarted at its address
    (the scheduler, scheduler/recovery.py) can find the port held for a moment by a connection that the kernel gave
    it as its own end while the port was free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    deadline = time.monotonic() + in_use_wait
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(backlog)
            return sock
        except OSError as e:
            sock.close()
            if e.errno != errno.EADDRINUSE or port == 0 or time.monotonic() >= deadline:
                raise
        except BaseException:
            sock.close()
            raise
        time.sleep(0.05)


def accept_forever(
    listener: socket.socket, done: threading.Event, serve: Callable[[socket.socket, object], None], name: str
) -> None:
    """Serve each connection `listener` accepts on a thread of its own (`name`) until `done` is set or the listener
    is closed (the scheduler's and every server's accept loop)."""
    while not done.is_set():
        try:
            sock, addr = listener.accept()
        except OSError:
            return
        threading.Thread(target=serve, args=(sock, addr), name=name, daemon=True).start()


def close_listener(sock: socket.socket) -> None:
    """Close a listening socket so that its port is free at once. A bare close() leaves the port listening while
    another thread is blocked in accept() on it (Linux keeps the socket until that call returns): shutdown() first
    wakes that thread."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected (some kernels say so for listeners): close() alone then
    sock.close()


def connect(
    address: tuple[str, int] | str,
    *,
    secret: bytes,
    role: str,
    rank: int,
    max_payload: int,
    timeout: float,
    buffer_bytes: int = 0,
) -> Connection:
    """Connect (a (host, port) over TCP, or a Unix socket name) and authenticate.

    The returned connection blocks without a timeout afterwards."""
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(address)
        except OSError:
            sock.close()
            raise
        peer = "unix:" + address.lstrip("\0")
    else:
        sock = socket.create_connection(address, timeout=timeout)
        peer = f"{address[0]}:{address[1]}"
        if sock.getsockname() == sock.getpeername():
            # TCP's simultaneous open: nothing listened at the port and the kernel gave this socket the same port as
            # its own end, so it is connected to itself. Refused, as it would have been, and the port is free again.
            sock.close()
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"nothing listens at {peer} (connected to itself)")
    return _authenticated(sock, peer, True, secret, role, rank, max_payload, timeout, buffer_bytes)


def connect_node(
    node: dict, host_id: str, transport: str, *, what: str, log: logging.Logger, **options
) -> tuple[Connection, bool]:
    """Connect to a node of the address book (`host`, `port`, and where it listens on one, `unix` and `host_id`):
    by its Unix socket when it is on this host and network namespace (`host_id` equal) and GRADWIRE_TRANSPORT allows
    (auto or unix), else, or if that fails, by TCP. Returns the connection and whether it is the Unix socket.
    `options` are connect()'s."""
    local = bool(node.get("unix")) and bool(node.get("host_id")) and node["host_id"] == host_id
    if transport in ("auto", "unix") and local:
        try:
            return connect(node["unix"], **options), True
        except OSError as e:
            log.info("Unix socket to %s at %s failed (%s); using TCP", what, node.get("host"), e)
    return connect((node["host"], int(node["port"])), **options), False


def accept(
    listener: socket.socket,
    *,
    secret: bytes,
    role: str,
    rank: int,
    max_payload: int,
    timeout: float,
    buffer_bytes: int = 0,
) -> Connection:
    """Accept one connection and authenticate it. Raises on a failed handshake (the socket is closed)."""
    sock, addr = listener.accept()
    return _authenticated(sock, f"{addr[0]}:{addr[1]}", False, secret, role, rank, max_payload, timeout, buffer_bytes)


def _authenticated(
    sock: socket.socket,
    peer: str,
    initiator: bool,
    secret: bytes,
    role: str,
    rank: int,
    max_payload: int,
    timeout: float,
    buffer_bytes: int,
) -> Connection:
    """`sock` (connected or accepted) as a connection, once the mutual handshake has passed; closed if it did not.
    The handshake has `timeout` (a silent peer cannot hold an accept loop past it); the connection then blocks
    without one."""
    configure(sock, buffer_bytes)
    sock.settimeout(timeout)
    conn = Connection(sock, max_payload, peer=peer)
    try:
        conn.handshake(secret, role, rank, initiator=initiator)
    except BaseException:
        conn.close()
        raise
    sock.settimeout(None)
    return conn
