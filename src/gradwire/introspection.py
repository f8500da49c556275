"""What Horovod scripts ask about the job and the library, answered truthfully for gradwire (every framework's adapter).

gradwire is built on neither MPI, Gloo, NCCL, oneCCL, DDL nor ROCm: the `*_built` and `*_enabled` questions answer
False (a script that branches on them takes its generic path). `cuda_built` is False too: gradwire has no CUDA
kernels; CUDA tensors are staged through host memory to the CPU servers (torch/ops.py).
"""

from __future__ import annotations

from typing import Any

from gradwire.errors import JobAborted
from gradwire.session import current_worker

# Horovod raises HorovodInternalError (a RuntimeError) when a collective fails because a rank failed; gradwire's
# JobAborted (WorkerLost, ...) is that error. `except hvd.HorovodInternalError` catches it.
HorovodInternalError = JobAborted


def _false(*args: Any) -> bool:
    return False


mpi_built = mpi_enabled = gloo_built = gloo_enabled = nccl_built = ccl_built = ddl_built = _false
cuda_built = rocm_built = _false


def mpi_threads_supported() -> bool:
    """Horovod: whether MPI allows several threads. gradwire has no MPI; its API may be called from any thread."""
    return False


def cross_size() -> int:
    """The number of hosts that run workers."""
    return len(set(current_worker().hosts)) or 1


def cross_rank() -> int:
    """The index of this worker's host among the hosts that run workers (in order of their first worker)."""
    worker = current_worker()
    hosts = list(dict.fromkeys(worker.hosts))
    return hosts.index(worker.hosts[worker.rank]) if hosts else 0


def is_homogeneous() -> bool:
    """True when every host runs the same number of workers."""
    hosts = current_worker().hosts
    counts = {hosts.count(h) for h in set(hosts)}
    return len(counts) <= 1


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing this worker's timeline to `file_path` (Chrome trace, as GRADWIRE_TIMELINE; docs/timeline.md).
    `mark_cycles` is accepted for Horovod's signature: gradwire marks each step."""
    current_worker().start_timeline(file_path)


def stop_timeline() -> None:
    """Stop writing the timeline."""
    current_worker().stop_timeline()


class ProcessSet:
    """Horovod's process set: a subset of ranks whose collectives run among themselves. On the servers, a tensor
    of a process set is its own (its name carries the ranks) and only those ranks contribute to its rounds."""

    def __init__(self, ranks: Any = None) -> None:
        self.ranks = None if ranks is None else sorted({int(r) for r in ranks})
        self.process_set_id: int | None = 0 if ranks is None else None  # given by add_process_set

    def size(self) -> int | None:
        if self.ranks is None:
            return current_worker().size
        return len(self.ranks) if self.process_set_id is not None else None

    def rank(self) -> int | None:
        if self.ranks is None:
            return current_worker().rank
        return self.ranks.index(current_worker().rank) if self.included() else -1

    def included(self) -> bool | None:
        return self.ranks is None or current_worker().rank in self.ranks

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet(id={self.process_set_id}, {self.ranks})"


global_process_set = ProcessSet()
_ids: list[int] = [0]


def add_process_set(process_set: Any) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of ranks) and return it with its id. As in Horovod every
    worker calls it, in the same order, with the same ranks; the ids follow that order."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None or not ps.ranks:
        raise ValueError("add_process_set needs a non-empty list of ranks")
    size = current_worker().size
    if ps.ranks[0] < 0 or ps.ranks[-1] >= size:
        raise ValueError(f"process set {ps.ranks}: ranks must lie in 0..{size - 1}")
    if ps.ranks == list(range(size)):
        raise ValueError(f"process set {ps.ranks} is the global process set")
    _ids[0] += 1
    ps.process_set_id = _ids[0]
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Deregister a process set; its tensors stay declared on the servers (they are small and rare). True if it
    was registered."""
    if process_set.ranks is None or process_set.process_set_id is None:
        return False
    process_set.process_set_id = None
    return True


def join(device: int = -1) -> int:
    """Horovod's join: this rank is out of data. The other ranks' allreduces go on with zeros in its place (an
    average still divides by every rank, as Horovod's does); an allgather or broadcast among them fails with a
    RuntimeError, as Horovod's does. Blocks until every rank has joined; returns the last rank to join, the same on
    every rank. `device` is accepted for Horovod's signature (the servers are CPU processes)."""
    return current_worker().join()
