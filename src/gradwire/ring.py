"""A Disruptor-style bounded ring of preallocated receive slots (multi-producer, single consumer).

Vocabulary (LMAX Disruptor): producers *claim* the next sequence number, fill the slot it maps to
(`seq % capacity`), and *publish* it; the consumer waits on a *barrier* for the highest contiguous
published sequence and handles the batch in order, then *releases* it so producers may reuse the slots.

- Bounded: a producer that finds every slot claimed-but-unreleased blocks in `claim` (backpressure).
  The server's memory is the ring plus the accumulators, whatever the number of rounds.
- Slots are allocated once, as views of one buffer: nothing payload-sized is allocated per message.
- Multi-producer: several connection threads claim in parallel and may publish out of order; the
  consumer only ever sees a contiguous prefix, so a batch is always in claim order.
- The wait strategy is blocking (a condition variable): with 2 cores, spinning would steal the CPU the
  kernel needs for socket copies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np

from gradwire.errors import GradwireTimeout

E = TypeVar("E")  # what a role keeps in a slot (the server's: server/slot.py)


class Ring(Generic[E]):
    """The ring: `capacity` slots of `slot_bytes` each, each an event `event(buffer, array)` makes once over its own
    memory (the Disruptor's RingBuffer<E> and its event factory: the ring knows nothing of what a slot holds).

    Thread-safety: `claim`/`publish` from any number of producer threads; `wait`/`release` from one
    consumer thread. Blocking: `claim` blocks while the ring is full, `wait` while nothing new is
    published; both take a timeout and raise GradwireTimeout, and both wake on `close`.
    """

    def __init__(self, capacity: int, slot_bytes: int, event: Callable[[memoryview, np.ndarray], E]) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._memory = np.empty(capacity * slot_bytes, dtype=np.uint8)
        view = memoryview(self._memory)
        self.slots = [
            event(view[i * slot_bytes : (i + 1) * slot_bytes], self._memory[i * slot_bytes : (i + 1) * slot_bytes])
            for i in range(capacity)
        ]
        self._published = [-1] * capacity  # the sequence last published in each slot
        self._next = 0  # next sequence to claim
        self._cursor = -1  # highest contiguous published sequence
        self._released = -1  # highest sequence the consumer has released
        self._closed = False
        self._space_wanted = False  # a `try_claim` found the ring full: tell `on_space` at the next release
        self.on_space: Callable[[], None] | None = None
        self.on_publish: Callable[[], None] | None = None  # told after each publish (a consumer that does not `wait`)
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._not_empty = threading.Condition(self._lock)

    def claim(self, timeout: float | None = None) -> int:
        """Claim the next sequence; blocks while the ring is full (backpressure)."""
        with self._lock:
            if not self._not_full.wait_for(
                lambda: self._closed or self._next - self._released <= self.capacity, timeout
            ):
                raise GradwireTimeout(f"ring full for {timeout}s: the engine is not keeping up")
            return self._next_locked()

    def try_claim(self) -> int | None:
        """Claim the next sequence, or None while the ring is full (for a thread that must not block: the server's
        link loop). After a None, `on_space` (if set) is called once slots are released."""
        with self._lock:
            if not self._closed and self._next - self._released > self.capacity:
                self._space_wanted = True
                return None
            return self._next_locked()

    def _next_locked(self) -> int:
        """(Holding the lock, with room.) The next sequence, claimed; RingClosed once closed."""
        if self._closed:
            raise RingClosed("ring closed")
        seq = self._next
        self._next += 1
        return seq

    def slot(self, seq: int) -> E:
        """The slot a claimed or published sequence maps to."""
        return self.slots[seq % self.capacity]

    def publish(self, seq: int) -> None:
        """Make a claimed, filled slot visible to the consumer."""
        with self._lock:
            self._published[seq % self.capacity] = seq
            cursor = self._cursor
            while self._published[(cursor + 1) % self.capacity] == cursor + 1:
                cursor += 1
            if cursor != self._cursor:
                self._cursor = cursor
                self._not_empty.notify()
        if self.on_publish is not None:
            self.on_publish()

    def wait(self, after: int, timeout: float | None = None) -> int:
        """Block until a sequence above `after` is published; return the highest contiguous one."""
        with self._lock:
            if not self._not_empty.wait_for(lambda: self._closed or self._cursor > after, timeout):
                raise GradwireTimeout("nothing published")
            if self._cursor <= after:
                raise RingClosed("ring closed")
            return self._cursor

    def release(self, upto: int) -> None:
        """The consumer is done with every sequence up to `upto`: their slots may be claimed again."""
        with self._lock:
            self._released = upto
            self._not_full.notify_all()
            wanted, self._space_wanted = self._space_wanted, False
        if wanted and self.on_space is not None:
            self.on_space()

    def close(self) -> None:
        """Wake every waiter; later claims and waits raise RingClosed."""
        with self._lock:
            self._closed = True
            self._not_full.notify_all()
            self._not_empty.notify_all()
            wanted, self._space_wanted = self._space_wanted, False
        if wanted and self.on_space is not None:
            self.on_space()  # its next try_claim raises RingClosed

    @property
    def cursor(self) -> int:
        """The highest contiguous published sequence, read without waiting (a consumer that polls: `Engine.inline`)."""
        return self._cursor

    @property
    def occupancy(self) -> int:
        """Slots claimed and not yet released."""
        with self._lock:
            return self._next - 1 - self._released


class RingClosed(Exception):
    """The ring was closed while a producer or the consumer waited on it."""
