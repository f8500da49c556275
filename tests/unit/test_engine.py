import numpy as np

from gradwire.protocol import dtypes
from gradwire.ring import Ring
from gradwire.server.engine import Engine


def _engine(replies, acks, fails):
    return Engine(
        0, Ring(4, 64), 2, lambda *a: replies.append(a), lambda s, m: fails.append(m), lambda *a: acks.append(a)
    )


def test_frames_are_checked_against_the_declaration_before_a_slot_is_taken():
    engine = _engine([], [], [])
    assert "not declared" in engine.check(7, 2, 16)
    engine.declare(7, dtypes.BY_NAME["float32"], 16)
    assert engine.check(7, 2, 16) is None
    assert "16 bytes of float32" in engine.check(7, 2, 8)
    assert "16 bytes of float32" in engine.check(7, 3, 16)
    engine.declare(7, dtypes.BY_NAME["float64"], 64)  # a redeclaration changes nothing
    assert engine.check(7, 2, 16) is None


def test_a_round_completes_with_every_worker_and_acks_the_others():
    replies, acks, fails = [], [], []
    engine = _engine(replies, acks, fails)
    engine.declare(9, dtypes.BY_NAME["float32"], 16)
    for sender, value in ((0, 1.0), (1, 2.0)):
        slot = engine.ring.slots[sender]
        slot.data = np.full(4, value, np.float32).view(np.uint8)
        slot.key, slot.round, slot.dtype, slot.length, slot.sender = 9, 1, 2, 16, sender
        engine.on_event(slot)
    assert acks == [(0, 9, 1)] and not fails
    key, rnd, dtype, payload, _ = replies[0]
    assert (key, rnd, dtype) == (9, 1, 2)
    assert list(np.frombuffer(payload, np.float32)) == [3.0] * 4
