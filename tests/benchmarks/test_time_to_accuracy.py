"""`python -m benchmarks --netem --accuracy`'s reading of the curves: the time to a target is the first epoch's at or
above it, seeds that never reach it are counted apart, and the ratios put the peers' times over each way's."""

from benchmarks.time_to_accuracy import TARGETS, curve, table, time_to


def _points(accuracies, seconds_per_epoch):
    return [
        {"epoch": i + 1, "seconds": (i + 1) * seconds_per_epoch, "test_accuracy": a} for i, a in enumerate(accuracies)
    ]


def test_the_curve_is_rank_zeros_epoch_lines_and_the_time_is_the_first_epoch_at_the_target():
    out = (
        "noise\n"
        'EPOCH {"epoch": 1, "seconds": 2.0, "test_accuracy": 0.9}\n'
        'EPOCH {"epoch": 2, "seconds": 4.0, "test_accuracy": 0.96}\n'
        "PS {}\n"
    )
    points = curve(out)
    assert [p["epoch"] for p in points] == [1, 2]
    assert time_to(points, 0.95) == 4.0 and time_to(points, 0.9) == 2.0 and time_to(points, 0.99) is None


def test_the_table_puts_the_peers_times_over_each_ways_and_counts_the_seeds_that_got_there():
    slow = [_points([0.9, 0.96, 0.975, 0.98], 10.0)] * 2  # DDP: 0.97 after 30 s
    curves = {
        "DDP": slow,
        "DDP + PowerSGD r2": [_points([0.9, 0.97, 0.98, 0.98], 5.0)] * 2,  # 10 s
        "gradwire onebit": [_points([0.96, 0.97, 0.97, 0.97], 2.5), _points([0.9, 0.9, 0.9, 0.94], 2.5)],
    }
    text = table(curves)
    row = next(line for line in text.splitlines() if line.startswith("| gradwire onebit"))
    assert f"to {TARGETS[-1]:.0%}" in text
    assert "5.0 s (1/2)" in row  # one seed reached 97% after 2 epochs of 2.5 s; the other never did
    assert "| 6.00x | 2.00x |" in row  # DDP's 30 s and DDP + PowerSGD's 10 s over 5 s
