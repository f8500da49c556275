"""A DDP communication hook: `model.register_comm_hook(state, gradwire.torch.push_pull_hook)`.

DDP hands the hook a bucket of flattened gradients and expects a Future of the reduced bucket. DDP rebuilds its
buckets after the first iteration, so a bucket's index is not a stable name: the hook names each bucket by its
parameters' names (given through `PushPullHookState`), so every worker's push_pull of a bucket meets the same
tensor on the servers.
"""

# No `from __future__ import annotations`: DDP checks `bucket: dist.GradBucket` at runtime.
import hashlib

import torch.distributed as dist

import gradwire
import torch
from gradwire.worker import Worker

from .compression import Compression, Compressor
from .ops import push_pull_async


class PushPullHookState:
    """What the hook needs: parameter names (by identity), compression, and the worker."""

    __slots__ = ("compression", "names", "worker")

    def __init__(
        self, model: torch.nn.Module, compression: type[Compressor] = Compression.none, worker: "Worker | None" = None
    ) -> None:
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.compression = compression
        self.worker = worker or gradwire.current_worker()


def push_pull_hook(state: PushPullHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over all workers through the summation servers; returns a Future of the bucket."""
    names = sorted(state.names[id(p)] for p in bucket.parameters())
    digest = hashlib.blake2b("\n".join(names).encode(), digest_size=8).hexdigest()
    buffer = bucket.buffer()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    handle = push_pull_async(
        buffer, average=True, name=f"ddp.{digest}", compression=state.compression, worker=state.worker
    )

    def complete(_: object) -> None:
        try:
            future.set_result(handle.result(state.worker))
        except Exception as e:  # noqa: BLE001 - delivered to DDP through the future
            future.set_exception(e)

    handle.handle.add_done_callback(complete)
    return future
