"""The step-time model (gradwire/predict.py): its limits are the closed forms it is built from."""

from functools import partial

import pytest

from gradwire import predict
from gradwire.predict import Layer

Links = partial(predict.Links, payload=1.0)  # rates as goodput: the closed forms' terms

MB = 1 << 20
B = 12.5e6  # 100 Mbit/s in bytes/s


def test_gradients_are_ready_in_backward_order_after_the_forward_pass():
    layers = [Layer(10, 0.1, 0.2), Layer(20, 0.1, 0.3), Layer(30, 0.1, 0.4)]
    assert predict.ready_times(layers) == [(pytest.approx(0.7), 30), (pytest.approx(1.0), 20), (pytest.approx(1.2), 10)]
    assert predict.compute_s(layers) == pytest.approx(1.2)


def test_ddp_buckets_take_the_first_mib_then_25_mib_in_backward_order():
    layers = [Layer(30 * MB, 0, 1.0)] + [Layer(MB // 2, 0, 0.1) for _ in range(4)]
    got = predict.buckets(layers)
    # the last layers first: 1 MiB, then up to 25 MiB or past it with the gradient that fills it (as torch's
    # _compute_bucket_assignment_by_size closes a bucket once it holds its cap)
    assert [b for _, b in got] == [MB, 31 * MB]
    assert got[0][0] == pytest.approx(0.2) and got[-1][0] == pytest.approx(1.4)


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_communication_bound_steps_are_the_closed_forms(n):
    """One big gradient, no compute: the ring takes 2(n-1)/n S/B; k = n dedicated servers S/B (plus a partition's
    pull); colocated servers only, the ring's time too (BytePS's optimum at k = 0)."""
    s, p = 64 * MB, 64 << 10
    layers = [Layer(s, 0.0, 0.0)]
    links = Links(B, B)
    ring = predict.ring_step(layers, n, links)
    assert ring.step_s == pytest.approx(2 * (n - 1) / n * s / B)
    dedicated = predict.gradwire_step(layers, n, n, links, partition=p)
    assert dedicated.step_s == pytest.approx(s / B + p / B)
    colocated = predict.gradwire_step(layers, n, 0, links, colocated=True, partition=p)
    assert colocated.step_s == pytest.approx((2 * (n - 1) / n if n > 2 else 1) * s / B + p / B, rel=1e-6)
    assert dedicated.bound_s == pytest.approx(s / B) and ring.bound_s == pytest.approx(ring.step_s)


def test_slow_dedicated_servers_bound_the_service_and_the_mix_helps():
    layers = [Layer(64 * MB, 0.0, 0.0)]
    links = Links(B, B / 4)  # servers' links a quarter of the workers'
    service = predict.gradwire_step(layers, 8, 8, links)
    mix = predict.gradwire_step(layers, 8, 8, links, colocated=True)
    assert service.bound_s == pytest.approx(64 * MB / (B / 4))  # n S over k servers at B/4
    assert mix.step_s < service.step_s and mix.step_s < predict.ring_step(layers, 8, links).step_s


def test_communication_hides_behind_the_backward_pass_where_the_links_keep_up():
    """Gradients of 1 MB each ready every 0.2 s of backward: the link (12.5 MB/s) drains each before the next, so the
    step is the compute plus the last gradient's trip; the same bytes all at the end take their full time."""
    spread = [Layer(MB, 0.0, 0.2) for _ in range(10)]
    step = predict.gradwire_step(spread, 4, 4, Links(B, B), partition=64 << 10)
    assert step.step_s == pytest.approx(2.0 + MB / B + (64 << 10) / B)
    bunched = [Layer(MB, 0.0, 0.0) for _ in range(9)] + [Layer(MB, 0.0, 2.0)]
    late = predict.gradwire_step(bunched, 4, 4, Links(B, B), partition=64 << 10)
    assert late.step_s == pytest.approx(2.0 + 10 * MB / B + (64 << 10) / B)


def test_the_window_caps_the_rate_at_a_round_trip():
    layers = [Layer(16 * MB, 0.0, 0.0)]
    links = Links(B, B, delay=0.05)
    capped = predict.gradwire_step(layers, 4, 4, links, partition=64 << 10, window=2)
    rtt = 0.1 + (64 << 10) / B
    assert capped.comm_end_s == pytest.approx(16 * MB / (2 * (64 << 10) / rtt) + (64 << 10) / B + 0.1)


def test_one_worker_with_its_colocated_server_moves_nothing_and_ddp_alone_neither():
    layers = [Layer(16 * MB, 0.1, 0.2)]
    assert predict.gradwire_step(layers, 1, 0, Links(B), colocated=True).step_s == pytest.approx(0.3)
    assert predict.ring_step(layers, 1, Links(B)).step_s == pytest.approx(0.3)
    assert predict.gradwire_step(layers, 1, 1, Links(B, B)).step_s > 1.0  # a dedicated server: S out and back


def test_efficiency_and_server_cores():
    assert predict.efficiency(2.0, 1.0) == 0.5
    # 8 workers x 100 MB per step over 4 servers each 1 s: 0.2 GB/s per server at 0.5 CPU s per GB: 0.1 core
    assert predict.server_cores(8, 4, 100_000_000, 1.0, 0.5) == pytest.approx(0.1)


def test_a_link_s_rate_counts_frames_so_payload_takes_longer():
    layers = [Layer(64 * MB, 0.0, 0.0)]
    framed = predict.ring_step(layers, 4, predict.Links(B)).step_s
    assert framed == pytest.approx(predict.ring_step(layers, 4, Links(B)).step_s / predict.TCP_PAYLOAD)


def test_gradwire_plan_predict_tabulates_every_rate_and_n(capsys):
    import argparse

    from gradwire.launch import plan

    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    assert plan.main(parser.parse_args(["--predict", "-n", "8", "--rates", "1gbit,100gbit"])) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], int(r[1])) for r in rows] == [(rate, n) for rate in ("1gbit", "100gbit") for n in (1, 2, 4, 8)]
    at_8 = next(r for r in rows if r[:2] == ["1gbit", "8"])
    assert float(at_8[6]) > 1.0  # k = n dedicated servers beat the ring where the network binds


