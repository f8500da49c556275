"""What a key of the server-side optimizer holds (parameter-server mode, server/optimizer_op.py): its partition of the
parameters and of the optimizer's state, the bookkeeping of asynchronous mode and delay compensation, and the codec its
compressed gradient pushes are decoded with (protocol/update.py)."""

from __future__ import annotations

import numpy as np

from gradwire.errors import TensorError
from gradwire.protocol import compression, update
from gradwire.server.optimizer_steps import NumpyStep, TorchStep


class Held:
    """What a key of the optimizer holds: its parameters, the optimizer's state, and the asynchronous bookkeeping."""

    def __init__(self, args: dict, count: int, wire: np.dtype, num_workers: int) -> None:
        self.args = args  # the key's declared arguments (protocol/update.py check_args)
        self.asynchronous = args["staleness"] > 0
        self.m = count
        self.params = np.zeros(count, wire)
        self.scratch = np.empty(count, wire)
        self.trailer = [np.zeros(update.TRAILER_BYTES // 8), np.zeros(update.TRAILER_BYTES // 8)]  # per round buffer
        self.installed = False  # parameters arrived (INIT, a seed, or a write)
        self.round = -1  # the round whose result the parameters are (sync)
        self.restarts = 0  # times the optimizer state started afresh from seeded parameters (a failover)
        self.replica: int | None = None  # the server that replicates this key (server/replica.py)
        self.replicated = 0  # updates applied here as a replica
        self.stepper = self._new_stepper()
        # compressed gradient pushes: the partition's codec and its block's bytes (None, 0: pushes as they are)
        compressor = args.get("compressor")
        self.codec = compression.for_partition(compression.codec(compressor), count) if compressor else None
        self.block = self.codec.wire_bytes(count) if self.codec is not None else 0
        self.decoded = 0  # compressed gradient pushes decoded
        self.workers(num_workers)

    def decode(self, data: np.ndarray, out: np.ndarray, key: int, rnd: int, add: bool) -> np.ndarray:
        """A compressed gradient push's data (its block, as float32 words) decoded into (or, `add`, onto) `out`."""
        assert self.codec is not None
        self.codec.decode(data.view(np.uint8)[: self.block], out, key, rnd, add=add)
        self.decoded += 1
        return out

    def workers(self, num_workers: int) -> None:
        """Asynchronous bookkeeping for `num_workers` (afresh after an elastic reset)."""
        self.pushes = [0] * num_workers  # gradients applied, per worker
        self.seen = [0] * num_workers  # updates applied when each worker was last answered
        self.held: dict[int, tuple[int, int]] = {}  # worker -> (round, pull slot) of an answer held back
        self.staleness_max = 0
        self.staleness_sum = 0
        self.dc_lambda = float(self.args.get("delay_compensation", 0.0))
        self.compensated = 0  # pushes corrected for their delay (delay compensation)
        # delay compensation: the parameters each worker was last answered with, and whether it has been since they
        # were installed (module docstring); a scratch for the corrected gradient
        self.answered = np.zeros((num_workers, self.m), self.params.dtype) if self.dc_lambda else None
        self.known = [False] * num_workers
        self.dc_scratch = np.empty(self.m, self.params.dtype) if self.dc_lambda else None

    def remember(self, worker: int) -> None:
        """Worker `worker` is answered with the parameters as they are now (delay compensation's w_old)."""
        if self.answered is not None:
            np.copyto(self.answered[worker], self.params)
            self.known[worker] = True

    def compensate(self, worker: int, grad: np.ndarray) -> np.ndarray:
        """`grad` from `worker`, corrected for the parameters' move since it was last answered (a scratch), or
        itself where there is nothing to correct by."""
        if self.answered is None or not self.known[worker]:
            return grad
        d = self.dc_scratch
        assert d is not None
        np.subtract(self.params, self.answered[worker], out=d)  # w_now - w_old
        d *= grad
        d *= grad
        d *= self.dc_lambda
        d += grad
        self.compensated += 1
        return d

    def _new_stepper(self) -> NumpyStep | TorchStep:
        impl = TorchStep if self.args["impl"] == "torch" else NumpyStep
        return impl(self.args, self.params)

    def install(self, params: np.ndarray) -> None:
        """New parameters; the optimizer's state starts afresh (as a new torch optimizer's)."""
        np.copyto(self.params, params)
        self.stepper = self._new_stepper()
        self.installed = True
        self.known = [False] * len(self.known)  # nobody was answered with these yet (delay compensation)

    def read(self, which: int) -> np.ndarray:
        """Tensor `which` (protocol/update.py) as a copy: parameters, a state tensor (zeros if absent), the count."""
        names = self.stepper.names
        if which == 0:
            return self.params.copy()
        if 1 <= which <= len(names):
            value = self.stepper.read(names[which - 1])
            return np.zeros_like(self.params) if value is None else np.array(value, self.params.dtype)
        if which == len(names) + 1:
            return np.full_like(self.params, self.stepper.count)
        raise TensorError(f"no tensor {which} in the state of a {self.args['algorithm']} key")

    def write(self, which: int, data: np.ndarray) -> None:
        """Tensor `which` takes `data` (-1: the parameters, with the optimizer's state afresh)."""
        names = self.stepper.names
        if which == -1:
            self.install(data)
        elif which == 0:
            np.copyto(self.params, data)
            self.installed = True
        elif 1 <= which <= len(names):
            self.stepper.write(names[which - 1], data)
        elif which == len(names) + 1:
            self.stepper.set_count(int(data[0]) if len(data) else 0)
        else:
            raise TensorError(f"no tensor {which} in the state of a {self.args['algorithm']} key")

    @property
    def nbytes(self) -> int:
        return self.params.nbytes + self.stepper.nbytes + self.dc_bytes

    @property
    def dc_bytes(self) -> int:
        """What delay compensation holds: the parameters each worker was last answered with, and a scratch."""
        if self.answered is None or self.dc_scratch is None:
            return 0
        return self.answered.nbytes + self.dc_scratch.nbytes
