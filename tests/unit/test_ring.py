import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradwire.errors import GradwireTimeout
from gradwire.protocol import frames
from gradwire.ring import Ring, RingClosed
from gradwire.server.slot import DEPARTED_EVENT, JOIN_EVENT


class _Event:
    """What these tests keep in a slot: the ring is generic over its event (the server's is server/slot.py's)."""

    def __init__(self, buffer: memoryview, array: object) -> None:
        self.buffer, self.array, self.key = buffer, array, 0


def test_slots_are_preallocated_views_of_one_buffer():
    ring = Ring(4, 16, _Event)
    assert [len(s.buffer) for s in ring.slots] == [16] * 4
    ring.slots[0].buffer[:] = b"\x01" * 16
    ring.slots[1].buffer[0] = 7
    assert bytes(ring.slots[0].buffer) == b"\x01" * 16 and ring.slots[1].buffer[0] == 7


def test_wrap_around_reuses_slots_in_order():
    ring = Ring(3, 8, _Event)
    seen = []
    for seq in range(10):
        assert ring.claim(timeout=1) == seq
        ring.slot(seq).key = seq
        ring.publish(seq)
        assert ring.wait(seq - 1, timeout=1) == seq
        seen.append(ring.slot(seq).key)
        ring.release(seq)
    assert seen == list(range(10))
    assert ring.slot(9) is ring.slots[0]


def test_full_ring_is_backpressure():
    ring = Ring(2, 8, _Event)
    for _ in range(2):
        ring.publish(ring.claim())
    with pytest.raises(GradwireTimeout):
        ring.claim(timeout=0.05)
    ring.release(0)
    assert ring.claim(timeout=1) == 2


def test_a_full_ring_says_no_without_waiting_and_tells_once_it_has_room():
    """`try_claim` is for the server's link loop, which must never block: None while full, and `on_space` called at
    the next release (once), so the loop takes the waiting push up again; `close` calls it too (a retry raises)."""
    ring = Ring(2, 8, _Event)
    told = []
    ring.on_space = lambda: told.append(ring.occupancy)
    a, b = ring.try_claim(), ring.try_claim()
    assert (a, b) == (0, 1)
    ring.release(-1)
    assert told == []  # nobody found it full yet: no call per release
    assert ring.try_claim() is None
    ring.publish(a)
    ring.publish(b)
    assert ring.cursor == 1  # read without waiting
    ring.release(0)
    assert told == [1] and ring.try_claim() == 2
    ring.release(1)
    assert told == [1]
    assert ring.try_claim() == 3 and ring.try_claim() is None
    ring.close()
    assert len(told) == 2
    with pytest.raises(RingClosed):
        ring.try_claim()


def test_a_publish_tells_a_consumer_that_does_not_wait():
    ring = Ring(4, 8, _Event)
    published = []
    ring.on_publish = lambda: published.append(ring.cursor)
    a, b = ring.claim(), ring.claim()
    ring.publish(b)
    ring.publish(a)
    assert published == [-1, 1]  # told after each publish; the cursor moves only over a contiguous prefix


def test_consumer_sees_only_a_contiguous_prefix():
    ring = Ring(4, 8, _Event)
    a, b = ring.claim(), ring.claim()
    ring.publish(b)  # out of order: b before a
    with pytest.raises(GradwireTimeout):
        ring.wait(-1, timeout=0.05)
    ring.publish(a)
    assert ring.wait(-1, timeout=1) == 1


def test_close_wakes_blocked_producers_and_consumers():
    ring = Ring(1, 8, _Event)
    ring.publish(ring.claim())
    errors = []

    def blocked():
        try:
            ring.claim()
        except RingClosed as e:
            errors.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    ring.close()
    t.join(2)
    assert errors and not t.is_alive()


@settings(deadline=None, max_examples=30)
@given(capacity=st.integers(1, 8), producers=st.integers(1, 4), per_producer=st.integers(1, 40))
def test_every_published_event_is_consumed_exactly_once(capacity, producers, per_producer):
    ring = Ring(capacity, 8, _Event)
    total = producers * per_producer
    consumed = []

    def produce(pid):
        for i in range(per_producer):
            seq = ring.claim(timeout=5)
            ring.slot(seq).key = pid * 1000 + i
            ring.publish(seq)

    def consume():
        nxt = 0
        while nxt < total:
            hi = ring.wait(nxt - 1, timeout=5)
            consumed.extend(ring.slot(s).key for s in range(nxt, hi + 1))
            ring.release(hi)
            nxt = hi + 1

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    consumer = threading.Thread(target=consume)
    for t in [consumer, *threads]:
        t.start()
    for t in [consumer, *threads]:
        t.join(10)
    assert sorted(consumed) == sorted(p * 1000 + i for p in range(producers) for i in range(per_producer))
    for p in range(producers):  # each producer's events stay in its own order
        mine = [k for k in consumed if k // 1000 == p]
        assert mine == sorted(mine)
    assert ring.occupancy == 0


def test_a_ring_events_flags_are_none_of_the_wires():
    """A slot's flags carry its frame's or a ring event's: no bit of protocol/frames.py's may be an event's, else a
    worker's frame could pass for a membership change."""
    wire = frames.SHM_PAYLOAD | frames.SEED | frames.REPLICA | frames.REPLAY | frames.HELD | frames.AVERAGED
    assert not wire & (JOIN_EVENT | DEPARTED_EVENT) and JOIN_EVENT != DEPARTED_EVENT
