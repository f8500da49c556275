import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradwire import partition


@pytest.mark.parametrize(
    "n,itemsize,pbytes,expected",
    [
        (1, 4, 16, [(0, 0, 1)]),
        (4, 4, 16, [(0, 0, 4)]),  # exactly one partition
        (8, 4, 16, [(0, 0, 4), (1, 4, 4)]),  # an exact multiple
        (9, 4, 16, [(0, 0, 3), (1, 3, 3), (2, 6, 3)]),  # odd: near-equal pieces, not 4+4+1
        (10, 4, 16, [(0, 0, 4), (1, 4, 3), (2, 7, 3)]),
        (0, 4, 16, [(0, 0, 0)]),
        (3, 8, 17, [(0, 0, 2), (1, 2, 1)]),  # partition_bytes not a multiple of the item size
    ],
)
def test_split_cases(n, itemsize, pbytes, expected):
    assert [(p.index, p.start, p.count) for p in partition.split(n, itemsize, pbytes)] == expected


def test_split_refuses_partitions_smaller_than_an_element():
    with pytest.raises(ValueError):
        partition.split(10, 8, 4)


@given(n=st.integers(1, 10**6), itemsize=st.sampled_from([2, 4, 8]), pbytes=st.integers(8, 1 << 22))
@settings(deadline=None)
def test_split_covers_everything_within_bounds(n, itemsize, pbytes):
    n = min(n, 4096 * (pbytes // itemsize))  # at most 4096 partitions keeps each example fast
    parts = partition.split(n, itemsize, pbytes)
    assert parts[0].start == 0
    for a, b in zip(parts, parts[1:], strict=False):
        assert a.start + a.count == b.start
    assert parts[-1].start + parts[-1].count == n
    assert all(0 < p.count * itemsize <= pbytes for p in parts)
    assert max(p.count for p in parts) - min(p.count for p in parts) <= 1
    assert len(parts) == -(-n // (pbytes // itemsize))


def test_keys_are_stable_and_distinct():
    assert partition.key_of("w", 0) == partition.key_of("w", 0)
    # pinned: a key must be the same in every process and every release
    assert partition.key_of("layer1.weight", 3) == int.from_bytes(
        __import__("hashlib").blake2b(b"layer1.weight\x003", digest_size=8).digest(), "little"
    )
    keys = {partition.key_of(f"t{i}", j) for i in range(200) for j in range(20)}
    assert len(keys) == 4000
