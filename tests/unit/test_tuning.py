"""The data path's settings as a pure function of the links (gradwire/tuning.py)."""

import itertools

import pytest

from gradwire.tuning import MAX_PARTITION, MEASURED_SHARE, MIN_PARTITION, Drift, Sample, Tuning, derive

KiB, MiB = 1 << 10, 1 << 20


def mbit(x):
    return x * 1e6 / 8


@pytest.mark.parametrize(
    "rate, rtt, servers, partition, window",
    [
        (mbit(20), 0.0, 1, 16 * KiB, 8),  # slow links: the smallest partitions; one server takes the worker's 128 KiB
        (mbit(20), 0.0, 4, 16 * KiB, 2),  # ... which four share
        (mbit(50), 0.0, 8, 16 * KiB, 2),  # measured at n = k = 8 on 50 Mbit/s (tuning.py: window 8 queued 1 MiB)
        (mbit(100), 0.0, 4, 32 * KiB, 2),  # ... and at n = k = 4 on 100 Mbit/s
        (mbit(100), 0.0, 1, 32 * KiB, 4),
        (mbit(1000), 0.0, 4, 256 * KiB, 2),
        (mbit(1000), 0.002, 4, 256 * KiB, 2),  # 2 ms RTT: 2 x BDP = 500 KB, two 256 KiB partitions
        (mbit(1000), 0.02, 4, 256 * KiB, 20),  # 20 ms: the window covers twice the bandwidth-delay product
        (mbit(10000), 0.0, 4, 4 * MiB, 2),
        (2e9, 0.0, 4, 4 * MiB, 2),  # loopback and shared memory measured: large partitions
    ],
)
def test_settings_by_link(rate, rtt, servers, partition, window):
    t = derive([rate] * 4, rtt, servers=servers)
    assert (t.partition_bytes, t.window, t.unanswered) == (partition, window, 0)
    assert MIN_PARTITION <= t.partition_bytes <= MAX_PARTITION
    assert "Mbit/s" in t.reason


def test_without_a_count_of_servers_the_dedicated_ones_count():
    assert derive([mbit(50)] * 8, server_rates=[mbit(50)] * 8).window == 2
    assert derive([mbit(50)] * 8).window == 8  # one server


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


# -- the drift check (tuning.Drift) ------------------------------------------------------------------------------------


def _settings(rate, partition=32 * KiB):
    return Tuning(partition, 4, 0, rate, 0.0, "a test's")


def _at(rate, seconds=1.0, full=0.0, workers=4):
    """One interval of `workers` workers on links of `rate` bytes/s (measured as MEASURED_SHARE of it) busy `seconds`,
    the window full `full` of it."""
    return [Sample(round(rate * MEASURED_SHARE * seconds), seconds, full * seconds)] * workers


def test_noise_within_the_band_never_re_derives():
    d, model = Drift(1.0), mbit(100)
    for i, r in enumerate([1.9, 0.6, 1.5, 0.55, 1.99, 0.51] * 10):
        assert d.observe(float(i), _at(model * r, full=1.0), _settings(model)) is None


def test_three_drifted_intervals_in_a_row_re_derive_for_their_median():
    d, model = Drift(1.0), mbit(10)
    assert d.observe(0, _at(mbit(40)), _settings(model)) is None
    assert d.observe(1, [], _settings(model)) is None  # idle: neither counts nor breaks the run
    assert d.observe(2, _at(mbit(30)), _settings(model)) is None
    assert d.observe(3, _at(mbit(50)), _settings(model)) == pytest.approx(mbit(40))


def test_an_interval_back_in_the_band_starts_the_count_again():
    d, model = Drift(1.0), mbit(10)
    rates = [40, 40, 15, 40, 40]
    assert all(d.observe(i, _at(mbit(r)), _settings(model)) is None for i, r in enumerate(rates))
    assert d.observe(5, _at(mbit(40)), _settings(model)) is not None


def test_a_slower_rate_counts_only_where_the_window_was_full():
    """A slow link fills the window; a worker short of CPU does not (smaller partitions would cost it more)."""
    model = mbit(100)
    cpu_bound, slow_link = Drift(1.0), Drift(1.0)
    for i in range(10):
        assert cpu_bound.observe(i, _at(mbit(20), full=0.1), _settings(model)) is None
    assert [slow_link.observe(i, _at(mbit(20), full=0.9), _settings(model)) for i in range(3)][-1] == mbit(20)


