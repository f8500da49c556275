import threading

import numpy as np

from gradwire.errors import GradwireError
from gradwire.worker.handle import Handle


def test_the_owner_bookkeeping_runs_before_any_waiter_wakes():
    """A waiter that wakes may push the same tensor at once: the worker must have cleared it as in flight by then
    (a race seen under load as 'a push_pull of ... is already in flight')."""
    seen = []
    handle = Handle("t", np.zeros(1), 2, lambda h: seen.append(h.done()))
    handle.part_done()
    handle.part_done()
    assert seen == [False] and handle.done()


def test_it_completes_once_whatever_races_part_done_and_fail():
    for _ in range(200):
        done = []
        handle = Handle("t", np.zeros(1), 1, done.append)
        racers = [
            threading.Thread(target=handle.part_done),
            threading.Thread(target=handle.fail, args=(GradwireError("x"),)),
        ]
        for t in racers:
            t.start()
        for t in racers:
            t.join()
        assert len(done) == 1 and handle.done()
