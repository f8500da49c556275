"""A compressed push_pull of a tensor on an accelerator, encoded and decoded where it lives (docs/compression.md, "On
a GPU"): each partition, with this worker's error feedback and momentum kept beside it on the device, becomes its
block there, and only the block crosses to the host, 1/32 of the gradient with onebit; each answered block crosses
back and is decoded into the output there. Staging the whole gradient through host memory and encoding it on the CPU
(what a CPU tensor gets) would move 32 times the bytes over PCIe and spend the host's cores on every element.

`ON_CPU_TOO` sends CPU tensors this way as well: how the tests run this path on a machine without a GPU.

The codecs (`encode`, `decode`) are the servers' compressors in torch. The blocks are the ones protocol/compression.py
defines, byte for byte in layout, so the servers (numpy) read them and every worker decodes the same answered bytes
into the same values:

- onebit: the signs packed most significant bit first (numpy's packbits), after a float32 scale (mean |x| or 1).
- topk: the k largest |x| (torch.topk), their indices sorted, as int32, then their values.
- randomk: the indices every worker and the server draw (protocol/compression.py's generator, on the host), moved here.
- dithering: the norm, then per element a sign and a code drawn so the mean is x (torch's generator: any draw decodes
  alike), nibbles low first below 8 levels, else signed bytes.

Decoding is as strict as the host's: a block no encoder makes is refused with its key.
"""

from __future__ import annotations

import functools

import numpy as np

import torch
from gradwire.errors import TensorError
from gradwire.protocol import compression
from gradwire.worker import Handle, Worker
from gradwire.worker.compressing import KeyCodec

_BITS = (128, 64, 32, 16, 8, 4, 2, 1)  # numpy's packbits: the first element in the most significant bit


def encode(codec: compression.Codec, x: torch.Tensor, key: int, rnd: int, who: int) -> torch.Tensor:
    """`x` (float32, any device) as `codec`'s block: uint8 of `codec.wire_bytes(len(x))`, on x's device."""
    n = x.numel()
    out = torch.zeros(codec.wire_bytes(n), dtype=torch.uint8, device=x.device)
    if isinstance(codec, compression.Raw):
        out.view(torch.float32).copy_(x)
    elif isinstance(codec, compression.OneBit):
        scale = x.abs().mean() if codec.scaling and n else torch.ones((), device=x.device)
        out[:4].view(torch.float32).copy_(scale.reshape(1))
        bits = torch.signbit(x).to(torch.uint8)
        bits = torch.nn.functional.pad(bits, (0, -n % 8)).view(-1, 8)
        packed = (bits * _weights(x.device)).sum(1, dtype=torch.int32).to(torch.uint8)
        out[4 : 4 + len(packed)] = packed
    elif isinstance(codec, compression.TopK):
        k = compression._count(codec.k, n)
        if k < n:
            index = torch.topk(x.abs(), k, sorted=False).indices.sort().values
        else:
            index = torch.arange(n, device=x.device)
        out[: 4 * k].view(torch.int32).copy_(index.to(torch.int32))
        out[4 * k :].view(torch.float32).copy_(x[index])
    elif isinstance(codec, compression.RandomK):
        index = _random_index(codec, key, rnd, n, x.device)
        out.view(torch.float32).copy_(x[index])
    elif isinstance(codec, compression.Dithering):
        _dither(codec, x, out, key, rnd, who)
    else:  # pragma: no cover - every codec of protocol/compression.py is above
        raise TypeError(f"no device encoding for {codec.name}")
    return out


