"""The scheduler role: rendezvous, declarations and placement, barriers, membership."""

from gradwire.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
