"""Flow control of a worker's link as a pure state machine (worker/flow.py): no thread, no socket, time as numbers."""

import random

import numpy as np
import pytest

from gradwire.worker.flow import LIVENESS_SECONDS, Flow
from gradwire.worker.work import Work

_BUF = np.zeros(4, np.float32)


def _work(tensor="t", index=0, rnd=1, key=None, seed=0):
    key = key if key is not None else hash((tensor, index)) & 0xFFFF
    return Work(tensor, key, rnd, 0, _BUF, _BUF, 1, None, index, seed=seed)


def _drain(flow, now=0.0):
    taken = []
    while (work := flow.next(now)) is not None:
        taken.append(work)
    return taken


def test_higher_priority_first_then_in_the_order_queued():
    flow = Flow(window=10)
    for name, priority in (("a", 0), ("b", 5), ("c", 0), ("d", 5)):
        flow.push(_work(name), priority)
    assert [w.tensor for w in _drain(flow)] == ["b", "d", "a", "c"]


@pytest.mark.parametrize("window", [1, 2, 4])
def test_the_window_bounds_what_is_unacknowledged_and_an_ack_frees_a_place(window):
    flow = Flow(window=window)
    for i in range(6):
        flow.push(_work(index=i, key=i), 0)
    first = _drain(flow)
    assert len(first) == window and flow.in_flight == window
    assert flow.on_ack(first[0].key) == (first[0], True)
    assert flow.on_ack(first[0].key) == (first[0], False)  # a repeated ACK frees nothing more
    assert len(_drain(flow)) == 1
    assert flow.on_answer(first[0].key, 1.0) == (first[0], False) and first[0].key not in flow.pending
    assert flow.on_ack(12345) is None and flow.on_answer(12345, 1.0) is None  # not in flight


def test_seeds_pass_the_window_and_the_cap_and_are_never_in_flight():
    flow = Flow(window=1, cap=1)
    flow.push(_work(index=0, key=0), 0)
    assert _drain(flow) and flow.in_flight == 1
    flow.push(_work(index=1, key=1, seed=1), 0)
    (seed,) = _drain(flow)
    assert seed.seed and flow.in_flight == 1 and 1 not in flow.pending


@pytest.mark.parametrize("cap", [1, 2, 3, 4])
def test_the_cap_holds_later_work_and_lets_earlier_work_through_at_every_boundary(cap):
    """`cap` unanswered of round 2: more of round 2 waits; round 1's (earlier in the job-wide order) still goes."""
    flow = Flow(window=100, cap=cap)
    for i in range(cap + 2):
        flow.push(_work("late", i, rnd=2, key=100 + i), 0)
    assert len(_drain(flow)) == cap and len(flow.queued) == 2
    assert flow.capped_sends == 0
    flow.push(_work("early", 0, rnd=1, key=1), 0)
    (early,) = _drain(flow)
    assert early.tensor == "early" and flow.capped_sends == 1 and len(flow.pending) == cap + 1
    assert flow.next(0.0) is None  # round 2's still wait: the cap is full and nothing queued comes earlier
    flow.on_answer(100, 0.1)
    flow.on_answer(1, 0.1)
    assert [w.key for w in _drain(flow, 0.1)] == [100 + cap]  # one answer of round 2's: room for one more


