"""The data path's settings as a pure function of the links (gradwire/tuning.py)."""

import pytest

from gradwire.tuning import MAX_PARTITION, MIN_PARTITION, derive

KiB, MiB = 1 << 10, 1 << 20


def mbit(x):
    return x * 1e6 / 8


@pytest.mark.parametrize(
    "rate, rtt, partition, window",
    [
        (mbit(20), 0.0, 16 * KiB, 8),  # slow links: the smallest partitions, more of them in flight
        (mbit(50), 0.0, 16 * KiB, 8),  # what hand-tuning found at n = 8 on 50 Mbit/s
        (mbit(100), 0.0, 32 * KiB, 4),  # ... and at n = 4 on 100 Mbit/s
        (mbit(1000), 0.0, 256 * KiB, 4),
        (mbit(1000), 0.002, 256 * KiB, 4),  # 2 ms RTT: 2 x BDP = 500 KB, two 256 KiB partitions: still 4
        (mbit(1000), 0.02, 256 * KiB, 20),  # 20 ms: the window covers twice the bandwidth-delay product
        (mbit(10000), 0.0, 4 * MiB, 4),
        (2e9, 0.0, 4 * MiB, 4),  # loopback and shared memory: the default, large partitions
    ],
)
def test_settings_by_link(rate, rtt, partition, window):
    t = derive([rate] * 4, rtt)
    assert (t.partition_bytes, t.window, t.unanswered) == (partition, window, 0)
    assert MIN_PARTITION <= t.partition_bytes <= MAX_PARTITION
    assert "Mbit/s" in t.reason


def test_a_20_mbit_link_gets_much_smaller_partitions_than_loopback():
    assert derive([mbit(20)] * 2).partition_bytes * 64 <= derive([3e9] * 2).partition_bytes


def test_unknown_rates_keep_the_defaults():
    for rates in ([], [0.0, mbit(100)]):
        t = derive(rates)
        assert (t.partition_bytes, t.window, t.unanswered, t.rate_bytes_per_s) == (4 * MiB, 4, 0, 0.0)


def test_every_worker_derives_the_same_from_the_median_rate():
    assert derive([mbit(100), mbit(25), mbit(100)]).partition_bytes == 32 * KiB
    assert derive([mbit(100), mbit(25), mbit(100)]) == derive([mbit(25), mbit(100), mbit(100)])


def test_never_above_the_configured_largest_partition():
    assert derive([2e9], default_partition=1 * MiB).partition_bytes == 1 * MiB


def test_the_cap_only_where_the_servers_links_are_the_bottleneck():
    workers = [mbit(100)] * 4
    assert derive(workers, server_rates=[mbit(100)] * 4).unanswered == 0
    assert derive(workers, server_rates=[mbit(100)] * 2).unanswered == 4  # k = 2: fan-in
    assert derive(workers, server_rates=[mbit(25)] * 4).unanswered == 4  # quarter-rate servers
    assert derive([mbit(50)] * 8, server_rates=[mbit(50)] * 8).unanswered == 0
    assert "bottleneck" in derive(workers, server_rates=[mbit(100)] * 2).reason
