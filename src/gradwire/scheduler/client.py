"""Joining a job: what every server and worker does first, against the scheduler."""

from __future__ import annotations

import time

from gradwire.config import Config
from gradwire.errors import GradwireTimeout, JobAborted, RemoteProtocolError
from gradwire.protocol import messages
from gradwire.protocol.frames import MAX_CONTROL_BYTES, FrameType, decode_json, encode_header
from gradwire.scheduler import probe
from gradwire.transport import tcp


def join(config: Config, role: str, **registration: object) -> tuple[tcp.Connection, dict]:
    """Connect to the scheduler, authenticate, register, and wait for the address book.

    Blocks until every node of the job has registered (at most `config.timeout`). Returns the scheduler
    connection (kept open for control traffic) and the address book. Raises JobAborted if the job was aborted
    during rendezvous, GradwireTimeout if it never completed.
    """
    conn = tcp.connect(
        config.scheduler_address,
        secret=config.secret_bytes(),
        role=role,
        rank=config.rank or 0,
        max_payload=0,
        timeout=config.timeout,
    )
    body = {"op": messages.REGISTER, "role": role, "rank": config.rank, "host": config.host} | registration
    conn.send_json(FrameType.CONTROL, body)
    conn.sock.settimeout(config.timeout)
    try:
        book = _await_book(conn)
    except GradwireTimeout:
        conn.close()
        raise GradwireTimeout(
            f"{role}: rendezvous with the scheduler at {config.scheduler} timed out after {config.timeout}s: are all "
            f"{config.num_workers} workers and {config.num_servers} servers started?"
        ) from None
    conn.sock.settimeout(None)
    if messages.check(book) == messages.ABORT:
        conn.close()
        raise JobAborted(f"job aborted during rendezvous: {book['message']}")
    return conn, book


def _await_book(conn: tcp.Connection) -> dict:
    """Wait for the address book, answering the scheduler's link probes meanwhile (scheduler/probe.py)."""
    arrivals: list[float] = []
    scratch = bytearray(MAX_CONTROL_BYTES)
    while True:
        header = conn.recv_header()
        if header.type == FrameType.PROBE:
            conn.recv_into(memoryview(scratch)[: header.length])
            arrivals.append(time.monotonic())
            continue
        if header.type != FrameType.CONTROL:
            raise RemoteProtocolError(f"scheduler sent a {header.type.name} frame during the rendezvous")
        body = decode_json(conn.recv_body(header))
        if messages.check(body) != messages.PROBE:
            return body
        if body.get("report"):
            conn.send_json(FrameType.CONTROL, {"op": messages.PROBE_RESULT, "down": probe.rate(arrivals)})
            arrivals = []
        else:
            size = min(int(body["bytes"]), MAX_CONTROL_BYTES)
            frame, payload = encode_header(FrameType.PROBE, size), bytes(size)
            for _ in range(min(int(body["send"]), 64)):
                conn.send([frame, payload])
