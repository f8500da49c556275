import random

import pytest

from gradwire import partition
from gradwire.placement import Placement


def _job(seed):
    rng = random.Random(seed)
    # 100 tensors of mixed sizes, as in a real model: many small biases, some large weights
    sizes = [rng.choice([4 << 10, 64 << 10, 1 << 20, 9 << 20, 30 << 20]) + rng.randrange(1024) * 4 for _ in range(100)]
    return sizes


@pytest.mark.parametrize("seed", range(5))
def test_100_mixed_tensors_over_4_servers_are_balanced(seed):
    placement = Placement(4)
    for size in _job(seed):
        parts = partition.split(size // 4, 4, 4 << 20)
        placement.assign([p.count * 4 for p in parts])
    assert placement.imbalance() <= 1.10


def test_placement_is_a_pure_function_of_the_declaration_sequence():
    a, b = Placement(3), Placement(3)
    sizes = _job(7)
    assert [a.assign([s]) for s in sizes] == [b.assign([s]) for s in sizes]


def test_weights_shift_bytes_to_the_faster_server():
    placement = Placement(2, weights=[3.0, 1.0])
    placement.assign([1 << 16] * 400)
    assert placement.loads[0] == pytest.approx(3 * placement.loads[1], rel=0.01)


def test_bad_weights_are_refused():
    with pytest.raises(ValueError):
        Placement(2, weights=[1.0])
    with pytest.raises(ValueError):
        Placement(2, weights=[0.0, 0.0])
    with pytest.raises(ValueError):
        Placement(2, weights=[1.0, -1.0])


def test_a_server_of_weight_zero_gets_nothing_until_it_is_the_only_one_left():
    placement = Placement(3, weights=[0.0, 1.0, 3.0])
    servers = placement.assign([100] * 40)
    assert 0 not in servers and servers.count(2) == 30 and servers.count(1) == 10
    placement.remove(1)
    placement.remove(2)
    assert placement.assign([100]) == [0]  # failover: the weightless server takes over rather than nothing