def test_a_slower_rate_counts_only_where_the_hosts_had_cpu_to_spare():
    """A server short of CPU fills the windows too, with its host busy: smaller partitions would cost it more CPU per
    byte. Where the hosts' CPU use is unknown (no /proc/stat), the window decides alone."""
    model = mbit(100)
    busy, idle, unknown = Drift(1.0), Drift(1.0), Drift(1.0)
    for i in range(10):
        assert busy.observe(i, _at(mbit(20), full=0.9), _settings(model), host_busy=0.95) is None
    assert [idle.observe(i, _at(mbit(20), full=0.9), _settings(model), host_busy=0.3) for i in range(3)][-1] == mbit(20)
    assert [unknown.observe(i, _at(mbit(20), full=0.9), _settings(model)) for i in range(3)][-1] == mbit(20)
    assert busy.last["host_cpu_busy_share"] == 0.95


def test_a_faster_rate_counts_whatever_the_hosts_cpu():
    d, model = Drift(1.0), mbit(10)
    assert [d.observe(i, _at(mbit(100)), _settings(model), host_busy=0.99) for i in range(3)][-1] == mbit(100)


def test_nothing_moves_past_the_partition_bounds():
    d = Drift(1.0)
    at_max = _settings(mbit(100), partition=MAX_PARTITION)
    assert all(d.observe(i, _at(mbit(1000)), at_max) is None for i in range(10))
    at_min = _settings(mbit(100), partition=MIN_PARTITION)
    assert all(d.observe(i, _at(mbit(10), full=1.0), at_min) is None for i in range(10))


def test_the_cooldown_doubles_so_the_settings_cannot_oscillate():
    """Links that swing 10x every interval, for a simulated day: each re-derivation becomes the model, and the
    cooldown doubles after each, so the settings change a logarithmic number of times."""
    d, settings, changes = Drift(1.0), _settings(mbit(100)), []
    for i in range(86_400):
        rate = mbit(1000) if (i // 3) % 2 else mbit(10)
        new = d.observe(float(i), _at(rate, full=1.0), settings)
        if new is not None:
            changes.append(i)
            settings = _settings(new)
    assert 3 <= len(changes) <= 16
    gaps = [b - a for a, b in itertools.pairwise(changes)]
    assert all(b >= 2 * a - 3 for a, b in itertools.pairwise(gaps))


# -- several workers per host ------------------------------------------------------------------------------------------


def test_a_host_s_workers_are_one_sample_of_its_link_in_their_share():
    """Four workers busy over the same second each move a quarter of a 100 Mbit/s host link: together the host's rate,
    per worker their share; the window-full time keeps its share of the busy time."""
    quarter = Sample(round(mbit(25)), 1.0, 0.5)
    host = Sample.of_host([quarter] * 4)
    assert host.rate == pytest.approx(mbit(25)) and host.sharers == 4
    assert host.bytes == 4 * quarter.bytes and host.full_seconds == pytest.approx(0.5)
    staggered = Sample.of_host([Sample(round(mbit(25)), 1.0, 1.0), Sample(round(mbit(25) / 2), 0.5, 0.0)])
    assert staggered.busy_seconds == 1.0 and staggered.full_seconds == pytest.approx(2 / 3)
    assert Sample.of_host([]).rate == 0.0


def test_four_workers_sharing_a_host_link_are_no_drift():
    """The settings for four workers on each 100 Mbit/s host are derived for their share (25 Mbit/s): the host's
    samples, in that share, stay in the band. Judged by itself against the host's rate, each worker would look four
    times slower than its link, and the job would re-cut itself mid-step."""
    share = derive([mbit(25)] * 8)
    d = Drift(1.0)
    host = Sample.of_host(_at(mbit(25), full=1.0, workers=4))
    assert all(d.observe(float(i), [host, host], share) is None for i in range(10))
    alone = Drift(1.0)  # the old judgement: each worker against the host's rate
    verdicts = [alone.observe(float(i), _at(mbit(25), full=1.0, workers=8), _settings(mbit(100))) for i in range(3)]
    assert verdicts[-1] is not None
