"""A worker's side of compressed sums (docs/compression.md): each partition of a compressed tensor is encoded before
its push, with this worker's error feedback (and momentum, where asked), and the block the server answers is decoded
into the caller's output as it arrives (`Expand`, on the link loop). A server-side optimizer's gradient
is encoded the same way (`CompressedGradient`); its answer, the parameters, lands as it is.

Error feedback: what encoding dropped of a partition (its residual) is added to the same partition's next gradient,
so nothing is lost, only late (EF-SGD). Momentum (BytePS's, Nesterov's form): v = mu v + g, and g + mu v is what is
compressed; the optimizer then runs without momentum of its own. A change of the learning rate rescales every
residual by old/new (`rescale`), as BytePS does, so that what is carried over keeps its effect on the parameters.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from gradwire.errors import TensorError
from gradwire.protocol import compression
from gradwire.worker.handle import Handle
from gradwire.worker.state import WorkerState
from gradwire.worker.tensors import Tensor
from gradwire.worker.work import Transfer, Work


class KeyCodec:
    """One key's buffers, allocated on its first push: the block pushed, the block pulled, the residual and the
    momentum (None where not asked)."""

    __slots__ = ("codec", "pull", "push", "residual", "velocity")

    def __init__(self, codec: compression.Codec, n: int, feedback: bool, momentum: bool) -> None:
        self.codec = codec
        wire = codec.wire_bytes(n)
        self.push = np.zeros(wire // 4, np.float32)  # float32 words: the key's dtype on the wire
        self.pull = np.zeros(wire // 4, np.float32)
        self.residual = np.zeros(n, np.float32) if feedback and codec is not compression.RAW else None
        self.velocity = np.zeros(n, np.float32) if momentum else None


class Compressing:
    """Every compressed key's buffers on this worker. Thread-safe."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state  # its rank seeds dithering's generator
        self.keys: dict[int, KeyCodec] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # a scratch per thread: partitions are encoded where calls are submitted

    def applies(self, src: np.ndarray, op: str, dtype: object) -> bool:
        """A compressor applies: a float32 sum large enough to gain (GRADWIRE_COMPRESSION_MIN_BYTES)."""
        wire = np.dtype(dtype) if dtype is not None and dtype != "bfloat16" else src.dtype
        return op == "sum" and wire == np.float32 and src.nbytes >= self.state.config.compression_min_bytes

    def arguments(self, compressor: object, name: str) -> dict:
        """The checked arguments of `compressor` (a Compressor, or its arguments); TensorError saying what is wrong."""
        try:
            return compression.check_args(getattr(compressor, "args", compressor))
        except ValueError as e:
            rank = self.state.rank
            raise TensorError(f"worker {rank}: push_pull of {name!r}: {e}", tensor=name, rank=rank) from None

    def partition_bytes(self, args: dict) -> int:
        """A compressed tensor's partitions: as many times the job's as the compressor shrinks them (up to the
        servers' slots), so that what travels per partition is what the job's partition size was derived for (the
        links' bandwidth and delay), not 32 times less of it at 32 times the cost per byte."""
        state = self.state
        n = state.partition_bytes // 4
        ratio = 4 * n / max(4, compression.for_partition(compression.codec(args), n).wire_bytes(n))
        return max(state.partition_bytes, min(state.slot_limit, int(state.partition_bytes * ratio) // 4 * 4))

    def entry(self, key: int, n: int, codec: compression.Codec, args: dict, host: bool = True) -> KeyCodec:
        """Key `key`'s buffers, for a partition of n elements compressed by `codec` as `args` say (`host`: its
        residual and momentum here, in numpy; else the coder of a tensor on a device keeps them there)."""
        entry = self.keys.get(key)
        if entry is None:
            codec = compression.for_partition(codec, n)
            entry = KeyCodec(codec, n, host and bool(args["ef"]), host and float(args["momentum"]) > 0)
            with self._lock:
                self.keys[key] = entry
        return entry

    def encode(self, entry: KeyCodec, x: np.ndarray, key: int, rnd: int, momentum: float) -> None:
        """Encode partition `x` (with momentum and error feedback, as `entry` keeps them) into `entry.push`."""
        block = entry.push.view(np.uint8)
        source = x
        if entry.velocity is not None:  # v = mu v + g; g + mu v is compressed
            v = entry.velocity
            v *= momentum
            v += x
            source = self.scratch(len(x))
            np.multiply(v, momentum, out=source)
            source += x
        if entry.residual is None:
            entry.codec.encode(source, block, key, rnd, self.state.rank)
        else:  # e' = (g + e) - C(g + e)
            total = entry.residual
            total += source
            entry.codec.encode(total, block, key, rnd, self.state.rank)
            decoded = self.scratch(len(x))
            entry.codec.decode(block, decoded, key, rnd, add=False)
            total -= decoded

    def encoded(
        self, tensor: Tensor, rnd: int, send: np.ndarray, args: dict, coder: Coder | None = None
    ) -> Iterator[tuple]:
        """Each partition of `tensor` encoded for round `rnd` as `args` say, in partition order, as it is cut: from
        the flattened input `send` here, or by `coder` where the tensor lives (its residual and momentum there too).
        Yields (its part, its key, whether its replica keeps its rounds, its key's buffers)."""
        codec, momentum = compression.codec(args), float(args["momentum"])
        replicated = tensor.replicated or [False] * len(tensor.keys)
        for part, key, kept in zip(tensor.parts, tensor.keys, replicated, strict=True):
            entry = self.entry(key, part.count, codec, args, host=coder is None)
            if coder is None:
                self.encode(entry, send[part.start : part.start + part.count], key, rnd, momentum)
            else:
                coder.encode(entry, entry.push.view(np.uint8), part.start, part.count, key, rnd)
            yield part, key, kept, entry

    def scratch(self, n: int) -> np.ndarray:
        """A float32 scratch of n elements, this thread's."""
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or len(scratch) < n:
            scratch = self._local.scratch = np.empty(n, np.float32)
        return scratch[:n]

    def rescale(self, factor: float) -> None:
        """Multiply every residual by `factor` (old learning rate / new)."""
        with self._lock:
            entries = list(self.keys.values())
        for entry in entries:
            if entry.residual is not None:
                entry.residual *= np.float32(factor)


class Expand:
    """Decodes a key's answered block into its part of the caller's output, averaged (Work.deliver)."""

    __slots__ = ("codec", "key", "round", "target")

    def __init__(self, codec: compression.Codec, target: np.ndarray, key: int, rnd: int) -> None:
        self.codec, self.target, self.key, self.round = codec, target, key, rnd

    def __call__(self, block: np.ndarray, average: int) -> None:
        self.codec.decode(block, self.target, self.key, self.round, add=False)
        if average > 1:
            self.target /= np.float32(average)


class Coder(Protocol):
    """Encodes and decodes a tensor's partitions where the tensor lives (the torch adapter's, for a GPU:
    torch/device_coding.py), into and out of the blocks that travel; a key's residual and momentum, if any, are its
    own (in `entry.residual` and `entry.velocity`, so that a change of learning rate rescales them too)."""

    def encode(self, entry: KeyCodec, block: np.ndarray, start: int, count: int, key: int, rnd: int) -> None: ...

    def decode(
        self, entry: KeyCodec, block: np.ndarray, start: int, count: int, key: int, rnd: int, average: int
    ) -> None: ...


class CodedExpand:
    """Hands a key's answered block to its coder (Work.deliver), on the link loop."""

    __slots__ = ("coder", "count", "entry", "key", "round", "start")

    def __init__(self, coder: Coder, entry: KeyCodec, start: int, count: int, key: int, rnd: int) -> None:
        self.coder, self.entry, self.start, self.count, self.key, self.round = coder, entry, start, count, key, rnd

    def __call__(self, block: np.ndarray, average: int) -> None:
        self.coder.decode(self.entry, block, self.start, self.count, self.key, self.round, average)


@dataclass
class CompressedTransfer(Transfer):
    """A push_pull of a compressed tensor: `send` and `pull` are the caller's float32 input and output; each partition
    is encoded as it is cut (`works`), on the calling thread. With a `coder` the tensor stays where it lives (a GPU):
    the coder encodes each partition there and decodes each answered block into the output, only blocks cross to the
    host, and `send` and `pull` are empty."""

    args: dict = field(default_factory=dict)
    store: Compressing | None = None
    coder: Coder | None = None

    def works(self, tensor: Tensor, rnd: int, handle: Handle) -> Iterator[Work]:
        assert self.store is not None
        code = tensor.dtype.code
        for part, key, kept, entry in self.store.encoded(tensor, rnd, self.send, self.args, self.coder):
            lo, hi = part.start, part.start + part.count
            fields = (tensor.name, key, rnd, code, entry.push, entry.pull, self.average, handle, part.index)
            work = Work(*fields, partial=kept)
            if self.coder is None:
                work.expand = Expand(entry.codec, self.pull[lo:hi], key, rnd)
            else:
                work.expand = CodedExpand(self.coder, entry, lo, part.count, key, rnd)
            yield work


@dataclass
class CompressedGradient(Transfer):
    """A gradient push to a server-side optimizer, compressed (protocol/update.py): each partition is encoded as it is
    cut, with this worker's error feedback; the new parameters land in `pull` as they are, and `extra` (the trailer)
    follows each block."""

    args: dict = field(default_factory=dict)
    store: Compressing | None = None

    def works(self, tensor: Tensor, rnd: int, handle: Handle) -> Iterator[Work]:
        assert self.store is not None and self.extra is not None
        extra, code = memoryview(self.extra).cast("B"), tensor.dtype.code
        for part, key, kept, entry in self.store.encoded(tensor, rnd, self.send, self.args):
            lo, hi = part.start, part.start + part.count
            fields = (tensor.name, key, rnd, code, entry.push, self.pull[lo:hi], 1, handle, part.index)
            yield Work(*fields, partial=kept).trail(extra)
