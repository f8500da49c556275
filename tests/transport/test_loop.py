"""The link loop (transport/loop.py): one thread moves every link's frames; wake-ups are never lost, a link blocked
on its socket holds no other, and a link's failure is that link's alone."""

import socket
import threading
import time

import numpy as np

from gradwire.protocol import dtypes, frames
from gradwire.protocol.frames import FrameType
from gradwire.transport import tcp
from gradwire.transport.loop import LinkLoop
from gradwire.worker.credit import Credit
from gradwire.worker.handle import Handle
from gradwire.worker.link import ServerLink
from gradwire.worker.work import Work


class _Counting:
    """A link whose state other threads change (`bump`, then the loop's `wake`) and whose pump reads it."""

    def __init__(self) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.lock = threading.Lock()
        self.value = self.seen = 0
        self.dirty = True
        self.removed = False
        self.fail_on_pump: Exception | None = None
        self.errors: list[Exception] = []

    def bump(self) -> None:
        with self.lock:
            self.value += 1
            self.dirty = True

    def fileno(self) -> int:
        return self.ours.fileno()

    def on_readable(self) -> None:
        self.ours.recv(4096)

    def needs_pump(self, now: float) -> bool:
        return self.dirty

    def pump(self, now: float) -> bool:
        self.dirty = False
        if self.fail_on_pump is not None:
            raise self.fail_on_pump
        with self.lock:
            self.seen = self.value
        return False

    def wake_at(self) -> float | None:
        return None

    def on_removed(self) -> None:
        self.removed = True
        self.ours.close()
        self.theirs.close()

    def on_error(self, error: Exception) -> None:
        self.errors.append(error)


def _until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_no_change_made_before_a_wake_up_is_missed_by_the_loop():
    """Four threads change a link's state and wake the loop 2,000 times each, racing its passes: the loop always
    sees the last change (a wake-up skipped because one was pending must find the loop not yet past its look)."""
    loop = LinkLoop("test-loop").start()
    link = _Counting()
    loop.add(link)

    def hammer() -> None:
        for _ in range(2000):
            link.bump()
            loop.wake()

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert _until(lambda: link.seen == 8000), f"the loop saw {link.seen} of 8000 changes and sleeps"
    loop.remove(link).wait(2)
    loop.stop(2)
    assert link.removed and not loop._thread.is_alive()


def test_a_link_whose_code_fails_is_failed_and_removed_and_the_loop_goes_on():
    loop = LinkLoop("test-loop").start()
    broken, healthy = _Counting(), _Counting()
    broken.fail_on_pump = IndexError("a bug")
    loop.add(broken)
    loop.add(healthy)
    assert _until(lambda: broken.removed)
    assert [type(e) for e in broken.errors] == [IndexError]
    healthy.bump()
    loop.wake()
    assert _until(lambda: healthy.seen == 1), "the loop stopped with the broken link"
    loop.stop(2)
    assert healthy.removed  # a link still in the loop when it stops is removed (its socket closed)


def test_a_link_whose_socket_closes_as_it_is_added_is_out_and_the_loop_goes_on():
    """Another thread closes a link's socket between the loop's look at it and its registration (a killed worker's
    sockets, given back by the native path): that link is out, the loop and the other links go on."""
    loop = LinkLoop("test-loop").start()
    closing, healthy = _Counting(), _Counting()
    spare = socket.socket()
    number = spare.fileno()
    spare.close()  # a number no socket has now: registering it fails as a socket closed under the loop would
    closing.fileno = lambda: number  # type: ignore[method-assign]
    loop.add(closing)
    loop.add(healthy)
    assert _until(lambda: closing.removed)
    healthy.bump()
    loop.wake()
    assert _until(lambda: healthy.seen == 1), "the loop stopped with the closed link"
    loop.stop(2)


def _work(key: int, values: np.ndarray) -> Work:
    out = np.zeros_like(values)
    handle = Handle(f"t{key}", out, 1, lambda h: None)
    return Work(f"t{key}", key, 1, dtypes.from_numpy(values.dtype).code, values, out, 1, handle)


def test_a_link_whose_server_does_not_read_holds_up_no_other_link():
    """One thread moves every link: a socket that takes no more must leave it waiting to write, not blocked in a send,
    while another link's push goes out and its answer comes back."""
    loop = LinkLoop("test-loop").start()
    credit = Credit(1 << 30)
    stuck_ours, stuck_theirs = socket.socketpair()
    live_ours, live_theirs = socket.socketpair()
    stuck = ServerLink(tcp.Connection(stuck_ours, 1 << 24), 0, 0, 1, window=4, credit=credit, loop=loop)
    live = ServerLink(tcp.Connection(live_ours, 1 << 24), 1, 0, 1, window=4, credit=credit, loop=loop)
    stuck.start()
    live.start()
    big = _work(1, np.ones(4 << 20, np.float32))  # 16 MiB: far more than the socket pair's buffers take
    stuck.submit(big, 0)
    assert _until(lambda: bool(stuck._unsent)), "the big push was not left waiting for its socket"
    small = _work(2, np.full(1000, 3.0, np.float32))
    live.submit(small, 0)
    server = tcp.Connection(live_theirs, 1 << 24)
    header = server.recv_header()
    assert header.type == FrameType.PUSHPULL and header.key == 2
    payload = np.empty(1000, np.float32)
    server.recv_into(memoryview(payload))
    answer = bytearray(frames.HEADER_SIZE)
    frames.pack_header_into(answer, FrameType.RESULT, payload.nbytes, small.dtype, 1, 0, 2, 1)
    server.send([answer, (payload * 2).tobytes()])
    assert small.handle.wait(2.0).tolist() == [6.0] * 1000
    assert not big.handle.done()
    for link in (stuck, live):
        link.close(RuntimeError("done"))
        link.join(2)
    loop.stop(2)
    stuck_theirs.close()
    live_theirs.close()


def test_a_push_short_of_credit_waits_without_spinning_the_loop_and_goes_once_credit_is_back():
    loop = LinkLoop("test-loop").start()
    ours, theirs = socket.socketpair()
    link = ServerLink(tcp.Connection(ours, 1 << 24), 0, 0, 1, window=4, credit=Credit(6000), loop=loop)
    link.start()
    first, second = _work(1, np.ones(1000, np.float32)), _work(2, np.ones(1000, np.float32))  # 4000 bytes each
    link.submit_all([first, second], 0)
    server = tcp.Connection(theirs, 1 << 24)
    payload = np.empty(1000, np.float32)
    assert server.recv_header().key == 1
    server.recv_into(memoryview(payload))
    passes = loop.passes
    time.sleep(0.5)  # past PACE_GIVE_UP_SECONDS: a timer for a pacing turn would now fire at every pass
    assert loop.passes - passes < 20 and link._waiting == [second]
    body = frames.ACK_ENTRY.pack(1, 1)
    server.send([frames.encode_header(FrameType.ACKS, len(body)), body])
    assert server.recv_header().key == 2
    link.close(RuntimeError("done"))
    link.join(2)
    loop.stop(2)
    theirs.close()
