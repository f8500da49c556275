"""Joining a job: what every server and worker does first, against the scheduler."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gradwire.config import Config, split_address
from gradwire.errors import GradwireError, GradwireTimeout, JobAborted, RemoteProtocolError
from gradwire.protocol import messages
from gradwire.protocol.frames import MAX_CONTROL_BYTES, FrameType, decode_json, encode_header
from gradwire.scheduler import probe
from gradwire.transport import endpoints, tcp

log = logging.getLogger("gradwire.rendezvous")


FIRST_RETRY_SECONDS = 0.05  # the wait before the second try to reach the scheduler; doubled each time ...
MAX_RETRY_SECONDS = 2.0  # ... up to this
LOG_EVERY_SECONDS = 5.0  # how often a waiting node says what it waits for
# a node waiting for a scheduler to resume the job tries at most this far apart: the job's calls that need the
# scheduler wait for it, and a connection refused on a LAN costs nothing
MAX_RESUME_RETRY_SECONDS = 0.25


def join(
    config: Config, role: str, clock: Callable[[], float] = time.monotonic, **registration: object
) -> tuple[tcp.Connection, messages.AddressBook]:
    """Connect to the scheduler, authenticate, register, and wait for the address book.

    Any start order works: a scheduler that is not listening yet (refused, unreachable) is tried again with capped
    exponential backoff, and one whose connection drops before the book arrives (it restarted during the
    rendezvous) is joined again, until `config.timeout` from the first try; a node logs what it waits for every
    LOG_EVERY_SECONDS, not every try. Returns the scheduler connection (kept open for control traffic) and the
    address book. Raises JobAborted if the job was aborted during rendezvous, GradwireTimeout naming the address if
    the scheduler was never reached or the rendezvous never completed, AuthenticationError at once for a wrong
    secret (trying again cannot fix it).
    """
    deadline = clock() + config.timeout
    delay, last_log, tries = FIRST_RETRY_SECONDS, clock(), 0
    while True:
        tries += 1
        try:
            conn = _register(config, role, max(0.1, deadline - clock()), registration)
            book = _await(conn, config, role, deadline, clock)
        except (OSError, tcp.ConnectionClosed) as e:
            now = clock()
            if now >= deadline:
                raise GradwireTimeout(
                    f"{role}: could not join the job at the scheduler {config.scheduler} in {config.timeout:g}s "
                    f"({tries} tries; last: {e}): is the scheduler running there, and GRADWIRE_SCHEDULER right?"
                ) from None
            if now - last_log >= LOG_EVERY_SECONDS:
                log.warning("%s: waiting for the scheduler at %s (%s); trying again", role, config.scheduler, e)
                last_log = now
            time.sleep(min(delay, deadline - now))  # the last try comes at the deadline
            delay = min(MAX_RETRY_SECONDS, delay * 2)
            continue
        if isinstance(book, messages.Abort):
            conn.close()
            raise JobAborted(f"job aborted during rendezvous: {book.message}")
        if not isinstance(book, messages.AddressBook):
            conn.close()
            raise RemoteProtocolError(f"the scheduler sent {book.op!r} before the address book")
        return conn, book


def _register(config: Config, role: str, timeout: float, registration: dict) -> tcp.Connection:
    conn = endpoints.connect(
        config.scheduler_address,
        secret=config.secret_bytes(),
        role=role,
        rank=config.rank or 0,
        max_payload=0,
        timeout=min(timeout, config.handshake_timeout),
    )
    body = messages.Register(role=role, rank=config.rank, host=config.host, **registration)  # type: ignore[arg-type]
    try:
        conn.send_message(body)
    except BaseException:
        conn.close()
        raise
    return conn


def _await(
    conn: tcp.Connection, config: Config, role: str, deadline: float, clock: Callable[[], float]
) -> messages.Message:
    conn.sock.settimeout(max(0.1, deadline - clock()))
    try:
        book = _await_book(conn)
    except GradwireTimeout:
        conn.close()
        raise GradwireTimeout(
            f"{role}: rendezvous with the scheduler at {config.scheduler} timed out after {config.timeout}s: are all "
            f"{config.num_workers} workers and {config.num_servers} servers started?"
        ) from None
    except BaseException:
        conn.close()
        raise
    conn.sock.settimeout(None)
    return book


def _await_book(conn: tcp.Connection) -> messages.Message:
    """Wait for the address book, answering the scheduler's link probes (scheduler/probe.py) and beats (lease.py)
    meanwhile."""
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
        message = messages.parse(decode_json(conn.recv_body(header)))
        if isinstance(message, messages.Beat):  # a leased job's scheduler beats every node it knows, joined or not
            conn.send_message(message)
            continue
        if not isinstance(message, messages.Probe):
            return message
        if message.ping:  # the scheduler times our round trip (probe.round_trip)
            conn.send_message(messages.ProbeResult(pong=True))
        elif message.report:
            conn.send_message(messages.ProbeResult(down=probe.rate(arrivals)))
            arrivals = []
        else:
            size = min(message.bytes, MAX_CONTROL_BYTES)
            frame, payload = encode_header(FrameType.PROBE, size), bytes(size)
            for _ in range(min(message.send, 64)):
                conn.send([frame, payload])


def resume(
    config: Config,
    report: Callable[[], messages.Resume],
    term: int,
    stopped: Callable[[], bool] = lambda: False,
    lost: int = 0,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[tcp.Connection, messages.Resumed, int]:
    """After the scheduler connection dropped: reach a scheduler that starts into this running job, report
    (`report()`: RESUME), and wait until it has every node's report and answers RESUMED (scheduler/recovery.py).

    Where: the scheduler at GRADWIRE_SCHEDULER restarted, or a standby (GRADWIRE_SCHEDULER_STANDBY). The addresses are
    tried in turn from the one after `lost` (the index of the scheduler lost), so every node of the job goes to the
    same next one first; the lost one's comes last. Tried again with backoff for GRADWIRE_SCHEDULER_TIMEOUT; a
    scheduler that fails the job's secret, or answers with an older term than `term`, is not followed. Returns the
    connection, the answer and the index of the address answered. Raises JobAborted if the job was aborted,
    GradwireTimeout naming the addresses when no scheduler resumed it in time, GradwireError once `stopped()` (the node
    was stopped meanwhile)."""
    addresses = config.scheduler_addresses
    order = [(lost + 1 + i) % len(addresses) for i in range(len(addresses))]
    deadline = clock() + config.scheduler_timeout
    delay, last, tries = FIRST_RETRY_SECONDS, "", 0
    while clock() < deadline:
        _halt_if(stopped)
        at = order[tries % len(order)]
        tries += 1
        message = report()
        try:
            conn = _connect(addresses[at], config, message, min(deadline - clock(), config.handshake_timeout))
        except (OSError, GradwireError) as e:  # not listening yet, or not the job's (its secret)
            last = f"{addresses[at]}: {e}"
            if tries % len(order) == 0:  # each address tried once: wait before the next round
                time.sleep(max(0.0, min(delay, deadline - clock())))
                delay = min(MAX_RESUME_RETRY_SECONDS, delay * 2)
            continue
        _halt_if(stopped, conn)  # stopped while connecting: report nothing (a node gone must not count as reported)
        try:
            answer = _exchange(conn, message, deadline - clock())
        except (OSError, GradwireError) as e:  # it died again, or its recovery gave up on us
            last = f"{addresses[at]}: {e}"
            continue
        if refused := _refusal(conn, answer, term):
            last = refused
            log.error("%s %d: refused the scheduler at %s: %s", message.role, message.rank, addresses[at], last)
            time.sleep(max(0.0, min(delay, deadline - clock())))
            continue
        _halt_if(stopped, conn)
        return conn, answer, at
    raise _gave_up(config, tries, last)


def _gave_up(config: Config, tries: int, last: str) -> GradwireTimeout:
    return GradwireTimeout(
        f"no scheduler resumed the job at {', '.join(config.scheduler_addresses)} within GRADWIRE_SCHEDULER_TIMEOUT="
        f"{config.scheduler_timeout:g}s ({tries} tries; last: {last or 'nothing listened'})"
    )


def _halt_if(stopped: Callable[[], bool], conn: tcp.Connection | None = None) -> None:
    """GradwireError once `stopped()` (the node was stopped while it waited), closing `conn`."""
    if stopped():
        if conn is not None:
            conn.close()
        raise GradwireError("stopped while waiting for a scheduler to resume the job")


def _refusal(conn: tcp.Connection, answer: messages.Message, term: int) -> str | None:
    """Why this node does not follow the scheduler that answered (None: it follows it; the connection is closed
    otherwise); JobAborted if the answer is the job's abort."""
    if isinstance(answer, messages.Abort):
        conn.close()
        raise JobAborted(f"the job was aborted while its scheduler recovered it: {answer.message}")
    if isinstance(answer, messages.Resumed) and answer.term > term:
        return None
    conn.close()
    return f"it answered {answer.op} of term {getattr(answer, 'term', '?')} (this node knows term {term})"


