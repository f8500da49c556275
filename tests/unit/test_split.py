import pytest

from gradwire import split

B = 12.5e6  # 100 Mbit/s in bytes per second
S = 16 << 20


@pytest.mark.parametrize("n", [3, 4, 8, 16])
@pytest.mark.parametrize("k_fraction", [0.0, 0.25, 0.5, 1.0])
def test_equal_rates_reproduce_the_closed_form(n, k_fraction):
    k = int(n * k_fraction)
    fraction, units = split.closed_form(n, k)
    result = split.optimal(S, [B] * n, [B] * k)
    assert result.seconds == pytest.approx(units * S / B, rel=1e-6)
    assert result.dedicated_fraction == pytest.approx(fraction, rel=1e-6, abs=1e-9)
    assert sum(result.colocated) + sum(result.dedicated) == pytest.approx(1.0)


def test_the_extremes_are_all_reduce_and_the_pure_service():
    assert split.closed_form(4, 0)[1] == pytest.approx(1.5)  # 2(n-1)/n
    assert split.closed_form(4, 4)[1] == pytest.approx(1.0)  # S/B
    assert split.optimal(S, [B] * 4, []).seconds == pytest.approx(split.ring_seconds(S, [B] * 4))


def test_slow_dedicated_servers_get_a_small_share_and_the_mix_beats_both_pure_choices():
    workers, servers = [B] * 4, [B / 4] * 4  # servers at a quarter of the workers' rate
    result = split.optimal(S, workers, servers)
    assert result.seconds < split.ring_seconds(S, workers)
    assert result.seconds < split.service_seconds(S, workers, servers)
    assert split.service_seconds(S, workers, servers) / split.ring_seconds(S, workers) == pytest.approx(8 / 3)
    # by hand: each worker host allows y <= (t - 1)/2, each server x <= t/16 (t in units of S/B); 2(t - 1) + t/4 = 1
    assert result.seconds == pytest.approx(4 / 3 * S / B, rel=1e-6)
    assert result.dedicated_fraction == pytest.approx(1 / 3, rel=1e-6)


def test_a_slow_worker_host_gets_a_smaller_colocated_share():
    result = split.optimal(S, [B, B, B, B / 2], [B, B])
    assert result.colocated[3] < result.colocated[0]
    assert result.seconds >= S / (B / 2)  # it must still push its own bytes


def test_plan_prints_every_placement(capsys):
    from gradwire.launch.cli import main

    assert main(["plan", "-n", "4", "-k", "4", "--worker-rate", "100mbit", "--server-rate", "25mbit"]) == 0
    out = capsys.readouterr().out
    assert "ring all-reduce" in out and "2.67" in out and "0.89  33.3% dedicated" in out
