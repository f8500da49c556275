"""A worker's tensors and the versions a re-cut makes of them (worker/tensors.py), without a cluster."""

import threading

import pytest

from gradwire import partition
from gradwire.errors import GradwireTimeout, RemoteProtocolError
from gradwire.protocol import dtypes
from gradwire.protocol.signature import Signature
from gradwire.worker.recut import Recutting
from gradwire.worker.tensors import Tensor

F32 = dtypes.BY_NAME["float32"]


def _tensor(name, elements, rnd, partition_bytes=4096):
    t = Tensor(name, (elements,), F32, round=rnd, root=name)
    t.parts = partition.split(elements, 4, partition_bytes)
    t.signature = Signature("sum", "float32", (elements,), None, None, None)
    t.ready.set()
    return t


def test_step_1_reports_each_tensors_round_and_holds_calls_two_rounds_past_it():
    lock = threading.Lock()
    recut = Recutting(lock)
    tensors = {"a": _tensor("a", 100_000, 3), "b": _tensor("b", 100_000, 7)}
    with lock:
        assert recut.hold(list(tensors.values()), number=5) == {"a": 3, "b": 7}
    assert recut.holds == {"a": 5, "b": 9} and recut.number == 5


def test_step_2_gives_a_successor_from_the_round_chosen_and_releases_the_holds():
    lock = threading.Lock()
    recut = Recutting(lock)
    tensors = {"a": _tensor("a", 100_000, 3)}
    with lock:
        recut.hold(list(tensors.values()), number=1)
        (new,) = recut.cut(tensors, {"a": 5}, 1, 1024, "worker 0")
    a = tensors["a"]
    assert new.name == "a~1" and new.root == "a" and new.round == 4 and tensors["a~1"] is new
    assert a.successor == (5, new) and a.chain() == [a, new] and not recut.holds
    assert a.current() is new and a.current(next_round=True) is a  # round 4 is still the old cut's
    a.round = 4
    assert a.current(next_round=True) is new
    assert recut.history[-1]["tensors"] == 1 and recut.history[-1]["partition_bytes"] == 1024


def test_a_re_cut_at_a_round_already_passed_is_the_schedulers_error():
    recut, tensors = Recutting(threading.Lock()), {"a": _tensor("a", 100_000, 6)}
    with pytest.raises(RemoteProtocolError, match="worker 3: re-cut of 'a' at round 5 came too late"):
        recut.cut(tensors, {"a": 5}, 1, 1024, "worker 3")


def test_a_held_round_waits_for_the_release_and_no_longer_than_the_timeout():
    lock = threading.Lock()
    recut = Recutting(lock)
    a = _tensor("a", 100_000, 3)
    with lock:
        recut.hold([a], number=2)
        a.round = 4  # round 5 is held
        with pytest.raises(GradwireTimeout, match=r"worker 0: .* \(re-cut 2\)"):
            recut.wait_turn(a, 0.05, "worker 0")
        threading.Timer(0.05, lambda: (lock.acquire(), recut.release(), lock.release())).start()
        assert recut.wait_turn(a, 5.0, "worker 0") is a