def _connect(address: str, config: Config, message: messages.Resume, timeout: float) -> tcp.Connection:
    """A connection to the scheduler at `address`, authenticated as `message`'s node."""
    return endpoints.connect(
        split_address(address),
        secret=config.secret_bytes(),
        role=message.role,
        rank=max(0, message.rank),
        max_payload=0,
        timeout=max(0.1, timeout),
    )


def _exchange(conn: tcp.Connection, message: messages.Resume, timeout: float) -> messages.Message:
    """Send RESUME and wait (at most `timeout`) for the scheduler's answer; the connection is closed on failure."""
    try:
        conn.send_message(message)
        conn.sock.settimeout(max(0.1, timeout))
        answer = messages.parse(conn.recv_json(FrameType.CONTROL)[1])
        while isinstance(answer, messages.Beat):  # the lease's beats may come before the answer: answer them
            conn.send_message(answer)
            answer = messages.parse(conn.recv_json(FrameType.CONTROL)[1])
        conn.sock.settimeout(None)
    except BaseException:
        conn.close()
        raise
    return answer


class Promise:
    """A node's side of a scheduler's lease (scheduler/lease.py), in a job with standby schedulers: when it last
    answered its scheduler's beat (or joined it), and whether the scheduler's end closed the connection; what it
    reports to a standby (`report`), whose proof it is part of."""

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic) -> None:
        # past it without a word (a job with standbys), the scheduler is taken as lost
        self.silence = config.heartbeat_timeout if config.leased else None
        self.clock = clock
        self.answered_at = clock()
        self.dropped = False

    def renew(self) -> None:
        """A scheduler took this node in (its address book, or RESUMED): it counts the node from then on."""
        self.answered_at, self.dropped = self.clock(), False

    def answer(self, conn: tcp.Connection, beat: messages.Beat) -> None:
        self.answered_at = self.clock()
        conn.send_message(beat)

    def watch(self, conn: tcp.Connection) -> None:
        """Receive on `conn` for at most the silence allowed: a silent scheduler is then taken as lost."""
        if self.silence is not None:
            conn.sock.settimeout(self.silence)

    def lost(self, conn: tcp.Connection | None, error: Exception) -> None:
        """The connection to the scheduler ended with `error`: closed from the scheduler's end, or not."""
        self.dropped = isinstance(error, tcp.PeerClosed) and conn is not None and not conn.closed

    def report(self) -> dict:
        return {"dropped": self.dropped, "since_beat": round(self.clock() - self.answered_at, 3)}
