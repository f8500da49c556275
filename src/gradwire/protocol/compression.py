"""Gradient compressors that the servers understand (docs/compression.md): what a compressed partition looks like on
the wire, and how it is made and read back. Pure numpy; the workers and the servers use the same code, so a
partition's wire size and every decoded value are the same on both sides.

A compressed tensor is a float32 tensor whose every partition travels as a block of `wire_bytes(n)` bytes (a
multiple of 4: the block travels as float32 words) instead of 4n. The worker encodes each partition (after adding
its error-feedback residual), the server decodes every push into a float32 accumulator, adds them in rank order,
and encodes the sum once (after adding its own residual) for every worker to pull: all receive the same bytes.

- `onebit`: the signs, one bit each, and one scale (mean |x| with `scaling`, else 1): 32x.
- `topk`: the k largest |x|, as (int32 index, float32 value) pairs: 4n / 8k.
- `randomk`: k values at indices drawn from a generator seeded by (seed, key, round), so every worker and the
  server draw the same ones and only the values travel: 4n / 4k; the sum has the same k indices, so the servers'
  encoding of it loses nothing.
- `dithering`: stochastic quantisation of |x| / norm to s levels (`linear`: l/s; `natural`: powers of two), with a
  sign: 4 bits per element for s < 8, else 8 (8x or 4x), and the norm (`max` or `l2`).

k is a fraction of each partition's elements (0 < k < 1) or a count per partition (k >= 1). Partitions too small to
gain (the block would not be smaller than the float32 partition) travel as they are (`Raw`).
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import numpy as np

from gradwire.errors import TensorError

METHODS = ("onebit", "topk", "randomk", "dithering")
# defaults of every method's arguments (anything else is refused); `ef`: error feedback (the worker's residual, and
# the server's of the sum), `momentum`: the workers' momentum before compression (0: none), `seed`: randomk's and
# dithering's generators
DEFAULTS: dict[str, dict[str, object]] = {
    "onebit": {"scaling": True, "ef": True, "momentum": 0.0},
    "topk": {"k": 0.01, "ef": True, "momentum": 0.0},
    "randomk": {"k": 0.01, "seed": 0, "ef": True, "momentum": 0.0},
    "dithering": {"s": 7, "partition": "linear", "norm": "max", "seed": 0, "ef": False, "momentum": 0.0},
}


def check_args(args: object) -> dict:
    """The compressor's arguments, complete and canonical; ValueError saying what is wrong."""
    if not isinstance(args, dict):
        raise ValueError(f"compressor arguments must be a dict, got {args!r}")
    method = args.get("method")
    if method not in DEFAULTS:
        raise ValueError(f"unknown compressor {method!r}; gradwire's servers understand {', '.join(METHODS)}")
    defaults = DEFAULTS[method]
    unknown = set(args) - set(defaults) - {"method"}
    if unknown:
        raise ValueError(f"{method} takes no argument {', '.join(sorted(unknown))}; it takes {', '.join(defaults)}")
    out: dict[str, object] = {"method": method}
    for name, default in defaults.items():
        value = args.get(name, default)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"{method}: {name} must be true or false, got {value!r}")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
                raise ValueError(f"{method}: {name} must be a non-negative integer, got {value!r}")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{method}: {name} must be a number, got {value!r}")
            value = float(value)
        out[name] = value
    if method in ("topk", "randomk"):
        k = out["k"]
        if not (0 < k < 1 or (k >= 1 and float(k).is_integer())):  # type: ignore[operator]
            raise ValueError(f"{method}: k must be a fraction in (0, 1) or a whole count >= 1, got {k!r}")
    if method == "dithering":
        if not 1 <= int(out["s"]) <= 127:  # type: ignore[call-overload]
            raise ValueError(f"dithering: s must be 1 to 127 levels, got {out['s']!r}")
        if out["partition"] not in ("linear", "natural") or out["norm"] not in ("max", "l2"):
            raise ValueError("dithering: partition is 'linear' or 'natural', norm is 'max' or 'l2'")
        if out["partition"] == "natural" and int(out["s"]) > 30:  # type: ignore[call-overload]
            raise ValueError("dithering: natural levels are powers of two: s <= 30")
    if not 0.0 <= float(out["momentum"]) < 1.0:  # type: ignore[arg-type]
        raise ValueError(f"{method}: momentum must be in [0, 1), got {out['momentum']!r}")
    return out


