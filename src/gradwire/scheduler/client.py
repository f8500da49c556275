"""Joining a job: what every server and worker does first, against the scheduler."""

from __future__ import annotations

from gradwire.config import Config
from gradwire.errors import GradwireTimeout, JobAborted
from gradwire.protocol import messages
from gradwire.protocol.frames import FrameType
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
        _, book = conn.recv_json(FrameType.CONTROL)
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
