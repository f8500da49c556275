"""The native per-partition rule (native/cpp/flow.hpp) against worker/flow.py's `Flow` and worker/credit.py's `Credit`:
the same event sequences, made by hypothesis, fed to both, give the same decisions (which partition goes, when to wake),
the same answers to acknowledgements and sums, and the same counters, step by step."""

from __future__ import annotations

import types
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from gradwire.worker import credit as credits
from gradwire.worker.credit import Credit
from gradwire.worker.flow import Flow

TENSORS = ["a", "b", "é", "layer.10", "layer.9"]  # é: names compare by code point (UTF-8 bytes natively)


class Part:
    """What worker/flow.py reads of a `Work`."""

    def __init__(self, id: int, key: int, rnd: int, tensor: str, index: int, seed: bool) -> None:
        self.id, self.key, self.round, self.tensor, self.index, self.seed = id, key, rnd, tensor, index, seed
        self.acked = False
        self.order: tuple = ()


_push = st.tuples(
    st.just("push"),
    st.integers(0, len(TENSORS) - 1),
    st.integers(0, 2),  # index
    st.integers(0, 3),  # round
    st.integers(-2, 2),  # priority
    st.sampled_from([False, False, False, True]),  # a seed now and then
)
_next = st.tuples(st.just("next"), st.sampled_from([0.0, 0.01, 0.25, 0.5, 0.75, 1.0, 1.5]))  # 1.0: the liveness edge
_ack = st.tuples(st.just("ack"), st.integers(0, 20))
_answer = st.tuples(st.just("answer"), st.integers(0, 20), st.sampled_from([0.0, 0.05, 1.1]))
_kinds = {
    "push": _push,
    "next": _next,
    "ack": _ack,
    "answer": _answer,
    "limits": st.tuples(st.just("limits"), st.integers(1, 4), st.integers(0, 3)),
    "take_queued": st.tuples(st.just("take_queued")),
    "take_all": st.tuples(st.just("take_all")),
}
# mostly pushes and decisions, so that windows fill and caps hold; now and then a re-tune, and the queue or everything
# taken (a failover's hand-over)
_weights = ["push"] * 6 + ["next"] * 6 + ["ack"] * 2 + ["answer"] * 3 + ["limits", "take_queued", "take_all"]
flow_events = st.lists(st.sampled_from(_weights).flatmap(_kinds.__getitem__), min_size=10, max_size=150)


def flow_state(f) -> tuple:
    return (f.in_flight, f.full_seconds, f.capped_seconds, f.capped_sends, f.cap_escapes, f.last_answer, f.wake_at())


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 4), st.integers(0, 3), flow_events)
def test_the_flow_rule_decides_alike(gn, window, cap, events):
    ours, native = Flow(window, cap), gn.Flow(window, cap)
    now, ids = 100.0, 0
    for event in events:
        kind = event[0]
        if kind == "push":
            _, t, index, rnd, priority, seed = event
            key = t * 16 + index
            part = Part(ids, key, rnd, TENSORS[t], index, seed)
            ours.push(part, priority)
            native.push(ids, key, rnd, priority, TENSORS[t], index, seed)
            ids += 1
            got = expected = None
        elif kind == "next":
            now += event[1]
            work = ours.next(now)
            expected, got = (None if work is None else work.id), native.next(now)
        elif kind in ("ack", "answer"):
            keys = sorted(ours.pending) + [999]  # one not in flight
            key = keys[event[1] % len(keys)]
            if kind == "ack":
                taken = ours.on_ack(key)
                got = native.on_ack(key)
            else:
                now += event[2]
                taken = ours.on_answer(key, now)
                got = native.on_answer(key, now)
            expected = None if taken is None else (taken[0].id, taken[1])
        elif kind == "limits":
            ours.set_limits(event[1], event[2])
            native.set_limits(event[1], event[2])
            got = expected = None
        elif kind == "take_queued":
            expected, got = [w.id for w in ours.take_queued()], native.take_queued()
        else:
            expected, got = [w.id for w in ours.take_all()], native.take_all()
        assert got == expected, event
        assert flow_state(native) == flow_state(ours), event
        assert (native.queued, native.pending) == (len(ours.queued), len(ours.pending)), event


_dt = st.floats(0, 1)  # seconds passing before a take or a release
credit_events = st.lists(
    st.one_of(
        st.tuples(st.just("pace"), st.integers(0, 3), st.sampled_from([0.0, 0.5, 1.0, 2.5])),
        st.tuples(st.just("unpace"), st.integers(0, 3)),
        st.tuples(st.just("queue"), st.integers(-1, 3), st.integers(0, 5000)),
        st.tuples(st.just("may_send"), st.integers(-1, 3)),
        st.tuples(st.just("take"), st.integers(0, 3000), st.integers(-1, 3), st.booleans(), st.booleans(), _dt),
        st.tuples(st.just("release"), st.lists(st.integers(0, 3000), max_size=4), st.booleans(), st.booleans(), _dt),
        st.tuples(st.just("lead"), st.integers(0, 4000)),
    ),
    max_size=80,
)


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 6000), st.integers(0, 4000), credit_events)
def test_credit_and_pacing_decide_alike(gn, limit, lead, events):
    clock = [50.0]
    with mock.patch.object(credits, "time", types.SimpleNamespace(monotonic=lambda: clock[0])):
        ours, native = Credit(limit, lead), gn.Credit(limit, lead)
        for event in events:
            kind, got, expected = event[0], None, None
            if kind == "pace":
                ours.pace(event[1], event[2])
                native.pace(event[1], event[2])
            elif kind == "unpace":
                ours.unpace(event[1])
                native.unpace(event[1])
            elif kind == "queue":
                ours.queue(event[1], event[2])
                native.queue(event[1], event[2])
            elif kind == "may_send":
                expected, got = ours.may_send(event[1]), native.may_send(event[1])
            elif kind == "take":
                _, n, server, network, paced, dt = event
                clock[0] += dt
                expected = ours.take(n, server, network, paced)
                got = native.take(n, server, network, paced, clock[0])
            elif kind == "release":
                _, sizes, network, acked, dt = event
                clock[0] += dt
                ours.release_all(sizes, network, acked)
                native.release_all(sizes, network, acked, clock[0])
            else:
                ours.set_lead(event[1])
                native.set_lead(event[1])
            assert got == expected, event
            assert (native.used, native.lead, native.busy_bytes) == (ours.used, ours.lead, ours.busy_bytes), event
            assert native.busy_seconds == ours.busy_seconds and native.busy(clock[0]) == ours.busy(), event
