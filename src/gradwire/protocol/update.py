"""Server-side updates (parameter-server mode, docs/ps-mode.md): the optimizers, and what each push carries.

A tensor declared with the per-key operation `optimizer` holds its parameters and optimizer state on its servers. Each
push of one of its partitions carries the partition's data (gradients, or parameters) followed by a trailer of
TRAILER_BYTES: eight float64 values, `kind`, `which`, and the algorithm's hyper-parameters for this push in the order
of HYPER[algorithm]. Hyper-parameters travel with every push (64 bytes a partition), so a learning-rate schedule on
the workers' side takes effect at exactly the step it is set for, with no message that could overtake a push.

Kinds: GRAD (the data are gradients: the round's sum is averaged and applied, the answer is the new parameters), INIT
(the data are parameters: the first member's are installed, the optimizer state starts afresh), READ (no data: the
server answers the sender alone with one of the key's tensors, `which`: 0 the parameters, then STATE[algorithm] in
order, then the step count), WRITE (the data are that tensor's new values; the answer is the parameters).

Structural arguments (the algorithm, `amsgrad`, Adagrad's initial accumulator, the staleness bound, delay compensation's
lambda, the compressor, the implementation) are declared once with the tensor (`op_args`) and checked across workers
like its shape.

Compressed pushes (a float32 tensor declared with `compressor`: protocol/compression.py's arguments): a GRAD push's
data is the partition's block of that compressor (`compression.for_partition(...).wire_bytes(n)` bytes, encoded by the
worker with its own error feedback), then the trailer; the server decodes it where it would add the gradient. Every
other push (INIT, WRITE, a seed) and every answer carries the parameters as they are.
"""

from __future__ import annotations

import numpy as np

from gradwire.protocol import compression

TRAILER_BYTES = 64
GRAD, INIT, READ, WRITE = 0, 1, 2, 3

# per-push hyper-parameters, in trailer order (at most 6), with torch.optim's defaults
HYPER: dict[str, dict[str, float]] = {
    "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": 0.0, "maximize": 0.0},
    "adam": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "maximize": 0.0},
    "adamw": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2, "maximize": 0.0},
    "adagrad": {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0, "eps": 1e-10, "maximize": 0.0},
}
# declared once per tensor, with their defaults
STRUCTURAL: dict[str, dict[str, object]] = {
    "sgd": {},
    "adam": {"amsgrad": False},
    "adamw": {"amsgrad": False},
    "adagrad": {"initial_accumulator_value": 0.0},
}
# the optimizer state of one parameter, with torch.optim's names (then a count of updates: torch's `step`)
STATE: dict[str, tuple[str, ...]] = {
    "sgd": ("momentum_buffer",),
    "adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "adagrad": ("sum",),
}
HAS_STEP = {"sgd": False, "adam": True, "adamw": True, "adagrad": True}
IMPLS = ("torch", "numpy")
DTYPES = ("float32", "float64")


def state_names(args: dict) -> list[str]:
    """The state tensors a key of this optimizer holds (Adam's max_exp_avg_sq only with amsgrad)."""
    algorithm = args["algorithm"]
    names = list(STATE[algorithm])
    if algorithm in ("adam", "adamw") and not args.get("amsgrad"):
        names.remove("max_exp_avg_sq")
    return names


def check_args(args: object) -> dict:
    """The declared arguments, complete and canonical; ValueError saying what is wrong."""
    if not isinstance(args, dict):
        raise ValueError(f"optimizer arguments must be a dict, got {args!r}")
    algorithm = args.get("algorithm")
    if algorithm not in HYPER:
        raise ValueError(f"unknown optimizer {algorithm!r}; gradwire's servers run {', '.join(sorted(HYPER))}")
    out: dict[str, object] = {"algorithm": algorithm}
    for name, default in STRUCTURAL[algorithm].items():
        value = args.get(name, default)
        out[name] = bool(value) if isinstance(default, bool) else float(value)  # type: ignore[arg-type]
    staleness = args.get("staleness", 0)
    if not isinstance(staleness, int) or isinstance(staleness, bool) or not 0 <= staleness <= 1 << 20:
        raise ValueError(f"staleness must be an int >= 0, got {staleness!r}")
    out["staleness"] = staleness
    dc = args.get("delay_compensation", 0.0)
    if not isinstance(dc, int | float) or isinstance(dc, bool) or not 0 <= dc < float("inf"):
        raise ValueError(f"delay_compensation must be a number >= 0, got {dc!r}")
    if dc and not staleness:
        raise ValueError("delay_compensation corrects stale gradients: it needs asynchronous mode (staleness > 0)")
    if dc:  # absent when off: a key without it is declared exactly as before it existed
        out["delay_compensation"] = float(dc)
    if args.get("compressor") is not None:  # absent when off, as delay compensation
        out["compressor"] = compression.check_args(args["compressor"])
    impl = args.get("impl", "numpy")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    out["impl"] = impl
    unknown = set(args) - set(out) - {"delay_compensation", "compressor"}
    if unknown:
        raise ValueError(f"unknown arguments for {algorithm}: {', '.join(sorted(unknown))}")
    return out


def hyper_values(algorithm: str, hyper: dict) -> list[float]:
    """The trailer's hyper-parameter values, in order; ValueError naming an unknown one."""
    names = HYPER[algorithm]
    unknown = set(hyper) - set(names)
    if unknown:
        raise ValueError(f"{algorithm} has no hyper-parameter {', '.join(sorted(unknown))}; it has {', '.join(names)}")
    return [float(hyper.get(n, d)) for n, d in names.items()]


def trailer(kind: int, which: int = 0, values: list[float] | None = None) -> np.ndarray:
    """The 64-byte trailer of one push."""
    out = np.zeros(TRAILER_BYTES // 8, np.float64)
    out[0], out[1] = kind, which
    if values:
        out[2 : 2 + len(values)] = values
    return out
