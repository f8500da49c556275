"""PowerSGD through the summation servers (Vogels et al., 2019; torch's `powerSGD_hook` computes the same): a gradient
matrix M (n x m: the tensor's first dimension by the rest) travels as two thin matrices, P = M Q (n x r) and then
Q = M^T P (m x r), each an ordinary sum on the servers; every worker rebuilds the average as P Q^T / workers.

- Error feedback: what the rank-r approximation missed of M is added to the next step's M, on each worker.
- Warm start: Q is kept from one step to the next (the averaged one), so one power iteration per step tracks the
  gradient's top subspace; without it, Q is drawn afresh each step (seeded alike on every worker).
- The first `start_iter` steps of each tensor are plain sums (the model moves fast early; torch's hook does the same).
- Vectors, and matrices too small to gain ((n + m) r >= n m / min_compression_rate), travel as plain sums.

Every worker receives the same bytes of P's and Q's sums and orthogonalises P alike, so every worker computes the same
bits of P Q^T: the parameters stay identical across workers. As torch's hook does with a bucket, the matrices a
worker starts before it waits for any (a step's gradients) travel together: every P in one sum, then every Q in one,
each step taken on the compressor's thread as the sum before it arrives (`_Batch`). The second sum waits for the
first: two round trips a step, which the small size repays on slow links. Matrices it compresses never travel fused
with small gradients (torch/fusion.py's `plan`): each is P and Q, as torch's hook carries every matrix of a bucket.
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from gradwire.compression import Passthrough
from gradwire.errors import GradwireError
from gradwire.worker import Handle, Worker
from gradwire.worker.work import divisor

log = logging.getLogger("gradwire.compression")


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
        self._begun = False  # a tensor has been compressed (said once, as torch's hook says its config)
        # what a user sees in the first steps, said once as torch's PowerSGDState says its config
        log.info(
            "powersgd: rank %d; the first %d steps of each tensor are plain sums (as torch's start_powerSGD_iter), "
            "then each matrix of at least %g times its rank-%d size travels as P and Q",
            rank,
            start_iter,
            min_compression_rate,
            rank,
        )
        self._tensors: dict[tuple[int, str], _TensorState] = {}
        self._open: dict[int, _Batch] = {}  # by worker: the calls started and not yet waited for
        self._lock = threading.Lock()
        # moves batches on as their sums arrive (`later`); its thread starts with the first task
        self._advancer = ThreadPoolExecutor(1, thread_name_prefix="gw-powersgd")

    def later(self, task: Callable[[], None]) -> None:
        """Run `task` on this compressor's thread: a batch's next step once a sum of it arrived, off the receiving
        thread (which completes every call of the worker) and off the training thread (still in backward). Takes no
        lock of the compressor's: the receiving thread calls it, and a training thread adding to a batch a waiter holds
        waits, holding the compressor's lock, for a sum the receiving thread must deliver."""
        self._advancer.submit(task)

    def __repr__(self) -> str:
        return f"powersgd(rank={self.rank}, start_iter={self.start_iter}, warm_start={self.warm_start})"

    def applies(self, tensor: torch.Tensor, op: str, members: list[int] | None) -> bool:
        """A float32 matrix (or more dimensions) of a sum that rank r shrinks enough; else a plain sum."""
        if tensor.dim() < 2 or tensor.dtype != torch.float32 or op != "sum" or members is not None:
            return False
        n, m = tensor.shape[0], tensor.numel() // tensor.shape[0]
        return (n + m) * self.rank * self.min_compression_rate <= n * m

    def carries(self, param: torch.Tensor) -> bool:
        """Whether a parameter's gradient travels as P and Q (a sum over every worker): it is never fused into a
        group (DistributedOptimizer's fusion) or a sub-bucket (the DDP hook's), which would carry it whole."""
        return self.applies(param.detach(), "sum", None)

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
        if not self._begun:
            self._begun = True
            log.info("powersgd: compressing from step %d of %r on (plain sums before)", state.steps, name)
        output = tensor if inplace else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        call = _PowerSGDCall(self, state, source, output, name)
        call.divide_by = divisor(worker.size, average)
        with self._lock:
            batch = self._open.get(id(worker))
            if batch is None or not batch.add(call, priority):
                batch = self._open[id(worker)] = _Batch(self, worker)
                batch.add(call, priority)
        return call


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
    """One tensor's PowerSGD push_pull: its matrix (with its error feedback) waits in its worker's open batch; the
    batch's two sums carry it (`_Batch`)."""

    def __init__(
        self, sgd: PowerSGD, state: _TensorState, tensor: torch.Tensor, output: torch.Tensor, name: str
    ) -> None:
        self.sgd, self.state, self.output, self.name = sgd, state, output, name
        self.divide_by = 1  # the number of workers, for an average
        self.scale = 1.0  # applied to the result once (Horovod's postscale_factor)
        n = tensor.shape[0]
        # error feedback, on the host (the servers' side), in the residual's own memory: it becomes the next residual
        self.m = state.error.add_(tensor.detach().reshape(n, -1).cpu())
        if not sgd.warm_start:
            state.q = _random_q(self.m.shape[1], sgd.rank, state.seed, state.steps)
        self.p = self.m @ state.q
        self.q = state.q
        self.batch: _Batch | None = None

    def done(self) -> bool:
        assert self.batch is not None
        return self.batch.advance(wait=False)

    def start(self) -> None:
        """Send the batch's first sum now if it is not on its way (GradientSync does before it waits for anything)."""
        self.done()

    def result(self, worker: Worker) -> torch.Tensor:
        """Wait for the batch's sums; the approximation P Q^T (averaged) lands in `output`, the residual stays for the
        next step."""
        assert self.batch is not None
        self.batch.advance(wait=True)
        return self.output

    def finish(self, p: torch.Tensor, q: torch.Tensor) -> None:
        """P (orthogonalised) and Q's sum arrived: the approximation into `output`, the residual kept."""
        q = q / self.divide_by
        if self.sgd.warm_start:
            self.state.q = q
        with torch.no_grad():
            into = self.output
            if into.device.type == "cpu" and into.dtype == torch.float32 and into.is_contiguous():
                approx = torch.mm(p, q.t(), out=into.view(self.m.shape))  # no temporary of the gradient's size
            else:
                approx = p @ q.t()
                into.copy_(approx.view_as(into))
            self.m.sub_(approx)  # the residual: what this worker's gradient has that the update did not (torch's hook)
            if self.scale != 1.0:
                into.mul_(self.scale)


