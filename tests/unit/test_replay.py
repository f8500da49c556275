"""Replayed compute (bench/replay.py): a profile's layers as a model whose gradients come in backward order, each after
its layer's backward time, with the profiled sizes; and `gradwire bench --netem --scale`'s table of the points."""

import time

import pytest

torch = pytest.importorskip("torch")

from gradwire.bench import replay, scale  # noqa: E402

TABLE = [
    {"layer": "a", "elements": [300, 3], "forward_s": 0.01, "backward_s": 0.05},
    {"layer": "b", "elements": [50], "forward_s": 0.01, "backward_s": 0.10},
]


def test_a_replayed_model_has_the_profiled_sizes_and_times_and_fires_hooks_in_backward_order():
    net = replay.replay_model(TABLE)
    assert [p.numel() for p in net.parameters()] == [300, 3, 50]
    started, ready = time.perf_counter(), {}

    def hook(i: int):
        def ready_now(_) -> None:
            ready[i] = time.perf_counter() - started

        return ready_now

    for i, p in enumerate(net.parameters()):
        p.register_post_accumulate_grad_hook(hook(i))
    loss = net(torch.zeros(4, 10)).square().sum() + 1.0
    forward = time.perf_counter() - started
    loss.backward()
    assert forward >= 0.02
    assert ready[2] < ready[0] and ready[2] < ready[1]  # layer b (the last) first
    assert ready[2] - forward >= 0.10 and ready[0] - ready[2] >= 0.05
    assert all(p.grad is not None and p.grad.shape == p.shape for p in net.parameters())


def test_a_profile_folds_layers_without_parameters_into_the_one_before():
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    table = replay.profile(net, torch.randn(2, 8), repeats=3)
    assert [t["layer"] for t in table] == ["0", "2"] and [t["elements"] for t in table] == [[128, 16], [64, 4]]
    assert all(t["forward_s"] > 0 and t["backward_s"] > 0 for t in table)


def test_the_default_profiles_are_there_and_the_scale_table_reads_them():
    for path in (replay.BENCH_MODEL, replay.GPT_MEDIUM):
        profile = replay.load(path)
        assert profile["layers"] and profile["device"] and profile["batch"] > 0
    profile = replay.load(replay.BENCH_MODEL)
    layers = replay.layers(profile)
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
