"""What Horovod scripts ask about the job and the library, answered truthfully for gradwire.

gradwire is built on neither MPI, Gloo, NCCL, oneCCL, DDL nor ROCm: the `*_built` and `*_enabled` questions answer
False (a script that branches on them takes its generic path). `cuda_built` is False too: gradwire has no CUDA
kernels; CUDA tensors are staged through host memory to the CPU servers (torch/ops.py).
"""

from __future__ import annotations

from typing import Any

import gradwire
from gradwire.errors import JobAborted

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
    return len(set(gradwire.current_worker().hosts)) or 1


def cross_rank() -> int:
    """The index of this worker's host among the hosts that run workers (in order of their first worker)."""
    worker = gradwire.current_worker()
    hosts = list(dict.fromkeys(worker.hosts))
    return hosts.index(worker.hosts[worker.rank]) if hosts else 0


def is_homogeneous() -> bool:
    """True when every host runs the same number of workers."""
    hosts = gradwire.current_worker().hosts
    counts = {hosts.count(h) for h in set(hosts)}
    return len(counts) <= 1


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing this worker's timeline to `file_path` (Chrome trace, as GRADWIRE_TIMELINE; docs/timeline.md).
    `mark_cycles` is accepted for Horovod's signature: gradwire marks each step."""
    gradwire.current_worker().start_timeline(file_path)


def stop_timeline() -> None:
    """Stop writing the timeline."""
    gradwire.current_worker().stop_timeline()


class ProcessSet:
    """Horovod's process set: a subset of ranks that runs collectives among itself. gradwire runs every collective
    over all workers for now: only the global process set exists (docs/horovod.md)."""

    def __init__(self, ranks: Any = None) -> None:
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id = 0 if ranks is None else None

    def size(self) -> int:
        return gradwire.size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        return gradwire.rank() if self.ranks is None else self.ranks.index(gradwire.rank())

    def included(self) -> bool:
        return self.ranks is None or gradwire.rank() in self.ranks

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet()


def add_process_set(process_set: Any) -> ProcessSet:
    """Not supported yet: collectives among a subset of workers (docs/horovod.md)."""
    raise ValueError("gradwire runs every collective over all workers: process sets are not supported yet")


def remove_process_set(process_set: Any) -> bool:
    """Not supported yet (see add_process_set)."""
    raise ValueError("gradwire runs every collective over all workers: process sets are not supported yet")