def test_the_cap_never_holds_the_earliest_unsummed_partition_whatever_the_orders():
    """Two workers push the same keys in opposite orders, with random delays; a key's sum comes back to both once
    both pushed it. With a cap of 1 and a window of 1 every round completes, with no liveness escape."""
    rng = random.Random(7)
    for trial in range(200):
        keys = [(f"k{i}", rng.randrange(3)) for i in range(6)]  # (tensor, priority)
        flows = [Flow(window=rng.choice([1, 2, 4]), cap=rng.choice([1, 2])) for _ in range(2)]
        orders = [list(keys), list(reversed(keys))]
        pushed: dict[str, set[int]] = {name: set() for name, _ in keys}
        answered = [set(), set()]
        queued = [0, 0]
        now = 0.0
        for _ in range(10_000):
            now += rng.random() * 0.01
            rank = rng.randrange(2)
            flow = flows[rank]
            if queued[rank] < len(keys) and rng.random() < 0.5:  # hooks fire in their own order and moments
                name, priority = orders[rank][queued[rank]]
                flow.push(_work(name, 0, rnd=1, key=int(name[1:])), priority)
                queued[rank] += 1
            work = flow.next(now)
            if work is not None:
                flow.on_ack(work.key)
                pushed[work.tensor].add(rank)
            for name, who in pushed.items():  # the server answers a round once both pushed it
                if who == {0, 1}:
                    for r in (0, 1):
                        if name not in answered[r]:
                            flows[r].on_answer(int(name[1:]), now)
                            answered[r].add(name)
            if all(len(a) == len(keys) for a in answered):
                break
        assert all(len(a) == len(keys) for a in answered), f"trial {trial}: stalled with {answered}"
        assert all(f.cap_escapes == 0 for f in flows), f"trial {trial}"


def test_a_worker_that_stops_is_escaped_after_the_liveness_time_and_counted():
    """The cap full of round 2's partitions, whose sums wait on a worker that stopped: with no answer for
    LIVENESS_SECONDS one more goes, and it is counted."""
    flow = Flow(window=8, cap=1)
    flow.push(_work("g", 0, rnd=2, key=1), 0)
    flow.push(_work("g", 1, rnd=2, key=2), 0)
    assert _drain(flow, 10.0)
    assert flow.next(10.0) is None and flow.wake_at() == pytest.approx(10.0 + LIVENESS_SECONDS)
    assert flow.next(10.0 + LIVENESS_SECONDS) is None  # not past it yet
    escaped = flow.next(10.0 + LIVENESS_SECONDS + 0.001)
    assert escaped is not None and escaped.key == 2 and flow.cap_escapes == 1
    assert flow.capped_seconds == pytest.approx(LIVENESS_SECONDS + 0.001)
    assert flow.wake_at() is None  # nothing capped any more


def test_an_answer_restarts_the_liveness_time():
    flow = Flow(window=8, cap=1)
    for key in (1, 2, 3):
        flow.push(_work("g", key, rnd=2, key=key), 0)
    _drain(flow, 0.0)
    assert flow.next(0.5) is None
    flow.on_answer(1, 0.9)  # an answer: the cap has room again, key 2 goes, key 3 waits again
    assert flow.next(0.9).key == 2 and flow.next(0.9) is None
    assert flow.wake_at() == pytest.approx(0.9 + LIVENESS_SECONDS)


def test_a_retune_mid_flight_takes_effect_at_the_next_decision():
    flow = Flow(window=4)
    for i in range(10):
        flow.push(_work(index=i, key=i), 0)
    assert len(_drain(flow)) == 4
    flow.set_limits(2, 0)  # lower than what is in flight: nothing more until two are acknowledged
    flow.on_ack(0)
    assert flow.next(0.0) is None
    flow.on_ack(1)
    flow.on_ack(2)
    assert len(_drain(flow)) == 1
    flow.set_limits(8, 0)
    assert len(_drain(flow)) == 5 and flow.in_flight == 7


def test_time_with_the_window_full_is_counted_for_the_drift_check():
    flow = Flow(window=1)
    flow.push(_work(index=0, key=0), 0)
    flow.push(_work(index=1, key=1), 0)
    assert flow.next(0.0) is not None and flow.next(0.0) is None  # full from 0.0
    flow.on_ack(0)
    assert flow.next(0.25) is not None
    assert flow.full_seconds == pytest.approx(0.25)
    assert flow.next(0.5) is None and flow.full_seconds == pytest.approx(0.25)  # empty queue: not full time


def test_taking_everything_leaves_nothing_in_flight_or_queued():
    flow = Flow(window=2)
    for i in range(5):
        flow.push(_work(f"t{i % 2}", i, key=i), 0)
    sent = _drain(flow)
    assert flow.tensors() == {"t0", "t1"}
    everything = flow.take_all()
    assert everything[:2] == sent and len(everything) == 5
    assert not flow.pending and not flow.queued and flow.in_flight == 0 and not flow.tensors()