def _pad4(nbytes: int) -> int:
    return -(-nbytes // 4) * 4


class Codec:
    """How one method encodes a partition of n float32 elements into `wire_bytes(n)` bytes and back.

    `encode(x, out, key, rnd, who)`: `x` float32[n] into `out` uint8[wire_bytes(n)]; `who` is the encoder's rank (-1:
    a server), for generators that must differ per encoder. `decode(blob, out, key, rnd, add)`: into (or, `add`, onto)
    `out` float32[n]; raises TensorError on a block no encoder makes (blocks come from the network). `lossless_sum`: a
    server's encoding of a sum of decoded blocks loses nothing (no residual needed)."""

    name: ClassVar[str]
    lossless_sum: ClassVar[bool] = False

    def wire_bytes(self, n: int) -> int:
        raise NotImplementedError

    def encode(self, x: np.ndarray, out: np.ndarray, key: int, rnd: int, who: int) -> None:
        raise NotImplementedError

    def decode(self, blob: np.ndarray, out: np.ndarray, key: int, rnd: int, add: bool) -> None:
        raise NotImplementedError


class Raw(Codec):
    """A partition too small to gain travels as it is."""

    name = "raw"
    lossless_sum = True

    def wire_bytes(self, n: int) -> int:
        return 4 * n

    def encode(self, x: np.ndarray, out: np.ndarray, key: int, rnd: int, who: int) -> None:
        out.view(np.float32)[:] = x

    def decode(self, blob: np.ndarray, out: np.ndarray, key: int, rnd: int, add: bool) -> None:
        if add:
            out += blob.view(np.float32)
        else:
            out[:] = blob.view(np.float32)


class OneBit(Codec):
    name = "onebit"

    def __init__(self, scaling: bool) -> None:
        self.scaling = scaling

    def wire_bytes(self, n: int) -> int:
        return 4 + _pad4(-(-n // 8))

    def encode(self, x: np.ndarray, out: np.ndarray, key: int, rnd: int, who: int) -> None:
        scale = float(np.abs(x).mean()) if self.scaling and len(x) else 1.0
        out[:4].view(np.float32)[0] = scale
        bits = np.packbits(np.signbit(x))
        out[4 : 4 + len(bits)] = bits
        out[4 + len(bits) :] = 0

    def decode(self, blob: np.ndarray, out: np.ndarray, key: int, rnd: int, add: bool) -> None:
        scale = blob[:4].view(np.float32)[0]
        if not np.isfinite(scale):
            raise TensorError(f"onebit block of key {key:016x} has scale {scale}")
        signs = np.unpackbits(blob[4:], count=len(out)).view(np.int8)
        # +scale where the bit is 0, -scale where it is 1: scale * (1 - 2 bit), in float32
        values = np.multiply(signs, np.float32(-2.0 * scale), dtype=np.float32)
        values += scale
        if add:
            out += values
        else:
            out[:] = values


def _count(k: float, n: int) -> int:
    """Elements kept of a partition of n: a fraction of them (at least one), or a count (at most n)."""
    return min(n, int(k)) if k >= 1 else max(1, math.ceil(k * n))


class TopK(Codec):
    name = "topk"

    def __init__(self, k: float) -> None:
        self.k = k

    def wire_bytes(self, n: int) -> int:
        return 8 * _count(self.k, n)

    def encode(self, x: np.ndarray, out: np.ndarray, key: int, rnd: int, who: int) -> None:
        n, k = len(x), _count(self.k, len(x))
        index = _largest(np.abs(x), k) if k < n else np.arange(n)
        out[: 4 * k].view(np.int32)[:] = index
        out[4 * k :].view(np.float32)[:] = x[index]

    def decode(self, blob: np.ndarray, out: np.ndarray, key: int, rnd: int, add: bool) -> None:
        k = len(blob) // 8
        index = blob[: 4 * k].view(np.int32)
        # the encoder sends the indices sorted: strictly increasing and inside the partition, or the block is forged
        if k and (int(index[0]) < 0 or int(index[-1]) >= len(out) or not bool(np.all(index[1:] > index[:-1]))):
            raise TensorError(f"topk block of key {key:016x} has indices unsorted or outside its {len(out)} elements")
        if not add:
            out[:] = 0
        out[index] += blob[4 * k :].view(np.float32)


def _largest(magnitude: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k largest values, sorted (ties at the boundary: the lowest indices). A threshold from a
    strided sample (at twice k's share of it) splits the partition: the values above it, if k or more, hold the k
    largest and are selected among; if fewer, the k largest are all of them and the first values equal to it. So a
    selection runs over a few candidates, never over the partition, which is slow where many values tie (zeros of
    unused embedding rows, dead units)."""
    n = len(magnitude)
    stride = max(1, n // 8192)
    sample = magnitude[::stride]
    above = min(len(sample), 2 * -(-k * len(sample) // n) + 1)
    threshold = np.partition(sample, len(sample) - above)[len(sample) - above]
    over = np.flatnonzero(magnitude > threshold)
    if len(over) >= k:
        index = over[np.argpartition(magnitude[over], len(over) - k)[len(over) - k :]]
    else:
        equal = np.flatnonzero(magnitude == threshold)[: k - len(over)]
        if len(over) + len(equal) == k:
            index = np.concatenate([over, equal])
        else:  # fewer than k at or above the sample's threshold: select over everything
            index = np.argpartition(magnitude, n - k)[n - k :]
    index.sort()
    return index


@functools.lru_cache(maxsize=256)
def _random_index(seed: int, key: int, rnd: int, n: int, k: int) -> np.ndarray:
    """The k indices of partition `key`'s round `rnd` (sorted): the same in every process (one numpy version)."""
    rng = np.random.default_rng([seed, key & 0xFFFFFFFF, key >> 32, rnd])
    index = rng.choice(n, k, replace=False) if k < n else np.arange(n)
    index.sort()
    index.flags.writeable = False
    return index


class RandomK(Codec):
    name = "randomk"
    lossless_sum = True

    def __init__(self, k: float, seed: int) -> None:
        self.k, self.seed = k, seed

    def wire_bytes(self, n: int) -> int:
        return 4 * _count(self.k, n)

    def encode(self, x: np.ndarray, out: np.ndarray, key: int, rnd: int, who: int) -> None:
        index = _random_index(self.seed, key, rnd, len(x), _count(self.k, len(x)))
        out.view(np.float32)[:] = x[index]

    def decode(self, blob: np.ndarray, out: np.ndarray, key: int, rnd: int, add: bool) -> None:
        index = _random_index(self.seed, key, rnd, len(out), _count(self.k, len(out)))
        if not add:
            out[:] = 0
        out[index] += blob.view(np.float32)


class Dithering(Codec):
    """Stochastic quantisation: |x| / norm rounded up or down to a neighbouring level with the probabilities that
    keep it unbiased. Codes: 0 is zero; linear code c is c / s; natural code c is 2^(c - s) (c = s is 1)."""

    name = "dithering"

    def __init__(self, s: int, partition: str, norm: str, seed: int) -> None:
        self.s, self.natural, self.l2, self.seed = s, partition == "natural", norm == "l2", seed
        self.nibbles = s < 8  # a sign bit and 3 bits of code per element, two per byte
        # decoding by table: each byte's value(s) as a fraction of the norm, and whether an encoder makes that byte
        self.levels = levels = self._levels()
        codes = np.arange(256)
        if self.nibbles:
            halves = np.stack([codes & 0xF, codes >> 4], axis=1)  # low nibble first
            magnitude, negative = halves & 7, halves >> 3
            self._valid = (magnitude <= s).all(axis=1)
        else:
            signed = codes.astype(np.uint8).view(np.int8).astype(np.int64)
            magnitude, negative = np.abs(signed), signed < 0
            self._valid = magnitude <= s
        fraction = levels[np.minimum(magnitude, s)]
        self._table = np.where(negative, -fraction, fraction).astype(np.float32)

    def wire_bytes(self, n: int) -> int:
        return 4 + _pad4(-(-n // 2) if self.nibbles else n)

    def _levels(self) -> np.ndarray:
        """The value of each code, as a fraction of the norm."""
        codes = np.arange(self.s + 1, dtype=np.float64)
        levels = np.exp2(codes - self.s) if self.natural else codes / self.s
        levels[0] = 0.0
        return levels.astype(np.float32)

    def encode(self, x: np.ndarray, out: np.ndarray, key: int, rnd: int, who: int) -> None:
        n = len(x)
        norm = float(np.sqrt(np.dot(x, x))) if self.l2 else float(np.abs(x).max(initial=0.0))
        out[:4].view(np.float32)[0] = norm
        rng = np.random.default_rng([self.seed, key & 0xFFFFFFFF, key >> 32, rnd, who + 1])
        y = np.abs(x) / norm if norm > 0 else np.zeros(n, np.float32)
        np.minimum(y, 1.0, out=y)
        if self.natural:
            low_code = np.floor(np.log2(np.maximum(y, 2.0**-40))) + self.s
            low_code = np.clip(low_code, 0, self.s).astype(np.int64)
            levels = self.levels
            low = levels[low_code]
            high = levels[np.minimum(low_code + 1, self.s)]
            width = np.where(high > low, high - low, 1.0)
            up = rng.random(n, dtype=np.float32) < (y - low) / width
            code = (low_code + up).astype(np.int8)
        else:
            scaled = y * self.s
            low_code = np.floor(scaled)
            code = (low_code + (rng.random(n, dtype=np.float32) < scaled - low_code)).astype(np.int8)
        np.minimum(code, self.s, out=code)
        negative = np.signbit(x)
        if self.nibbles:
            nibble = code.view(np.uint8) | (negative.view(np.uint8) << 3)
            if n % 2:
                nibble = np.append(nibble, np.uint8(0))
            packed = nibble[0::2] | (nibble[1::2] << 4)
            out[4 : 4 + len(packed)] = packed
            out[4 + len(packed) :] = 0
        else:
            signed = np.where(negative, -code, code).astype(np.int8)
            out[4 : 4 + n] = signed.view(np.uint8)
            out[4 + n :] = 0

    def decode(self, blob: np.ndarray, out: np.ndarray, key: int, rnd: int, add: bool) -> None:
        n = len(out)
        norm = blob[:4].view(np.float32)[0]
        if not np.isfinite(norm) or norm < 0:
            raise TensorError(f"dithering block of key {key:016x} has norm {norm}")
        data = blob[4 : 4 + (-(-n // 2) if self.nibbles else n)]
        if n and not bool(self._valid[data].all()):
            raise TensorError(f"dithering block of key {key:016x} has a code above its {self.s} levels")
        values = self._table[data].reshape(-1)[:n]  # nibbles: both halves of each byte, low first
        if add:
            out += values * norm
        else:
            np.multiply(values, norm, out=out)


def codec(args: dict) -> Codec:
    """The codec of checked arguments (`check_args`)."""
    method = args["method"]
    if method == "onebit":
        return OneBit(bool(args["scaling"]))
    if method == "topk":
        return TopK(float(args["k"]))
    if method == "randomk":
        return RandomK(float(args["k"]), int(args["seed"]))
    return Dithering(int(args["s"]), str(args["partition"]), str(args["norm"]), int(args["seed"]))


def for_partition(c: Codec, n: int) -> Codec:
    """The codec a partition of n elements travels with: `c`, unless its block would not be smaller."""
    return c if n and c.wire_bytes(n) < 4 * n else RAW


RAW = Raw()
