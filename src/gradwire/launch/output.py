"""The launcher's output: children's lines, prefixed, and a live progress line.

On a terminal with rich installed (the `cli` extra), the progress line is a rich status line that stays at the
bottom while the children's lines scroll above it. On a terminal without rich it is rewritten in place with a
carriage return; when the output goes to a file or a pipe it is a plain line every `PLAIN_EVERY` updates.
Thread-safe: children's pump threads and the progress thread write concurrently.
"""

from __future__ import annotations

import signal
import sys
import threading

from gradwire.config import Config

PLAIN_EVERY = 10  # with output to a file, one progress line per this many updates (20 s at 2 s each)


class Output:
    """Plain output: prefixed lines; the progress line rewritten in place on a terminal, else now and then."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self._lock = threading.Lock()
        self._updates = 0

    def line(self, text: str) -> None:
        with self._lock:
            sys.stdout.write(("\r\x1b[K" if self.tty else "") + text.rstrip("\n") + "\n")
            sys.stdout.flush()

    def progress(self, text: str) -> None:
        with self._lock:
            self._updates += 1
            if self.tty:
                sys.stdout.write(f"\r\x1b[K{text}")
            elif self._updates % PLAIN_EVERY == 1:
                sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def close(self) -> None:
        if self.tty:
            with self._lock:
                sys.stdout.write("\r\x1b[K")
                sys.stdout.flush()


class RichOutput(Output):
    """On a terminal with rich: the progress line is a status line pinned below the scrolling output."""

    def __init__(self) -> None:
        from rich.console import Console

        super().__init__()
        self.console = Console(highlight=False)
        self.status = self.console.status("[gradwire launch] starting", spinner="dots")
        self.status.start()

    def line(self, text: str) -> None:
        from rich.text import Text

        self.console.print(Text(text.rstrip("\n")), soft_wrap=True)

    def progress(self, text: str) -> None:
        from rich.text import Text

        self.status.update(Text(text))

    def close(self) -> None:
        self.status.stop()


def make_output() -> Output:
    if sys.stdout.isatty():
        try:
            return RichOutput()
        except ImportError:
            pass
    return Output()


def how(code: int) -> str:
    """How a child process ended, from its return code."""
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def consequence(role: str) -> str:
    """What a node's failed exit means for the job, said after it."""
    if role == "scheduler":
        return "; the workers stop with an error naming it, unless a scheduler resumes the job in time"
    if role.endswith("server") and Config.from_env().server_failover:
        return "; its keys move to a standby or the other servers, and the workers resend what it lost"
    return ""


def progress_line(status: dict) -> str:
    """The live progress line, from the scheduler's /status."""
    workers = [n for n in status["nodes"] if n["role"] == "worker"]
    alive = sum(n["state"] == "alive" for n in workers)
    rate = sum(n["throughput_bytes_per_s"] for n in workers) / 1e6
    per_s = sum(n["rounds_per_s"] for n in workers) / max(len(workers), 1)  # from heartbeats, not our polls
    return (
        f"{status['phase']}: workers {alive}/{status['expected']['workers']} alive, "
        f"{per_s:.1f} push_pulls/s per worker, {rate:.1f} MB/s over all workers"
    )
