"""The native sums against protocol/dtypes.py (numpy), the reference: the same bytes for every dtype, NaNs, infinities,
subnormals and wrap-around included."""

import numpy as np
import pytest

from gradwire.protocol import dtypes

SPECIAL_FLOAT32_BITS = [
    0,
    0x80000000,
    0x7F800000,
    0xFF800000,
    0x7F800001,
    0x7FC00000,
    0xFFFFFFFF,
    0x7FFFFFFF,  # zeros, infs, NaNs
    0x00000001,
    0x007FFFFF,
    0x00800000,  # float32 subnormals, the smallest normal
    0x33000000,
    0x33000001,
    0x337FFFFF,
    0x33800000,
    0x38000000,
    0x387FE000,
    0x387FF000,
    0x38800000,  # half's bottom
    0x477FE000,
    0x477FEFFF,
    0x477FF000,
    0x47800000,
    0x3F801000,
    0x3F803000,
    0x3F802000,  # half's top, ties
]


def reference(d: dtypes.DType, contributions: list[np.ndarray]) -> bytes:
    acc = np.empty(len(contributions[0]), d.accumulate)
    scratch = np.empty_like(acc)
    dtypes.widen(d, contributions[0], acc)
    for c in contributions[1:]:
        dtypes.add_into(d, acc, c, scratch)
    out = np.empty_like(contributions[0])
    dtypes.narrow(d, acc, out)
    return out.tobytes()


def native(gn, d: dtypes.DType, contributions: list[np.ndarray]) -> bytes:
    acc = np.empty(len(contributions[0]), d.accumulate)
    gn.widen(d.code, contributions[0], acc)
    for c in contributions[1:]:
        gn.add_into(d.code, acc, c)
    out = np.empty_like(contributions[0])
    gn.narrow(d.code, acc, out)
    return out.tobytes()


@pytest.mark.parametrize("name", list(dtypes.BY_NAME))
@pytest.mark.parametrize("seed", range(3))
def test_any_bytes_sum_to_numpys_bytes(gn, name, seed):
    d = dtypes.BY_NAME[name]
    rng = np.random.default_rng(seed)
    contributions = [rng.integers(0, 256, 20_011 * d.itemsize, dtype=np.uint8).view(d.wire) for _ in range(4)]
    if name == "bool":  # a bool's bytes are 0 or 1 (numpy keeps other bytes as they are only when it copies)
        contributions = [c.view(np.uint8) % 2 == 1 for c in contributions]
    with np.errstate(all="ignore"):
        assert native(gn, d, contributions) == reference(d, contributions)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_every_half_widens_exactly(gn, name):
    d = dtypes.BY_NAME[name]
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(d.wire)
    ours, theirs = np.empty(1 << 16, np.float32), np.empty(1 << 16, np.float32)
    gn.widen(d.code, every, ours)
    dtypes.widen(d, every, theirs)
    assert ours.tobytes() == theirs.tobytes()


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_float32s_narrow_as_numpy_rounds_them(gn, name):
    d = dtypes.BY_NAME[name]
    bits = np.concatenate(
        [np.array(SPECIAL_FLOAT32_BITS, np.uint32), np.random.default_rng(5).integers(0, 2**32, 1 << 20, np.uint32)]
    )
    bits = np.concatenate([bits, bits ^ 0x80000000])  # and the negatives
    ours, theirs = np.empty(len(bits), d.wire), np.empty(len(bits), d.wire)
    gn.narrow(d.code, bits.view(np.float32), ours)
    with np.errstate(all="ignore"):
        dtypes.narrow(d, bits.view(np.float32), theirs)
    assert ours.tobytes() == theirs.tobytes()


def test_a_nan_accumulator_keeps_its_own_nan_as_numpy_does(gn):
    acc_bits, wire_bits = np.array([0x7FC00001, 0x7F800001, 0], np.uint32), np.array([0xFFC00002] * 3, np.uint32)
    ours, theirs = acc_bits.view(np.float32).copy(), acc_bits.view(np.float32).copy()
    gn.add_into(dtypes.BY_NAME["float32"].code, ours, wire_bits.view(np.float32))
    with np.errstate(invalid="ignore"):  # numpy warns of the signalling NaN
        np.add(theirs, wire_bits.view(np.float32), out=theirs)
    assert ours.tobytes() == theirs.tobytes()


def test_buffers_of_different_lengths_are_refused(gn):
    with pytest.raises(ValueError, match="different numbers"):
        gn.add_into(2, np.zeros(4, np.float32), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="unknown dtype code 99"):
        gn.add_into(99, np.zeros(4, np.float32), np.zeros(4, np.float32))


def test_torch_tensors_cross_without_a_copy(gn):
    torch = pytest.importorskip("torch")
    acc = torch.ones(1000, dtype=torch.float32)
    grad = torch.arange(1000, dtype=torch.bfloat16)
    gn.add_into(dtypes.BFLOAT16.code, acc, grad.view(torch.int16))
    assert torch.equal(acc, 1 + grad.float())
