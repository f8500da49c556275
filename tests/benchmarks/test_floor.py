"""The floor under `python -m benchmarks --partitions` (benchmarks/floor.py): a Python data path with nothing else."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import floor, partitions

KiB = 1 << 10


@pytest.mark.parametrize("mode", floor.MODES)
@pytest.mark.parametrize("partition", [32 * KiB, 1 << 20])
def test_every_sum_comes_back_into_its_place(mode: str, partition: int) -> None:
    # a tensor that is not a whole number of partitions: the last one is short
    row = floor.measure(partition, (3 << 20) + 4 * KiB, 2, mode)
    assert row["mode"] == mode and row["partition_bytes"] == partition
    assert row["worker_cpu_seconds_per_gb"] > 0 and row["server_cpu_seconds_per_gb"] >= 0


def test_a_wrong_sum_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def wrong(sock, size, part, parts=1):  # the forked server: answers every partition with zeros
        header, pushed = bytearray(floor.HEADER.size), memoryview(bytearray(part))
        done = 0
        while done < size:
            floor._recv_exactly(sock, memoryview(header))
            index, n = floor.HEADER.unpack(header)
            floor._recv_exactly(sock, pushed[:n])
            sock.sendmsg([floor.HEADER.pack(index, n), bytes(n)])
            done += n

    monkeypatch.setattr(floor, "serve", wrong)
    with pytest.raises(AssertionError, match="wrong"):
        floor.measure(64 * KiB, 1 << 20, 1, "one-thread")


def test_a_server_that_fails_is_an_error_not_a_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(sock, size, part, parts=1):  # the forked server dies before answering anything
        raise RuntimeError("a server bug")

    monkeypatch.setattr(floor, "serve", fails)
    with pytest.raises((ConnectionError, RuntimeError)):
        floor.measure(64 * KiB, 1 << 20, 1, "two-threads")


def test_the_window_stays_within_256_kib() -> None:
    assert [floor.window(p) for p in (16 * KiB, 64 * KiB, 128 * KiB, 4 << 20)] == [4, 4, 2, 1]


def test_a_batched_frame_carries_partitions_up_to_256_kib() -> None:
    sizes = (16 * KiB, 32 * KiB, 128 * KiB, 4 << 20)
    assert [floor.per_frame(p, "batched") for p in sizes] == [8, 8, 2, 1]
    assert [floor.per_frame(p, "one-thread") for p in sizes] == [1, 1, 1, 1]


def test_the_floor_table_is_over_the_largest_size() -> None:
    rows = [
        {"floor": mode, "partition_bytes": p, "worker_cpu_seconds_per_gb": w, "server_cpu_seconds_per_gb": s}
        for mode in floor.MODES
        for p, w, s in ((32 * KiB, 1.5, 0.9), (4096 * KiB, 0.5, 0.6))
    ]
    text = partitions.floor_table(rows, 16 << 20)
    assert "| one-thread | 32 KiB | 1.50 | 3.00x | 0.90 | 1.50x |" in text
    assert "| two-threads | 4096 KiB | 0.50 | 1.00x | 0.60 | 1.00x |" in text
    assert np.isclose(float(text.split("| one-thread | 32 KiB | ")[1].split(" |")[0]), 1.5)
