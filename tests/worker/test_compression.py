"""The servers' compressors (protocol/compression.py): each codec's block, its round trip and its error bound; blocks no
encoder makes are refused; error feedback carries what was dropped; BytePS's spelling."""

import numpy as np
import pytest

from gradwire import compression as user
from gradwire.errors import TensorError
from gradwire.protocol import compression, operations
from gradwire.worker.compressing import Compressing


def _roundtrip(codec, x, key=7, rnd=1, who=0):
    block = np.empty(codec.wire_bytes(len(x)), np.uint8)
    codec.encode(x, block, key, rnd, who)
    out = np.empty_like(x)
    codec.decode(block, out, key, rnd, add=False)
    return block, out


def _x(n=10_000, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_onebit_keeps_every_sign_and_the_mean_magnitude_in_a_32nd_of_the_bytes():
    x = _x()
    block, out = _roundtrip(compression.OneBit(scaling=True), x)
    assert len(block) == 4 + 1252  # 1250 bytes of signs, padded to whole float32 words
    assert np.array_equal(np.signbit(out), np.signbit(x))
    assert np.allclose(np.abs(out), np.abs(x).mean())
    _, unscaled = _roundtrip(compression.OneBit(scaling=False), x)
    assert np.array_equal(unscaled, np.where(x < 0, -1.0, 1.0).astype(np.float32))


def test_topk_keeps_exactly_the_largest_magnitudes():
    x = _x()
    block, out = _roundtrip(compression.TopK(0.01), x)
    assert len(block) == 8 * 100
    kept = np.nonzero(out)[0]
    assert len(kept) == 100 and np.array_equal(out[kept], x[kept])
    assert np.abs(x[kept]).min() >= np.sort(np.abs(x))[-100]
    assert compression.TopK(5).wire_bytes(1000) == 40  # a count per partition


def test_randomk_draws_the_same_indices_everywhere_and_other_ones_each_round():
    x = _x()
    codec = compression.RandomK(0.05, seed=3)
    block, out = _roundtrip(codec, x, rnd=1)
    assert len(block) == 4 * 500
    kept = np.nonzero(out)[0]
    assert len(kept) == 500 and np.array_equal(out[kept], x[kept])
    _, again = _roundtrip(compression.RandomK(0.05, seed=3), x, rnd=1, who=5)  # another worker, same round
    assert np.array_equal(again, out)
    _, later = _roundtrip(codec, x, rnd=2)
    assert not np.array_equal(np.nonzero(later)[0], kept)


@pytest.mark.parametrize("s,partition,norm", [(7, "linear", "max"), (15, "natural", "l2"), (3, "natural", "max")])
def test_dithering_is_unbiased_and_within_one_level(s, partition, norm):
    x = _x(2000)
    codec = compression.Dithering(s, partition, norm, seed=0)
    assert codec.wire_bytes(2000) == 4 + (1000 if s < 8 else 2000)
    outs = np.stack([_roundtrip(codec, x, rnd=r)[1] for r in range(400)])
    scale = np.abs(x).max() if norm == "max" else np.linalg.norm(x)
    assert np.array_equal(np.signbit(outs[0][outs[0] != 0]), np.signbit(x[outs[0] != 0]))
    if partition == "linear":
        assert np.abs(outs - x).max() <= scale / s * 1.0001
    # unbiased: the mean over many draws approaches x (the standard error shrinks as 1/sqrt(draws))
    assert np.abs(outs.mean(axis=0) - x).mean() < 0.1 * np.abs(x).mean()


@pytest.mark.parametrize(
    "codec", [compression.OneBit(True), compression.TopK(0.1), compression.Dithering(7, "linear", "max", 0)]
)
def test_decode_adds_onto_what_is_there(codec):
    x = _x(1000)
    block, once = _roundtrip(codec, x)
    out = np.ones(1000, np.float32)
    codec.decode(block, out, 7, 1, add=True)
    assert np.allclose(out, once + 1)


def test_blocks_no_encoder_makes_are_refused():
    out = np.zeros(100, np.float32)
    topk = np.zeros(80, np.uint8)
    topk[:4].view(np.int32)[0] = 100  # index past the partition
    with pytest.raises(TensorError, match="outside"):
        compression.TopK(10).decode(topk, out, 1, 1, add=False)
    repeated = np.zeros(80, np.uint8)  # index 0 ten times: a forged block would add one element many times
    with pytest.raises(TensorError, match="unsorted"):
        compression.TopK(10).decode(repeated, out, 1, 1, add=False)
    onebit = np.zeros(compression.OneBit(True).wire_bytes(100), np.uint8)
    onebit[:4].view(np.float32)[0] = np.nan
    with pytest.raises(TensorError, match="scale"):
        compression.OneBit(True).decode(onebit, out, 1, 1, add=False)
    dither = compression.Dithering(3, "linear", "max", 0)
    block = np.full(dither.wire_bytes(100), 0x77, np.uint8)  # code 7 > 3 levels
    block[:4] = 0
    with pytest.raises(TensorError, match="code"):
        dither.decode(block, out, 1, 1, add=False)


def test_partitions_too_small_to_gain_travel_raw():
    assert compression.for_partition(compression.TopK(0.9), 10) is compression.RAW
    assert compression.for_partition(compression.OneBit(True), 1) is compression.RAW
    assert compression.for_partition(compression.OneBit(True), 64) is not compression.RAW


def test_arguments_are_checked_and_canonical():
    assert compression.check_args({"method": "topk"}) == {"method": "topk", "k": 0.01, "ef": True, "momentum": 0.0}
    for bad in (
        {"method": "zip"},
        {"method": "topk", "k": 0},
        {"method": "topk", "k": 2.5},
        {"method": "onebit", "k": 1},
        {"method": "dithering", "s": 200},
        {"method": "dithering", "norm": "l1"},
        {"method": "onebit", "ef": 1},
    ):
        with pytest.raises(ValueError):
            compression.check_args(bad)
    canonical = operations.encode_args("compressed", {"method": "onebit"})
    assert canonical == operations.encode_args("compressed", user.onebit().args)


class _State:
    rank = 0


@pytest.mark.parametrize("args", [user.onebit().args, user.topk(0.01).args, user.randomk(0.02).args])
def test_error_feedback_carries_what_was_dropped(args):
    """Over any number of steps: what was sent (decoded) plus the residual left equals what was given."""
    store = Compressing(_State())
    codec = compression.codec(args)
    entry = store.entry(1, 5000, codec, args)
    given, sent = np.zeros(5000, np.float64), np.zeros(5000, np.float64)
    decoded = np.empty(5000, np.float32)
    for step in range(50):
        g = _x(5000, seed=step)
        given += g
        store.encode(entry, g, 1, step, 0.0)
        entry.codec.decode(entry.push.view(np.uint8), decoded, 1, step, add=False)
        sent += decoded
    assert np.allclose(sent + entry.residual, given, atol=1e-3)


def test_residuals_follow_the_learning_rate():
    store = Compressing(_State())
    args = user.topk(0.01).args
    entry = store.entry(1, 1000, compression.codec(args), args)
    store.encode(entry, _x(1000), 1, 1, 0.0)
    before = entry.residual.copy()
    store.rescale(0.5)
    assert np.array_equal(entry.residual, before * np.float32(0.5))


def test_byteps_spelling():
    params = {"compressor": "onebit", "ef": "vanilla", "momentum": "nesterov", "scaling": True}
    assert user.from_byteps(params, momentum_mu=0.8).args == user.onebit(momentum=0.8).args
    prefixed = {"byteps_compressor_type": "topk", "byteps_compressor_k": "3", "byteps_error_feedback_type": "vanilla"}
    assert user.from_byteps(prefixed).args == user.topk(3).args
    assert user.from_byteps({"compressor": "randomk", "k": 0.1, "seed": 4}).args == user.randomk(0.1, 4, ef=False).args
    assert user.from_byteps({"compressor": "none"}) is None
    dither = {"compressor": "dithering", "k": 15, "partition": "natural", "normalize": "l2"}
    assert user.from_byteps(dither).args == user.dithering(15, "natural", "l2").args
    with pytest.raises(ValueError, match="gradwire runs"):
        user.from_byteps({"compressor": "dgc"})


@pytest.mark.parametrize("kind", ["normal", "mostly-zero", "constant", "few-nonzero"])
def test_topk_selects_the_largest_whatever_ties(kind):
    n, k = 200_000, 2000
    x = _x(n)
    if kind == "mostly-zero":
        x[x < 2.5] = 0  # about 0.6% nonzero: fewer than k
    elif kind == "constant":
        x[:] = 1.0
    elif kind == "few-nonzero":
        x[:] = 0
        x[::1000] = 3.0
    index = compression._largest(np.abs(x), k)
    assert len(index) == k and np.all(index[1:] > index[:-1])
    assert np.sort(np.abs(x)[index])[0] >= np.sort(np.abs(x))[-k]  # no value left out is larger than one kept
