import pytest

from gradwire.netem.topology import Topology, parse_rate


def test_rates():
    assert parse_rate("100mbit") == 1e8 and parse_rate("1gbit") == 1e9 and parse_rate("500kbit") == 5e5
    with pytest.raises(ValueError):
        parse_rate("100MB/s")


def test_bounds_follow_the_model():
    s = 16 << 20
    equal = Topology(workers=4, servers=4, worker_rate="100mbit", server_rate="100mbit")
    assert equal.service_bound(s) == pytest.approx(s / 12.5e6)  # S/B
    assert equal.ring_bound(s) == pytest.approx(1.5 * s / 12.5e6)  # 2(n-1)/n S/B
    slow = Topology(workers=4, servers=4, worker_rate="100mbit", server_rate="25mbit")
    assert slow.service_bound(s) == pytest.approx(4 * s / (4 * 3.125e6))  # n S / (k Bs)
    half = Topology(workers=4, servers=2, worker_rate="100mbit", server_rate="100mbit")
    assert half.service_bound(s) == pytest.approx(2 * s / 12.5e6)


def test_hosts_have_distinct_addresses_in_the_benchmark_range():
    topo = Topology(workers=8, servers=8)
    addresses = [h.address for h in topo.hosts]
    assert len(set(addresses)) == 17 and all(a.startswith("198.18.") for a in addresses)


def test_tuning_gives_more_and_smaller_partitions_in_flight_to_larger_clusters():
    small, large = Topology(workers=4, servers=4).tuning(), Topology(workers=8, servers=8).tuning()
    assert int(small["GRADWIRE_PARTITION_BYTES"]) > int(large["GRADWIRE_PARTITION_BYTES"])
    assert int(small["GRADWIRE_UNANSWERED"]) < int(large["GRADWIRE_UNANSWERED"])