@pytest.mark.parametrize("datapath", ["python", "auto"])
def test_gradwire_plan_predict_takes_the_measured_cpu_of_the_data_path_a_server_would_run(
    capsys, monkeypatch, datapath
):
    import argparse

    from gradwire import native
    from gradwire.launch import plan

    monkeypatch.setenv("GRADWIRE_DATAPATH", datapath)
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    assert plan.main(parser.parse_args(["--predict", "-n", "2", "--rates", "100gbit"])) == 0
    path = "python" if datapath == "python" or native.load().module is None else "native"
    head = capsys.readouterr().out.splitlines()[0]
    assert f"servers' CPU {predict.SERVER_CPU_S_PER_GB[path]:g} s per GB (the {path} data path's, measured)" in head
    assert plan.main(parser.parse_args(["--predict", "-n", "2", "--server-cpu-per-gb", "1.5"])) == 0
    assert "servers' CPU 1.5 s per GB (as given)" in capsys.readouterr().out


def test_gradwire_plan_predict_at_jumbo_frames_moves_the_same_bytes_sooner(capsys):
    """--mtu: the links' goodput is their rate less the headers of that MTU's frames (tuning.framing)."""
    import argparse

    from gradwire import tuning
    from gradwire.launch import plan

    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    steps = {}
    for mtu in (1500, 9000):
        assert plan.main(parser.parse_args(["--predict", "-n", "8", "--rates", "1gbit", "--mtu", str(mtu)])) == 0
        out = capsys.readouterr().out.splitlines()
        assert f"MTU {mtu};" in out[0]
        steps[mtu] = float(next(r.split() for r in out[2:] if r.split()[:2] == ["1gbit", "8"])[2])  # the ring's
    assert steps[9000] == pytest.approx(steps[1500] * tuning.framing(9000) / tuning.framing(1500), rel=0.05)
    assert predict.TCP_PAYLOAD == pytest.approx(1448 / 1514)