def decode(codec: compression.Codec, block: torch.Tensor, n: int, key: int, rnd: int) -> torch.Tensor:
    """`codec`'s block (uint8, any device) as n float32 values on its device; TensorError for a forged block."""
    device = block.device
    if isinstance(codec, compression.Raw):
        return block.view(torch.float32).clone()
    if isinstance(codec, compression.OneBit):
        scale = block[:4].view(torch.float32)[0]
        if not bool(torch.isfinite(scale)):
            raise TensorError(f"onebit block of key {key:016x} has scale {float(scale)}")
        packed = block[4 : 4 + -(-n // 8)].to(torch.int32)
        bits = ((packed.unsqueeze(1) & _weights(device)) != 0).reshape(-1)[:n]
        return torch.where(bits, -scale, scale)
    out = torch.zeros(n, dtype=torch.float32, device=device)
    if isinstance(codec, compression.TopK):
        k = len(block) // 8
        index = block[: 4 * k].view(torch.int32).long()
        if k and (int(index[0]) < 0 or int(index[-1]) >= n or not bool((index[1:] > index[:-1]).all())):
            raise TensorError(f"topk block of key {key:016x} has indices unsorted or outside its {n} elements")
        out.index_add_(0, index, block[4 * k :].view(torch.float32))
        return out
    if isinstance(codec, compression.RandomK):
        out.index_add_(0, _random_index(codec, key, rnd, n, device), block.view(torch.float32))
        return out
    if isinstance(codec, compression.Dithering):
        norm = block[:4].view(torch.float32)[0]
        if not bool(torch.isfinite(norm)) or float(norm) < 0:
            raise TensorError(f"dithering block of key {key:016x} has norm {float(norm)}")
        data = block[4 : 4 + (-(-n // 2) if codec.nibbles else n)].long()
        values, valid = _table(codec.s, codec.natural, device)
        if n and not bool(valid[data].all()):
            raise TensorError(f"dithering block of key {key:016x} has a code above its {codec.s} levels")
        return values[data].reshape(-1)[:n] * norm
    raise TypeError(f"no device decoding for {codec.name}")  # pragma: no cover


@functools.lru_cache(maxsize=8)
def _weights(device: torch.device) -> torch.Tensor:
    return torch.tensor(_BITS, dtype=torch.uint8, device=device)


def _random_index(codec: compression.RandomK, key: int, rnd: int, n: int, device: torch.device) -> torch.Tensor:
    """The indices the server draws for this partition's round (the host's generator), on `device`."""
    index = compression._random_index(codec.seed, key, rnd, n, compression._count(codec.k, n))
    return torch.from_numpy(index.astype(np.int64)).to(device)


@functools.lru_cache(maxsize=16)
def _table(s: int, natural: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each byte's value(s) as a fraction of the norm, and whether an encoder makes that byte (the host's tables)."""
    host = compression.Dithering(s, "natural" if natural else "linear", "max", 0)
    return torch.from_numpy(host._table).to(device), torch.from_numpy(host._valid).to(device)


def _dither(codec: compression.Dithering, x: torch.Tensor, out: torch.Tensor, key: int, rnd: int, who: int) -> None:
    n = x.numel()
    norm = torch.linalg.vector_norm(x) if codec.l2 else x.abs().max() if n else torch.zeros((), device=x.device)
    out[:4].view(torch.float32).copy_(norm.reshape(1))
    g = torch.Generator(device=x.device)
    g.manual_seed(hash((codec.seed, key, rnd, who + 1)) & ((1 << 63) - 1))
    y = torch.where(norm > 0, x.abs() / norm.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(x))
    y = y.clamp_max(1.0)
    draw = torch.rand(n, generator=g, device=x.device)
    if codec.natural:
        levels = torch.from_numpy(codec.levels).to(x.device)
        low_code = (torch.floor(torch.log2(y.clamp_min(2.0**-40))) + codec.s).clamp(0, codec.s).long()
        low, high = levels[low_code], levels[(low_code + 1).clamp_max(codec.s)]
        width = torch.where(high > low, high - low, torch.ones_like(high))
        code = low_code + (draw < (y - low) / width).long()
    else:
        scaled = y * codec.s
        low_code = torch.floor(scaled)
        code = (low_code + (draw < scaled - low_code).float()).long()
    code = code.clamp_max(codec.s)
    negative = torch.signbit(x)
    if codec.nibbles:
        nibble = (code | (negative.long() << 3)).to(torch.uint8)
        nibble = torch.nn.functional.pad(nibble, (0, n % 2))
        packed = nibble[0::2] | (nibble[1::2] << 4)
        out[4 : 4 + len(packed)] = packed
    else:
        signed = torch.where(negative, -code, code).to(torch.int8)
        out[4 : 4 + n] = signed.view(torch.uint8)


ON_CPU_TOO = False  # tests: CPU tensors take the device path too


def applies(worker: Worker, source: torch.Tensor, op: str, members: list[int] | None) -> bool:
    """The device path: a float32 sum on an accelerator (or anywhere, ON_CPU_TOO) that is compressed (its size past
    GRADWIRE_COMPRESSION_MIN_BYTES), where no host stage needs the gradient itself (local aggregation's shared
    memory)."""
    if (source.device.type == "cpu" and not ON_CPU_TOO) or source.dtype != torch.float32:
        return False
    shaped = np.broadcast_to(np.float32(0), source.shape)  # the tensor's shape, dtype and bytes, no memory
    calls = worker.calls  # the host path's own decisions, asked of the same tensor
    if not calls.compressing.applies(shaped, op, None):
        return False
    return calls.aggregation is None or not calls.aggregation.applies(shaped, op, members)


class DeviceCoder:
    """One push_pull's partitions, encoded from `source` and decoded into `output` (flat float32, on one device)."""

    def __init__(self, source: torch.Tensor, output: torch.Tensor, args: dict, rank: int) -> None:
        self.source, self.output, self.rank = source, output, rank
        self.feedback, self.momentum = bool(args["ef"]), float(args["momentum"])

    def encode(self, entry: KeyCodec, block: np.ndarray, start: int, count: int, key: int, rnd: int) -> None:
        """Partition [start, start + count) into `block` (host memory): momentum, error feedback, encoding on the
        device, then one copy of the block."""
        x = self.source[start : start + count]
        codec = entry.codec
        if self.momentum > 0:  # v = mu v + g; g + mu v is compressed (as the host's, worker/compressing.py)
            if entry.velocity is None:
                entry.velocity = torch.zeros_like(x)
            entry.velocity.mul_(self.momentum).add_(x)
            x = entry.velocity * self.momentum + x
        if self.feedback and codec is not compression.RAW:  # e' = (g + e) - C(g + e)
            if entry.residual is None:
                entry.residual = torch.zeros_like(x)
            total = entry.residual.add_(x)
            encoded = encode(codec, total, key, rnd, self.rank)
            total.sub_(decode(codec, encoded, count, key, rnd))
        else:
            encoded = encode(codec, x, key, rnd, self.rank)
        torch.from_numpy(block).copy_(encoded)

    def decode(
        self, entry: KeyCodec, block: np.ndarray, start: int, count: int, key: int, rnd: int, average: int
    ) -> None:
        """An answered block (host memory) into the output's partition, averaged."""
        values = decode(entry.codec, torch.from_numpy(block).to(self.output.device), count, key, rnd)
        if average > 1:
            values /= average
        self.output[start : start + count].copy_(values)


def push_pull_async(
    worker: Worker,
    tensor: torch.Tensor,
    source: torch.Tensor,
    average: bool,
    name: str,
    priority: int,
    inplace: bool,
    members: list[int] | None,
    args: dict,
) -> tuple[Handle, torch.Tensor, torch.Tensor]:
    """Start the sum; returns its handle, the output (`tensor` itself, `inplace`) and where the sum lands (the output,
    or a contiguous tensor to copy into it)."""
    flat = source.reshape(-1) if source.is_contiguous() else source.contiguous().view(-1)
    output = tensor if inplace else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    landing = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    coder = DeviceCoder(flat, landing.view(-1), args, worker.rank)
    handle = worker.calls.push_pull_coded_async(name, tuple(tensor.shape), coder, average, priority, members, args)
    return handle, output, landing
