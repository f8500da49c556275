"""The link loop: one thread that moves the frames of all of a process's links, both ways: a worker's links to its
servers (worker/link.py) and a server's links to its workers (server/reader.py's `Incoming`).

Why one thread: a partition's cost on the data path was its threads', not its bookkeeping's. With a sender and a
receiver thread per link, every small partition took a wake-up of a sender by a receiver and a pass of the GIL
between nine threads (docs/benchmarks.md, "The floor": one condition and wake-up per partition between two threads
doubled the cost of a bare Python worker, 2.84x of its 4 MiB cost per GB at 32 KiB against 1.65x with one thread).
Here one thread waits on every link's socket at once (`selectors`: epoll), reads whatever arrived on each without
waiting (the link's `on_readable`), and then lets each link that may act do so (`pump`: a worker's link pushes what
its acknowledgements, flow control and credit now allow, so the receiver of an acknowledgement sends the next push
itself; a server's link takes up a frame that waited for a ring slot, or gives up on one cut off too long). Sockets
stay blocking for everything else; the loop's receives and sends pass MSG_DONTWAIT.

Other threads (a call's submit, a re-tune, a failover, an engine that freed ring slots, shutdown) change a link's state
under the link's lock and `wake` the loop: one byte on a socket pair, written only when no wake-up is pending, so a
burst of them costs one. Only the loop thread touches the selector: a link joins it by `add` and leaves by `remove`,
both requests the loop carries out between its passes (at once when called from the loop itself, or when the loop is
not running). Everything a link does on the loop must not block: a link's errors end that link (it closes or is
lost), never the loop (STYLE.md: event loops never die silently; an unexpected error is logged with its link and fails
that link alone).
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

log = logging.getLogger("gradwire.transport")


class LoopLink(Protocol):
    """What the loop needs of a link (worker/link.py's `ServerLink`, server/reader.py's `Incoming`)."""

    def fileno(self) -> int: ...

    def on_readable(self) -> None: ...

    # something changed that may let it push: set by the link, by other threads (under its lock), and by the loop on a
    # writable socket; cleared as it pumps
    dirty: bool

    def pump(self, now: float) -> bool: ...  # whether it has bytes the socket did not take (wait to write)

    def needs_pump(self, now: float) -> bool: ...  # dirty, or waiting for credit, or its time has come

    def wake_at(self) -> float | None: ...  # when to pump it again with no other event, or None

    def on_removed(self) -> None: ...  # out of the loop: its socket may close

    def on_error(self, error: Exception) -> None: ...  # a bug escaped its own handlers: fail it, not the loop


class LinkLoop:
    """One process's link loop (module docstring). `add`, `remove`, `wake` and `stop` are thread-safe."""

    def __init__(self, name: str = "gw-links") -> None:
        self.name = name
        self._selector: selectors.BaseSelector | None = None  # these three from `start` on
        self._waker: socket.socket | None = None
        self._wakee: socket.socket | None = None
        self._woken = False  # a wake-up byte is pending: another would add nothing
        self._again = False  # woken from the loop's own thread: the next pass does not wait
        self._lock = threading.Lock()
        self._requests: list[tuple[Callable[[], None], threading.Event]] = []
        self._links: dict[LoopLink, bool] = {}  # link -> whether it waits to write
        self._fds: dict[LoopLink, int] = {}  # link -> its socket's descriptor (as registered: a closed socket has -1)
        self._thread: threading.Thread | None = None
        self._accepting = False  # the thread runs and takes requests
        self._stopping = False
        self.passes = 0  # the loop's passes, for tests and the curious
        # run at the end of every pass (a server's engine runs inline: server/engine.py `handle_published`)
        self.after_pass: Callable[[], None] | None = None

    @property
    def alive(self) -> bool:
        """Whether the loop's thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def on_loop(self) -> bool:
        """Whether the calling thread is the loop's."""
        return threading.current_thread() is self._thread

    def start(self) -> LinkLoop:
        with self._lock:
            if self._thread is None:
                self._selector = selectors.DefaultSelector()
                self._waker, self._wakee = socket.socketpair()
                self._waker.setblocking(False)
                self._wakee.setblocking(False)
                self._selector.register(self._wakee, selectors.EVENT_READ, None)
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._accepting = True
                self._thread.start()
        return self

    def stop(self, timeout: float) -> None:
        """End the thread (any link still in it is removed) and close the selector."""
        self._stopping = True
        self.wake()
        if self._thread is None:
            self._close()
        elif not self.on_loop():
            self._thread.join(timeout)

    def wake(self) -> None:
        """Have the loop pass over every link again soon (something changed that may let one push). On the loop's own
        thread no byte is needed: its next wait returns at once."""
        if self.on_loop():
            self._again = True
            return
        if not self._woken and self._waker is not None:
            self._woken = True
            try:
                self._waker.send(b"\0")
            except OSError:
                pass  # a full pair wakes it anyway; a closed one: the loop has stopped

    def add(self, link: LoopLink) -> None:
        """Start moving `link`'s frames."""
        self._request(lambda: self._add(link))

    def remove(self, link: LoopLink) -> threading.Event:
        """Stop moving `link`'s frames; the event is set once it is out (then `link.on_removed()` has run)."""
        return self._request(lambda: self._remove(link))

    def _request(self, action: Callable[[], None]) -> threading.Event:
        """Carry `action` out on the loop between its passes; at once on the loop itself or with no loop running."""
        done = threading.Event()
        with self._lock:
            queued = self._accepting and not self.on_loop()
            if queued:
                self._requests.append((action, done))
        if queued:
            self.wake()
        else:
            action()
            done.set()
        return done

    def _add(self, link: LoopLink) -> None:
        if link.fileno() < 0:  # closed before its turn came (a link closed while it was being added): it is out
            link.on_removed()
            return
        if link not in self._links and self._selector is not None and not self._stopping:
            self._links[link], self._fds[link] = False, link.fileno()
            try:
                self._selector.register(self._fds[link], selectors.EVENT_READ, link)
            except (ValueError, OSError):  # closed on another thread since the check above: it is out
                del self._links[link], self._fds[link]
                link.on_removed()

    def _remove(self, link: LoopLink) -> None:
        if self._links.pop(link, None) is not None:
            try:
                assert self._selector is not None
                self._selector.unregister(self._fds.pop(link))
            except (KeyError, ValueError, OSError):
                pass
        link.on_removed()

    def _apply_requests(self) -> None:
        with self._lock:
            requests, self._requests = self._requests, []
        for action, done in requests:
            try:
                action()
            finally:
                done.set()

    def _run(self) -> None:
        # averaging inf or nan into an output (Work.deliver) gives inf or nan, as in the sum (server/engine.py): no
        # warning for it (numpy's error state is the thread's own)
        np.seterr(all="ignore")
        try:
            while not self._stopping:
                self._pass()
        except Exception:  # a bug in the loop itself: say so; its links are failed by the calls' timeouts
            log.exception("the link loop failed")
            raise
        finally:
            with self._lock:
                self._accepting = False  # requests from now on are carried out by their callers
            self._apply_requests()
            self._close()

    def _close(self) -> None:
        for link in list(self._links):
            self._remove(link)
        for resource in (self._selector, self._waker, self._wakee):
            if resource is not None:
                resource.close()

    def _pass(self) -> None:
        """Wait for a socket, a wake-up or the earliest link's time; read what came; let every link push."""
        assert self._selector is not None and self._wakee is not None
        timeout = 0.0 if self._again else self._timeout()
        self._again = False
        events = self._selector.select(timeout)
        self.passes += 1
        for key, _ in events:
            if key.data is None:
                try:
                    while self._wakee.recv(4096):
                        pass
                except BlockingIOError:
                    pass
                # cleared after the pair is empty (a byte written meanwhile stays for the next select) and before the
                # links are looked at (a change a waker then skips writing for is seen below)
                self._woken = False
        self._apply_requests()
        for key, mask in events:
            link = key.data
            if link is not None and link in self._links:
                if mask & selectors.EVENT_WRITE:
                    link.dirty = True
                if mask & selectors.EVENT_READ:
                    self._guarded(link, link.on_readable)
        now = time.monotonic()
        for link, writing in list(self._links.items()):
            if link not in self._links or not link.needs_pump(now):
                continue  # removed by another link's event, or nothing to do
            wants = self._guarded(link, link.pump, now)
            if wants != writing and link in self._links:
                self._links[link] = bool(wants)
                events_wanted = selectors.EVENT_READ | (selectors.EVENT_WRITE if wants else 0)
                self._selector.modify(self._fds[link], events_wanted, link)
        if self.after_pass is not None:
            self.after_pass()

    def _guarded(self, link: LoopLink, action: Callable[..., bool | None], *args: float) -> bool | None:
        """`action(*args)`; an exception that escaped the link's own handlers is logged and fails that link alone."""
        try:
            return action(*args)
        except Exception as e:
            log.exception("the link loop: %r failed", link)
            try:
                link.on_error(e)
            finally:
                self._remove(link)
            return False

    def _timeout(self) -> float | None:
        """Until the earliest time a link asked to be pumped again, or None (wait for an event)."""
        earliest = None
        for link in self._links:
            at = link.wake_at()
            if at is not None and (earliest is None or at < earliest):
                earliest = at
        return None if earliest is None else max(0.0, earliest - time.monotonic())
