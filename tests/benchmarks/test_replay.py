"""The lab's profiler (benchmarks/replay.py) and `python -m benchmarks --netem --scale`'s table of the points."""

import pytest

torch = pytest.importorskip("torch")

from benchmarks import replay, scale  # noqa: E402
from gradwire import profiles  # noqa: E402


def test_a_profile_folds_layers_without_parameters_into_the_one_before():
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    table = replay.profile(net, torch.randn(2, 8), repeats=3)
    assert [t["layer"] for t in table] == ["0", "2"] and [t["elements"] for t in table] == [[128, 16], [64, 4]]
    assert all(t["forward_s"] > 0 and t["backward_s"] > 0 for t in table)


def test_the_scale_table_reads_the_default_profile():
    profile = profiles.load(profiles.BENCH_MODEL)
    layers = profiles.layers(profile)
    rows = []
    settings = {"partition_bytes": 65536, "window": 8}
    for n in (1, 2):
        for way in ("gradwire", "ddp"):
            step = scale.model_step(layers, n, "dedicated", way, "100mbit", settings, 0.01).step_s
            rows.append({"n": n, "layout": "dedicated", "way": way, "samples_per_s": 32 * n / step, "step_s": step})
            rows[-1] |= {"bound_step_s": step, "cpu_utilization": 0.5, "rate": "100mbit", "settings": settings}
    scale._predictions(rows, layers)
    scale._efficiencies(rows)
    assert rows[0]["overhead_s"] == pytest.approx(0.01)
    assert [round(r["efficiency"], 6) for r in rows if r["n"] == 1] == [1.0, 1.0]
    text = scale.table(rows, profile)
    assert "| 2 | dedicated | gradwire |" in text and "+0%" in text