BATCH_BYTES = 1 << 20  # a batch whose matrices hold this much gradient leaves at once, without waiting to be waited for


class _Batch:
    """PowerSGD calls a worker started one after the other, carried by two sums, as torch's hook carries a bucket's:
    every P in one, then every Q in one. A batch leaves when its matrices hold BATCH_BYTES of gradient (a large layer's,
    during backward) or when one of its calls is first waited for or polled (the small rest of a step: two round trips
    whatever the number of matrices). Once it has left, each of its sums moves it on as it arrives, on the
    compressor's thread (`PowerSGD.later`): Q computed and sent, then the approximation and the residual made,
    overlapping the rest of backward, so the training thread mostly finds it done; a waiter that finds it short does
    the rest itself. Every worker starts the same tensors in the same order, so every worker's batches are the same;
    their sums are named after their members."""

    def __init__(self, sgd: PowerSGD, worker: Worker) -> None:
        self.sgd, self.worker = sgd, worker
        self.calls: list[_PowerSGDCall] = []
        self.priority = 0
        self.bytes = 0
        self.handle: Handle | None = None
        self.flat = torch.empty(0)  # the sum in flight (P's, then Q's)
        self.stage = "open"  # open -> p (P's sum in flight) -> q (Q's sum in flight) -> done
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def add(self, call: _PowerSGDCall, priority: int) -> bool:
        """Take `call` if the batch has not left; a tensor it holds already begins a new one (a step whose calls
        were never waited for, as after an elastic reset, is dropped whole rather than mixed into the next)."""
        if self.stage != "open":  # it left (read without the lock, which a waiter may hold for a round trip: the
            return False  # stage only moves on from "open")
        with self._lock:
            if self.stage != "open" or any(c.name == call.name for c in self.calls):
                return False
            call.batch = self
            self.calls.append(call)
            self.priority = max(self.priority, priority)
            self.bytes += call.m.numel() * call.m.element_size()
            if self.bytes >= BATCH_BYTES:
                self._advance(wait=False)
            return True

    def advance(self, wait: bool) -> bool:
        """Move the batch on as far as its sums allow (all the way, `wait`); whether it is done. Raises what failed."""
        with self._lock:
            return self._advance(wait)

    def _on_sum(self, handle: Handle) -> None:
        """A sum of the batch arrived (on the receiving thread): its next step on the compressor's thread."""
        self.sgd.later(self._advance_arrived)

    def _advance_arrived(self) -> None:
        """(The compressor's thread.) P's sum in: Q computed and sent; Q's sum in: the approximation and the residual
        made, so the training thread finds them done. Never waits: where a waiter holds the batch, it does the rest."""
        if self._lock.acquire(blocking=False):
            try:
                self._advance(wait=False)
            except GradwireError:
                pass  # kept in self.error for the waiter
            finally:
                self._lock.release()

    def _advance(self, wait: bool) -> bool:
        try:
            if self.stage == "open":
                self._push("p", torch.cat([c.p.reshape(-1) for c in self.calls]))
            if self.stage == "p" and self._arrived(wait):
                self._push("q", self._q_of(self.flat))
            if self.stage == "q" and self._arrived(wait):
                self._finish(self.flat)
        except BaseException as e:  # noqa: BLE001 - every member's waiter gets it
            self.error, self.stage = self.error or e, "done"
        if self.error is not None and (wait or self.stage == "done"):
            raise _as_gradwire(self.error, self.calls)
        return self.stage == "done"

    def _push(self, stage: str, flat: torch.Tensor) -> None:
        self.flat = flat.contiguous()  # the sum lands in it
        array = self.flat.numpy()
        name = _batch_name(self.calls, stage)
        self.handle = self.worker.push_pull_async(array, name, False, self.priority, out=array)
        self.stage = stage
        self.handle.add_done_callback(self._on_sum)

    def _arrived(self, wait: bool) -> bool:
        assert self.handle is not None
        if wait:
            self.worker.synchronize(self.handle)
            return True
        if not self.handle.done():
            return False
        if self.handle.error is not None:
            raise self.handle.error
        return True

    def _q_of(self, flat: torch.Tensor) -> torch.Tensor:
        """Each member's P (its share of the sum) orthogonalised, and its Q = M^T P, in one flat tensor."""
        qs, at = [], 0
        for call in self.calls:
            size = call.p.numel()
            call.p = _orthogonalise(flat[at : at + size].reshape(call.p.shape))
            at += size
            call.q = (call.p.t() @ call.m).t()  # M^T P, 20x faster this way round than m.t() @ p here
            qs.append(call.q.reshape(-1))
        return torch.cat(qs)

    def _finish(self, q_sum: torch.Tensor) -> None:
        at = 0
        for call in self.calls:
            size = call.q.numel()
            call.finish(call.p, q_sum[at : at + size].reshape(call.q.shape))
            at += size
        self.stage = "done"
        # a done batch needs none of this: its calls keep `batch` only to find it done, and with these kept a step's
        # calls, batch and handles would hold each other (the handle's callback too) until the garbage collector ran
        self.calls, self.handle, self.flat = [], None, torch.empty(0)


def _batch_name(calls: list[_PowerSGDCall], stage: str) -> str:
    """The same on every worker for the same members: the first's name, how many, and a checksum of them all."""
    names = "\0".join(f"{c.name}{list(c.m.shape)}" for c in calls)
    return f"{calls[0].name}+{len(calls) - 1}.powersgd.{zlib.crc32(names.encode()):08x}.{stage}"


def _as_gradwire(error: BaseException, calls: list[_PowerSGDCall]) -> GradwireError:
    if isinstance(error, GradwireError):
        return error
    names = ", ".join(repr(c.name) for c in calls)
    wrapped = GradwireError(f"PowerSGD of {names}: {error}")
    wrapped.__cause__ = error
    return wrapped
