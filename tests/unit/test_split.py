import json

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


def test_plan_prints_measured_times_beside_the_model(tmp_path, capsys):
    from gradwire.launch.cli import main

    common = {"workers": 4, "worker_rate_bps": 1e8, "server_rate_bps": 1e8, "bytes": 16 << 20}
    rows = [
        common | {"system": "gloo", "servers": 0, "seconds_median": 2.14},
        common | {"system": "gradwire", "servers": 2, "colocated": True, "seconds_median": 1.89},
        common | {"system": "gradwire", "servers": 2, "colocated": False, "seconds_median": 2.9},
        common | {"system": "gradwire", "servers": 2, "colocated": True, "seconds_median": 9.9, "workers": 8},
    ]
    runs = tmp_path / "runs.jsonl"
    runs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plan", "-n", "4", "-k", "2", "--size", "16", "--measured", str(runs)]) == 0
    lines = {line.split("  ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["ring all-reduce"].split()[-2:] == ["2.140", "1.06"]  # measured, x model (2.013 s)
    assert lines["gradwire's mix (optimal)"].split()[-2] == "1.890"
    assert lines["dedicated servers only"].split()[-2] == "2.900"
    assert "measured" not in lines["colocated servers only"] and len(lines["colocated servers only"].split()) == 7


@pytest.mark.parametrize(("n", "k"), [(4, 0), (4, 2), (4, 4), (8, 3)])
def test_server_weights_give_the_closed_form_split_for_equal_rates(n, k):
    servers = [(None, 1.0)] * k + [(i, 1.0) for i in range(n)]  # k dedicated, then one colocated per worker host
    weights, best = split.server_weights([1.0] * n, servers)
    fraction, _ = split.closed_form(n, k)
    assert sum(weights[:k]) == pytest.approx(fraction, abs=1e-6)
    assert sum(weights) == pytest.approx(1.0)
    assert len(set(round(w, 9) for w in weights[:k])) <= 1 and len(set(round(w, 9) for w in weights[k:])) == 1


def test_server_weights_share_a_host_among_its_colocated_servers_and_skip_hosts_without_one():
    # host 0 runs two colocated servers, host 1 none, host 2 one; one dedicated server
    weights, best = split.server_weights([1.0, 1.0, 1.0], [(0, 1.0), (0, 1.0), (2, 1.0), (None, 1.0)])
    assert weights[0] == pytest.approx(weights[1]) and best.colocated[1] == 0.0
    assert sum(weights) == pytest.approx(1.0)


def test_without_colocated_servers_bytes_follow_the_server_rates():
    weights, best = split.server_weights([1.0] * 4, [(None, 1.0), (None, 3.0)])
    assert weights == pytest.approx([0.25, 0.75])
