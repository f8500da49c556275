"""What a worker's link to a server holds, declared once for its two halves (worker/pushes.py, worker/answers.py),
which `ServerLink` (worker/link.py) joins and fills in."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gradwire.admin.metrics import Metrics
    from gradwire.admin.timeline import Timeline
    from gradwire.errors import GradwireError
    from gradwire.transport import shm, tcp
    from gradwire.worker.credit import Credit
    from gradwire.worker.flow import Flow
    from gradwire.worker.holding import Holds
    from gradwire.worker.work import Seed


class LinkState:
    """The link's state (worker/link.py sets it), and what either half may call of the whole."""

    conn: tcp.Connection
    server: int
    rank: int
    epoch: int
    flow: Flow  # the queue and the rule, guarded by `_lock`
    credit: Credit
    network: bool  # bytes cross a socket
    arena: shm.Arena | None  # shared slots (a link to a server on this host)
    seeds: dict[int, Seed] | None  # failover on: each key's last sum
    holds: Holds
    metrics: Metrics
    timeline: Timeline | None
    _lock: threading.Lock
    _closed: BaseException | None
    lost: BaseException | None  # the server died; its work is kept for the failover
    _free_push: list[int]  # the shared slots free (the loop's)
    _free_pull: list[int]
    dirty: bool  # something changed that may let it push (see LinkLoop)

    def _broken(self, error: GradwireError) -> None:
        raise NotImplementedError

    def close(self, reason: BaseException) -> None:
        raise NotImplementedError
