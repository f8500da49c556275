"""Shared-memory slots between a worker and a server on the same host.

Why: on one host, a socket moves every byte through the kernel twice (copy in, copy out), and the summation
service moves 8S bytes per step where a ring moves 6S; on this 2-core machine both systems ran at ~4 GB/s of
kernel copies, which capped gradwire at ~0.75x gloo for 64 MiB. With shared memory a push is one memcpy into a
slot the server sums from directly, and a pull is the server's memcpy into a slot and the worker's memcpy out.

The worker creates the file in /dev/shm (mode 0600), the server maps it, and the worker unlinks it as soon as the
server confirms: after that nothing is left behind, whoever crashes. Layout: `push` slots, then `pull` slots, each
`slot_bytes` long. The header of a frame says which slot holds its payload (`status`: push slot in the low 16
bits, pull slot in the high 16; NO_SLOT for none).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

NO_SLOT = 0xFFFF
SHM_DIR = "/dev/shm"


class Arena:
    """The mapped slots of one worker-server link. Owned by the link; views stay valid until `close`."""

    def __init__(self, path: str, push: int, pull: int, slot_bytes: int, create: bool) -> None:
        if push + pull >= NO_SLOT:
            raise ValueError(f"at most {NO_SLOT - 1} slots, got {push + pull}")
        self.path, self.push, self.pull, self.slot_bytes = path, push, pull, slot_bytes
        size = (push + pull) * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"shared memory {path} has {os.fstat(fd).st_size} bytes, expected {size}")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._bytes = np.frombuffer(self._map, np.uint8)

    @classmethod
    def create(cls, push: int, pull: int, slot_bytes: int) -> Arena:
        """A new arena in /dev/shm with a fresh name (the worker's side)."""
        path = os.path.join(SHM_DIR, f"gradwire-{os.getpid()}-{os.urandom(8).hex()}")
        return cls(path, push, pull, slot_bytes, create=True)

    @property
    def memory(self) -> np.ndarray:
        """Every slot's bytes (uint8): push slots, then pull slots."""
        return self._bytes

    def push_slot(self, index: int, length: int) -> np.ndarray:
        """Bytes [0, length) of push slot `index`."""
        start = index * self.slot_bytes
        return self._bytes[start : start + length]

    def pull_slot(self, index: int, length: int) -> np.ndarray:
        """Bytes [0, length) of pull slot `index`."""
        start = (self.push + index) * self.slot_bytes
        return self._bytes[start : start + length]

    def unlink(self) -> None:
        """Remove the file; the mapping lives on until both sides close it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._bytes = np.empty(0, np.uint8)
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still referenced somewhere; the mapping goes when it does
