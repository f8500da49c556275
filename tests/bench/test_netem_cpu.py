"""The emulated-network benchmark's CPU figures: per size, a share of the cores over the timed calls and the CPU
seconds per call (the cost of the work, which a faster job does not inflate)."""

from gradwire.bench.netem import _calls_cpu, timed_calls


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


class _Job:
    services: list = []

    def __init__(self, outputs: list[str]) -> None:
        self.outputs = outputs

    def wait(self, timeout: float) -> list[str]:
        return self.outputs


def test_a_job_s_rows_and_cpu_figures_come_back_for_calls_and_for_training_rows():
    cpu = 'CPU {"rank": 0, "bytes": 16, "cpu": 0.5, "start": 1.0, "end": 2.0}'
    rows, whole, calls = timed_calls(lambda: _Job(['{"bytes": 16, "times": [0.1, 0.2]}\n' + cpu]), timeout=5)
    assert rows == [{"bytes": 16, "times": [0.1, 0.2]}] and whole >= 0
    assert calls[16].seconds_per_call == 0.25
    rows, _, calls = timed_calls(lambda: _Job(['{"way": "ddp", "step_s": 0.3}']), timeout=5)  # bench --netem --train's
    assert rows == [{"way": "ddp", "step_s": 0.3}] and calls == {}


def test_the_table_says_how_far_the_wires_framing_alone_puts_every_job_from_its_bound():
    from gradwire.bench.netem import Record, table
    from gradwire.tuning import framing

    def record(system: str, mtu: int) -> Record:
        return Record(system, 4, 4 if system == "gradwire" else 0, 1e8, 1e8, 16 << 20, 1.4, 1.34, [1.4], 0.2, mtu=mtu)

    text = table([[record("gradwire", 1500), record("gloo", 1500)], [record("gradwire", 9000), record("gloo", 9000)]])
    assert "| 100 / 100 Mbit/s |" in text and "| 100 / 100 Mbit/s, MTU 9000 |" in text
    assert "At MTU 1500 TCP's headers alone put every job at 1.046x" in text
    assert "At MTU 9000 TCP's headers alone put every job at 1.007x" in text
    assert abs(framing(1500) - 1514 / 1448) < 1e-12
