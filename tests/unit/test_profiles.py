"""Layer profiles (gradwire/profiles): the ones in the package load, and a replayed model has the profiled sizes, its
gradients ready in backward order, each after its layer's backward time."""

import time

import pytest

torch = pytest.importorskip("torch")

from gradwire import profiles  # noqa: E402

TABLE = [
    {"layer": "a", "elements": [300, 3], "forward_s": 0.01, "backward_s": 0.05},
    {"layer": "b", "elements": [50], "forward_s": 0.01, "backward_s": 0.10},
]


def test_a_replayed_model_has_the_profiled_sizes_and_times_and_fires_hooks_in_backward_order():
    net = profiles.replay_model(TABLE)
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


def test_the_profiles_in_the_package_load_as_the_step_time_models_layers():
    for path in (profiles.BENCH_MODEL, profiles.GPT_MEDIUM):
        profile = profiles.load(path)
        assert profile["layers"] and profile["device"] and profile["batch"] > 0
        layers = profiles.layers(profile, compute_scale=2.0)
        assert len(layers) == len(profile["layers"])
        first = profile["layers"][0]
        assert layers[0].nbytes == 4 * sum(first["elements"])
        assert layers[0].backward_s == pytest.approx(first["backward_s"] / 2)
