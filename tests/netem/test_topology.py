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


def test_several_workers_per_host_share_its_link_and_its_colocated_server():
    """2 hosts x 4 workers (torchrun's --nproc-per-node layout): ranks fill hosts in order; the bounds are those of
    the hosts' links: the ring's edges cross each host's link once each way (2(n-1)/n S/B), a host's sum once (S/B)."""
    s = 16 << 20
    topo = Topology(workers=8, servers=0, colocate=True, per_host=4)
    assert [h.name for h in topo.of("worker")] == ["w0", "w1"]
    assert [(rank, h.name) for rank, h in topo.placed_workers()] == [(r, f"w{r // 4}") for r in range(8)]
    assert topo.ring_bound(s) == pytest.approx(1.75 * s / 12.5e6)
    assert topo.model_bound(s) == pytest.approx(s / 12.5e6)
    with pytest.raises(ValueError, match="do not fill hosts"):
        Topology(workers=6, servers=1, per_host=4)


def test_bench_configs_name_colocation_and_workers_per_host():
    from gradwire.bench.netem_cli import parse_configs

    a, b, c = parse_configs("8:0:100mbit:100mbit:c:x4,8:2:100mbit:100mbit:x4,4:4:100mbit:25mbit")
    assert (a.workers, a.worker_hosts, a.colocate, a.per_host) == (8, 2, True, 4)
    assert (b.servers, b.colocate, b.per_host) == (2, False, 4) and (c.per_host, c.server_rate) == (1, "25mbit")
    assert (a.mtu, b.mtu, c.mtu) == (1500, 1500, 1500)
    (d,) = parse_configs("8:0:100mbit:100mbit:c:x4:m9000")
    assert (d.colocate, d.per_host, d.mtu) == (True, 4, 9000)
    bad_ones = ("8:1:100mbit:100mbit:m9000:x4", "8:1:100mbit:100mbit:m", "8:1:100mbit:100mbit:m100000")
    for bad in ("8:0:100mbit:100mbit:x4:c", "8:1:100mbit:100mbit:xx", "6:1:100mbit:100mbit:x4", *bad_ones):
        with pytest.raises(SystemExit):
            parse_configs(bad)
