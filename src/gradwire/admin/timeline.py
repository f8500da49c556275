"""A worker's timeline: Chrome trace events (JSON object format), one per partition per stage.

Open it in chrome://tracing or https://ui.perfetto.dev (docs/timeline.md). Bounded: only the last `steps` steps are
kept (a step begins when the worker goes from no push_pull in flight to one), so files stay small in long jobs.
Always valid: a writer thread rewrites the whole file about once a second through a temporary file and an atomic
rename, so a crash or a SIGKILL leaves the last complete version, and shutdown (or Ctrl-C, through atexit) writes
the final one.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections import deque


def path_for(template: str, rank: int) -> str:
    """The file of one worker: `{rank}` in the template is replaced, else `.rank<r>` goes before the extension."""
    if "{rank}" in template:
        return template.format(rank=rank)
    root, ext = os.path.splitext(template)
    return f"{root}.rank{rank}{ext or '.json'}"


class Timeline:
    """Collects events in memory (thread-safe) and keeps the file current."""

    def __init__(
        self, path: str, rank: int, steps: int = 20, tracks: dict[int, str] | None = None, skew: float = 0.0
    ) -> None:
        """`skew`: seconds to add to this host's wall clock to get the job's (the scheduler's), so that every
        worker's trace, from any host, lies on one time base and opens side by side in one viewer."""
        self.path, self.rank = path, rank
        # events come stamped with time.monotonic(); the trace is in microseconds of the job's wall clock
        self._offset = time.time() - time.monotonic() + skew
        self._steps: deque[list[dict]] = deque(maxlen=max(1, steps))
        self._steps.append([])
        self._meta = [{"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"worker {rank}"}}]
        for tid, name in (tracks or {}).items():
            self._meta.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
        self._lock = threading.Lock()
        self._dirty = True
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._writer, name="gw-timeline", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        self.flush()

    def new_step(self) -> None:
        with self._lock:
            self._steps.append([])

    def complete(self, name: str, start: float, end: float, tid: int, args: dict) -> None:
        """A finished stage: `start`/`end` from time.monotonic()."""
        event = {
            "ph": "X",
            "name": name,
            "ts": (start + self._offset) * 1e6,
            "dur": max(0.0, end - start) * 1e6,
            "pid": self.rank,
            "tid": tid,
            "args": args,
        }
        with self._lock:
            self._steps[-1].append(event)
            self._dirty = True

    def partition(
        self,
        tensor: str,
        key: int,
        round: int,
        nbytes: int,
        stages: tuple[tuple[str, float, float], ...],
        tid: int,
        done: float,
        in_flight: int,
    ) -> None:
        """One answered partition: its stages (name, start, end) on track `tid` (its server), named by tensor, key,
        round and bytes, and the bytes in flight as it was answered."""
        args = {"tensor": tensor, "key": f"{key:016x}", "bytes": nbytes, "round": round}
        for name, start, end in stages:
            self.complete(name, start, end, tid, args)
        self.counter("bytes in flight", done, in_flight)

    def counter(self, name: str, at: float, value: float) -> None:
        event = {"ph": "C", "name": name, "ts": (at + self._offset) * 1e6, "pid": self.rank, "args": {"bytes": value}}
        with self._lock:
            self._steps[-1].append(event)
            self._dirty = True

    def flush(self) -> None:
        """Write the file now (atomically)."""
        with self._lock:
            events = self._meta + [e for step in self._steps for e in step]
            self._dirty = False
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, self.path)

    def close(self) -> None:
        """Stop the writer and write the final file. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(5)
        self.flush()
        atexit.unregister(self.close)

    def _writer(self) -> None:
        while not self._closed.wait(1.0):
            if self._dirty:
                try:
                    self.flush()
                except OSError:
                    time.sleep(1.0)
