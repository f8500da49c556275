"""PowerSGD through the summation servers (Vogels et al., 2019; torch's `powerSGD_hook` computes the same): a gradient
matrix M (n x m: the tensor's first dimension by the rest) travels as two thin matrices, P = M Q (n x r) and then
Q = M^T P (m x r), each an ordinary sum on the servers; every worker rebuilds the average as P Q^T / workers.

- Error feedback: what the rank-r approximation missed of M is added to the next step's M, on each worker.
- Warm start: Q is kept from one step to the next (the averaged one), so one power iteration per step tracks the
  gradient's top subspace; without it, Q is drawn afresh each step (seeded alike on every worker).
- The first `start_iter` steps of each tensor are plain sums (the model moves fast early; torch's hook does the same).
- Vectors, and matrices too small to gain ((n + m) r >= n m / min_compression_rate), travel as plain sums.

Every worker receives the same bytes of P's and Q's sums and orthogonalises P alike, so every worker computes the same
bits of P Q^T: the parameters stay identical across workers. The second sum waits for the first: a PowerSGD tensor
costs two round trips, which its small size repays on slow links.
"""

from __future__ import annotations

import threading
import zlib
from typing import Any

import torch
from gradwire.compression import Passthrough
from gradwire.errors import GradwireError, GradwireTimeout
from gradwire.worker import Handle, Worker


class PowerSGD(Passthrough):
    """`Compression.powersgd(rank=2, start_iter=10, warm_start=True, min_compression_rate=2)`: the compressor (and its
    per-tensor state: Q, the residual and the step count, by worker and tensor name)."""

    def __init__(
        self, rank: int = 2, start_iter: int = 10, warm_start: bool = True, min_compression_rate: float = 2.0
    ) -> None:
        if rank < 1 or start_iter < 0 or min_compression_rate < 1:
            raise ValueError(
                f"powersgd: rank >= 1, start_iter >= 0 and min_compression_rate >= 1, got {rank}, {start_iter}, "
                f"{min_compression_rate}"
            )
        self.rank, self.start_iter, self.warm_start = rank, start_iter, warm_start
        self.min_compression_rate = min_compression_rate
        self._tensors: dict[tuple[int, str], _TensorState] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"powersgd(rank={self.rank}, start_iter={self.start_iter}, warm_start={self.warm_start})"

    def applies(self, tensor: torch.Tensor, op: str, members: list[int] | None) -> bool:
        """A float32 matrix (or more dimensions) of a sum that rank r shrinks enough; else a plain sum."""
        if tensor.dim() < 2 or tensor.dtype != torch.float32 or op != "sum" or members is not None:
            return False
        n, m = tensor.shape[0], tensor.numel() // tensor.shape[0]
        return (n + m) * self.rank * self.min_compression_rate <= n * m

    def state(self, worker: Worker, name: str, n: int, m: int) -> _TensorState:
        with self._lock:
            key = (id(worker), name)
            found = self._tensors.get(key)
            if found is None or found.error.shape != (n, m):
                found = self._tensors[key] = _TensorState(n, m, self.rank, name)
            return found

    def push_pull_async(
        self,
        tensor: torch.Tensor,
        average: bool,
        name: str | None,
        priority: int,
        worker: Worker,
        inplace: bool,
        op: str,
        members: list[int] | None,
    ) -> Any:
        """Start `tensor`'s PowerSGD sum (into `tensor` itself, `inplace`): a handle with `done()` and
        `result(worker)`, as TorchHandle; None where the caller sums it plainly (`applies` says no, or its first
        `start_iter` steps)."""
        source = tensor.detach()
        if name is None or not self.applies(source, op, members):
            return None
        n = source.shape[0]
        state = self.state(worker, name, n, source.numel() // n)
        state.steps += 1
        if state.steps <= self.start_iter:
            return None
        output = tensor if inplace else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        return _PowerSGDCall(self, state, source, output, average, name, priority, worker)


class _TensorState:
    """One tensor's PowerSGD state on one worker."""

    __slots__ = ("error", "q", "seed", "steps")

    def __init__(self, n: int, m: int, rank: int, name: str) -> None:
        self.error = torch.zeros(n, m)
        self.seed = zlib.crc32(name.encode())
        self.q = _random_q(m, rank, self.seed, 0)
        self.steps = 0


def _random_q(m: int, rank: int, seed: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randn(m, rank, generator=g)


def _orthogonalise(p: torch.Tensor) -> torch.Tensor:
    """The columns of p made orthonormal (Gram-Schmidt, in order, as torch's hook does): the same bits on every worker
    for the same p."""
    out = p.clone()
    for i in range(out.shape[1]):
        col = out[:, i]
        col /= torch.linalg.vector_norm(col).clamp_min(1e-8)
        if i + 1 < out.shape[1]:
            rest = out[:, i + 1 :]
            rest -= torch.outer(col, col @ rest)
    return out


class _PowerSGDCall:
    """The two sums of one PowerSGD push_pull: P's, then (on its completion, on the receiving thread) Q's."""

    def __init__(
        self,
        sgd: PowerSGD,
        state: _TensorState,
        tensor: torch.Tensor,
        output: torch.Tensor,
        average: bool,
        name: str,
        priority: int,
        worker: Worker,
    ) -> None:
        self.sgd, self.state, self.output, self.worker = sgd, state, output, worker
        self.divide_by = worker.size if average else 1
        self.name, self.priority = name, priority
        self.scale = 1.0  # applied to the result once (Horovod's postscale_factor)
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._finished = False
        n = tensor.shape[0]
        self.m = tensor.detach().reshape(n, -1).cpu() + state.error  # error feedback (on the host: the servers' side)
        if not sgd.warm_start:
            state.q = _random_q(self.m.shape[1], sgd.rank, state.seed, state.steps)
        self.p = self.m @ state.q
        array = self.p.numpy()
        handle = worker.push_pull_async(array, f"{name}.powersgd.p", False, priority, out=array)
        handle.add_done_callback(self._on_p)

    def _on_p(self, handle: Handle) -> None:
        try:
            if handle.error is not None:
                raise handle.error
            self.p = _orthogonalise(self.p)
            self.q = self.m.t() @ self.p
            array = self.q.numpy()
            second = self.worker.push_pull_async(array, f"{self.name}.powersgd.q", False, self.priority, out=array)
            second.add_done_callback(self._on_q)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the result
            self.error = e
            self._done.set()

    def _on_q(self, handle: Handle) -> None:
        self.error = handle.error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, worker: Worker) -> torch.Tensor:
        """Wait for both sums; the approximation P Q^T (averaged) lands in `output`, the residual stays for the next."""
        if self._finished:
            return self.output
        timeout = worker.state.config.timeout
        if not self._done.wait(timeout):
            raise GradwireTimeout(f"PowerSGD sums of {self.name!r} did not complete in {timeout}s", tensor=self.name)
        if self.error is not None:
            if isinstance(self.error, GradwireError):
                raise self.error
            raise GradwireError(f"PowerSGD of {self.name!r}: {self.error}") from self.error
        q = self.q / self.divide_by
        approx = self.p @ q.t()
        if self.sgd.warm_start:
            self.state.q = q
        self.state.error = self.m - approx  # what this worker's gradient has that the update did not (torch's hook)
        with torch.no_grad():
            self.output.copy_(approx.view_as(self.output))
            if self.scale != 1.0:
                self.output.mul_(self.scale)
        self._finished = True
        return self.output
