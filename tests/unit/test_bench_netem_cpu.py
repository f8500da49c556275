"""The emulated-network benchmark's CPU figures: per size, a share of the cores over the timed calls and the CPU
seconds per call (the cost of the work, which a faster job does not inflate)."""

from gradwire.bench.netem import _calls_cpu


class _Servers:
    """CPU seconds of the job's other processes: 1 CPU second per wall second."""

    def between(self, start: float, end: float) -> float:
        return end - start


def test_each_size_gets_its_share_and_its_cpu_seconds_per_call():
    lines = [
        {"rank": 0, "bytes": 16, "cpu": 1.0, "start": 100.0, "end": 104.0},
        {"rank": 1, "bytes": 16, "cpu": 3.0, "start": 100.5, "end": 103.0},
        {"rank": 0, "bytes": 64, "cpu": 2.0, "start": 110.0, "end": 112.0},
    ]
    shares = _calls_cpu(lines, {16: 4, 64: 2}, _Servers(), cores=2)
    assert shares[16].utilization == (1.0 + 3.0 + 4.0) / (4.0 * 2)
    assert shares[16].seconds_per_call == (1.0 + 3.0 + 4.0) / 4
    assert shares[64].seconds_per_call == (2.0 + 2.0) / 2


def test_a_size_without_cpu_lines_or_calls_has_no_figure():
    lines = [{"rank": 0, "bytes": 16, "cpu": 1.0, "start": 0.0, "end": 1.0}]
    assert _calls_cpu(lines, {16: 0, 64: 3}, _Servers(), cores=2) == {}
