"""A worker's requests to the scheduler (worker/control.py)."""

from gradwire.protocol import messages
from gradwire.worker.control import Pending


def test_a_request_is_answered_or_cancelled_once_and_tells_its_callback():
    told = []
    answered, cancelled = Pending(messages.Barrier(id=1), told.append), Pending(messages.Barrier(id=2), told.append)
    assert not answered.wait(0.01)
    answered.answer({"op": "reply", "id": 1})
    cancelled.cancel()
    assert answered.wait(0) and answered.reply == {"op": "reply", "id": 1}
    assert cancelled.wait(0) and cancelled.reply is None
    assert told == [{"op": "reply", "id": 1}, None]
