"""The scheduler's placement weights from the nodes it has (scheduler/placing.py)."""

import pytest

from gradwire import split
from gradwire.scheduler.node import Node
from gradwire.scheduler.placing import placement_weights


def _node(role, rank, host_id, colocated=False, rate=0.0):
    node = Node(None, role, rank, "h", 0, host_id=host_id, colocated=colocated, link_rate=rate)  # type: ignore[arg-type]
    node.rank = rank
    return node


def _cluster(n, k, worker_rate=0.0, server_rate=0.0):
    workers = [_node("worker", i, f"host{i}", rate=worker_rate) for i in range(n)]
    servers = [_node("server", j, f"server{j}", rate=server_rate) for j in range(k)]
    servers += [_node("server", k + i, f"host{i}", colocated=True, rate=worker_rate) for i in range(n)]
    return workers, servers


@pytest.mark.parametrize(("n", "k"), [(4, 0), (4, 2), (4, 4), (8, 2)])
def test_equal_rates_give_bytepss_split(n, k):
    weights, info = placement_weights("model", *_cluster(n, k))
    fraction, _ = split.closed_form(n, k)
    assert sum(weights[:k]) == pytest.approx(fraction) and info["dedicated_fraction"] == pytest.approx(fraction)
    assert info["colocated"] == [False] * k + [True] * n


def test_slow_dedicated_servers_get_less_and_the_model_beats_both_pure_choices():
    mbit = 1e6 / 8
    weights, info = placement_weights("model", *_cluster(4, 4, 100 * mbit, 25 * mbit))
    assert 0 < info["dedicated_fraction"] < split.closed_form(4, 4)[0]
    best = split.optimal(1.0, [100 * mbit] * 4, [25 * mbit] * 4)
    assert best.seconds < split.ring_seconds(1.0, [100 * mbit] * 4)
    assert best.seconds < split.service_seconds(1.0, [100 * mbit] * 4, [25 * mbit] * 4)


def test_two_workers_on_one_host_count_as_one_host_and_equal_mode_ignores_the_model():
    workers = [_node("worker", 0, "a"), _node("worker", 1, "a"), _node("worker", 2, "b")]
    servers = [
        _node("server", 0, "s0"),
        _node("server", 1, "a", colocated=True),
        _node("server", 2, "b", colocated=True),
    ]
    weights, info = placement_weights("model", workers, servers)
    assert weights[1] == pytest.approx(weights[2])  # hosts a and b, one colocated server each
    assert placement_weights("equal", workers, servers)[0] == [1.0, 1.0, 1.0]


def test_rates_count_only_when_every_node_has_one():
    workers, servers = _cluster(4, 2, worker_rate=100.0, server_rate=25.0)
    servers[0].link_rate = 0.0  # one node did not say: all equal
    weights, info = placement_weights("model", workers, servers)
    assert info["rates_bytes_per_s"] is None
    assert info["dedicated_fraction"] == pytest.approx(split.closed_form(4, 2)[0])


def test_server_efficiency_leaves_slack_only_in_a_true_mix():
    mixed = placement_weights("model", *_cluster(4, 2), efficiency=0.8)[1]
    assert mixed["server_efficiency"] == 0.8
    assert mixed["dedicated_fraction"] == pytest.approx(0.5)  # 0.6 exactly; 0.5 with the dedicated links at 80%
    pure = placement_weights("model", *_cluster(4, 4), efficiency=0.8)[1]
    assert pure["server_efficiency"] == 1.0 and pure["dedicated_fraction"] == pytest.approx(1.0)  # k = n: the service


def test_auto_measured_rates_a_few_percent_apart_count_as_one():
    from gradwire.scheduler.placing import snap

    assert snap([12.0, 11.8, 12.2, 3.1, 3.0]) == pytest.approx([12.0, 12.0, 12.0, 3.05, 3.05])
    workers, servers = _cluster(4, 4, worker_rate=12.0e6, server_rate=11.7e6)  # k = n, measured with noise
    assert placement_weights("auto", workers, servers, efficiency=0.8)[1]["dedicated_fraction"] == pytest.approx(1.0)
