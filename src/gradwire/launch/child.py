"""One process of a job under `gradwire launch`: its role and rank, and the lines it prints."""

from __future__ import annotations

import queue
import subprocess
from dataclasses import dataclass, field


@dataclass
class Child:
    """One process of the job."""

    role: str
    rank: int
    proc: subprocess.Popen
    lines: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    @property
    def label(self) -> str:
        return f"{self.role} {self.rank}" if self.role != "scheduler" else "scheduler"  # the first scheduler's
