"""The worker role: partitioning, placement lookup, priority and credit scheduling, pipelined push/pull."""

from gradwire.worker.handle import Handle
from gradwire.worker.worker import Worker

__all__ = ["Handle", "Worker"]
