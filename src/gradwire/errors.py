"""The one exception hierarchy of gradwire.

::

    GradwireError                      base of everything gradwire raises
    ├── ConfigError                    the environment or arguments are wrong (before any I/O)
    ├── ProtocolError                  bytes on the wire broke the protocol
    │   ├── LocalProtocolError         ...and it was our side (a bug, or misuse of an internal API)
    │   └── RemoteProtocolError        ...and it was the peer (bad frame, wrong version, bad length)
    ├── AuthenticationError            the peer does not know the job secret
    ├── TensorError                    a tensor is declared or used inconsistently (name, shape, dtype)
    ├── JobAborted                     another node failed; this call cannot finish (carries the reason)
    │   └── WorkerLost                 ...because a worker died or dropped out (carries its rank)
    └── GradwireTimeout                a blocking call ran past its deadline (also a TimeoutError)

Every error carries what is known of where it happened (role, rank, tensor, key, round, peer), and its
message states the values and, where one exists, the fix.
"""

from __future__ import annotations


class GradwireError(Exception):
    """Base class of every error gradwire raises."""

    def __init__(self, message: str, **context: object) -> None:
        self.context = {k: v for k, v in context.items() if v is not None}
        super().__init__(message)

    def __reduce__(self) -> tuple:
        # pickled with its context (Ray and multiprocessing carry errors between processes): the default would
        # call the class with the message alone, which WorkerLost (lost_rank required) cannot take
        return _rebuild, (type(self), str(self), self.context)


class ConfigError(GradwireError):
    """The configuration (environment, arguments) is invalid."""


class ProtocolError(GradwireError):
    """A frame or message violated the wire protocol."""


class LocalProtocolError(ProtocolError):
    """Our own side tried to do something the protocol forbids."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids; the connection is closed."""


class AuthenticationError(GradwireError):
    """The peer failed the HMAC challenge-response: it does not hold the job secret."""


class TensorError(GradwireError, ValueError):
    """A tensor is declared or used inconsistently across workers or calls (a ValueError, as Horovod's are)."""


class TensorMismatch(TensorError, RuntimeError):
    """Workers called one collective with different shapes, dtypes or arguments (a RuntimeError too: Horovod raises
    one for this, on every rank)."""


class NotSupported(TensorError, NotImplementedError):
    """A collective or operation gradwire does not carry (Adasum); a NotImplementedError, so a RuntimeError too, as
    Horovod raises for an operation its backend lacks."""


class JobAborted(GradwireError):
    """The job was aborted by another node's failure; the reason names the node."""


class WorkerLost(JobAborted):
    """A worker of the job died or dropped out mid-job; `lost_rank` says which. Sync rounds cannot finish."""

    def __init__(self, message: str, lost_rank: int, **context: object) -> None:
        self.lost_rank = lost_rank
        super().__init__(message, lost_rank=lost_rank, **context)


def _rebuild(cls: type[GradwireError], message: str, context: dict) -> GradwireError:
    error = cls.__new__(cls)
    GradwireError.__init__(error, message, **context)
    if "lost_rank" in context:  # the attribute WorkerLost keeps
        error.lost_rank = context["lost_rank"]  # type: ignore[attr-defined]
    return error


def abort_error(body: dict, **context: object) -> JobAborted:
    """The error an abort message means: WorkerLost when it names a lost worker, else JobAborted."""
    message = f"job aborted: {body.get('message')}"
    if body.get("lost_role") == "worker" and isinstance(body.get("lost_rank"), int):
        return WorkerLost(message, body["lost_rank"], **context)
    return JobAborted(message, **context)


class MembershipChanged(GradwireError):
    """Elastic mode: the job's workers changed (one was lost, or new ones are joining) and this worker's calls in
    flight were cancelled. `gradwire.torch.elastic.run` catches it, restores the last commit, and re-forms the job;
    without it, call `reset()` on the worker and go on. `lost_rank` names the lost worker (None for joins)."""

    def __init__(self, message: str, lost_rank: int | None = None, **context: object) -> None:
        self.lost_rank = lost_rank
        super().__init__(message, lost_rank=lost_rank, **context)


class WorkersJoining(GradwireError):
    """Elastic mode: new workers wait to join; raised by `state.commit()` so the job re-forms at a commit (nothing
    to roll back). The shape of Horovod's HostsUpdatedInterrupt."""


class GradwireTimeout(GradwireError, TimeoutError):
    """A blocking call ran past its deadline."""
