"""Parameter-server mode on the numpy API, in the shape of MXNet's KVStore (docs/ps-mode.md).

    gradwire.set_optimizer("sgd", lr=0.1, momentum=0.9)      # kv.set_optimizer(mx.optimizer.SGD(...))
    w = gradwire.init_parameter("w", w)                        # kv.init("w", w): worker 0's value, on every worker
    for step in ...:
        w = gradwire.update("w", grad(w), out=w)               # kv.push("w", g); kv.pull("w", out=w)

The servers hold each parameter and its optimizer state, and apply the update (numpy's formulas,
server/optimizer_op.py).
Calling set_optimizer again changes the hyper-parameters (a learning-rate schedule) from the next update on; the
algorithm, its structural arguments and the staleness are fixed per parameter when it is first used.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from gradwire.protocol import update as wire
from gradwire.session import current_worker
from gradwire.worker import Handle, Worker

STRUCTURAL_NAMES = {"amsgrad", "initial_accumulator_value"}


@dataclass
class _Setting:
    args: dict
    hyper: list[float]


_settings: weakref.WeakKeyDictionary[Worker, _Setting] = weakref.WeakKeyDictionary()


def _worker() -> Worker:
    return current_worker()


def set_optimizer(
    optimizer: str, staleness: int = 0, delay_compensation: float = 0.0, compression: object = None, **hyper: object
) -> None:
    """The servers' optimizer for this worker's next updates: "sgd", "adam", "adamw" or "adagrad", with torch.optim's
    hyper-parameter names (lr, momentum, betas or beta1/beta2, eps, weight_decay, ...). `staleness` 0: synchronous;
    s > 0: asynchronous, at most s updates ahead of the slowest worker; then `delay_compensation` lambda > 0 corrects
    each stale gradient on the servers (docs/ps-mode.md). `compression`: a compressor the servers run
    (gradwire.compression.onebit(), topk(...), ...) for the gradients pushed (float32 parameters of at least
    GRADWIRE_COMPRESSION_MIN_BYTES), with this worker's error feedback; the parameters come back as they are. Every
    worker sets the same."""
    if "betas" in hyper:
        hyper["beta1"], hyper["beta2"] = hyper.pop("betas")  # type: ignore[misc]
    args: dict = {"algorithm": optimizer, "impl": "numpy", "staleness": staleness}
    if delay_compensation:
        args["delay_compensation"] = delay_compensation
    if compression is not None:
        args["compressor"] = server_compressor(compression)
    args.update({k: hyper.pop(k) for k in list(hyper) if k in STRUCTURAL_NAMES})
    args = wire.check_args(args)
    values = wire.hyper_values(optimizer, hyper)
    _settings[_worker()] = _Setting(args, values)


def server_compressor(compression: object) -> dict | None:
    """A server-side optimizer's compressor: the arguments of one the servers run (gradwire.compression), or None for
    none; ValueError for one they cannot decode (float16, PowerSGD: their sums are not a gradient's encoding)."""
    if compression is None or getattr(compression, "__name__", "") in ("NoneCompressor", "DefaultCompressor"):
        return None
    args = getattr(compression, "args", compression)
    if not isinstance(args, dict):
        raise ValueError(
            f"a server-side optimizer decodes onebit, topk, randomk or dithering (gradwire.compression), not "
            f"{compression!r}: its gradients are not all-reduced, so float16 and PowerSGD do not apply"
        )
    return wire.check_args({"algorithm": "sgd", "compressor": args})["compressor"]


def _setting(worker: Worker) -> _Setting:
    setting = _settings.get(worker)
    if setting is None:
        raise RuntimeError("call gradwire.set_optimizer(...) before init_parameter or update")
    return setting


def init_parameter(name: str, value: np.ndarray) -> np.ndarray:
    """Put parameter `name` on its servers (collective: worker 0's value wins) and return it (a new array, the same
    on every worker)."""
    worker = _worker()
    out = np.array(value, copy=True, order="C")
    worker.synchronize(worker.update_async(out, name, out, _setting(worker).args, wire.INIT))
    return out


def update_async(name: str, grad: np.ndarray, out: np.ndarray) -> Handle:
    """Push `grad` for parameter `name`; its new values land in `out` (see `update`)."""
    worker = _worker()
    setting = _setting(worker)
    return worker.update_async(grad, name, out, setting.args, wire.GRAD, setting.hyper)


def update(name: str, grad: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Push `grad` for parameter `name` and return its new values (in `out`, or a new array): the servers average
    every worker's gradient and step the optimizer (synchronous), or apply this one as it arrives (asynchronous)."""
    out = np.empty_like(grad, order="C") if out is None else out
    worker = _worker()
    return worker.synchronize(update_async(name, grad, out))


def optimizer_state(name: str, like: np.ndarray) -> dict[str, np.ndarray | int]:
    """Parameter `name`'s values and optimizer state as its servers hold them (`like`: an array of its shape and
    dtype): {"params", each state tensor by torch.optim's name, "count": updates applied}."""
    worker = _worker()
    args = _setting(worker).args
    names = ["params", *wire.state_names(args), "count"]
    out: dict[str, np.ndarray | int] = {}
    for which, key in enumerate(names):
        buf = np.empty_like(like, order="C")
        worker.synchronize(worker.update_async(None, name, buf, args, wire.READ, which=which))
        out[key] = int(buf.reshape(-1)[0]) if key == "count" and buf.size else buf
    return out
