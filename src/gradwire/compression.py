"""Compressors that travel through the servers (docs/compression.md): `onebit`, `topk`, `randomk`, `dithering`.

Each returns a `Compressor`, passed as `compression=` to `gradwire.push_pull` and to the torch API
(`gradwire.torch.Compression.onebit(...)` is the same thing, beside Horovod's `Compression.fp16`). BytePS's spelling,
`compression_params={"compressor": "onebit", "ef": "vanilla", "momentum": "nesterov", "scaling": True, ...}` or its
`byteps_`-prefixed keys, is read by `from_byteps`.
"""

from __future__ import annotations

from typing import Any

from gradwire.protocol import compression


class Passthrough:
    """A compressor that leaves the tensor as it is in Horovod's shape (`compress`, `decompress`): what it does
    happens on the way to the servers (these) or in sums of its own (PowerSGD)."""

    wire_dtype = None

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, getattr(tensor, "dtype", None)

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class Compressor(Passthrough):
    """A compressor the servers understand: its checked arguments (`args`); the partitions are encoded on their way
    to the servers."""

    def __init__(self, **args: Any) -> None:
        try:
            self.args = compression.check_args(args)
        except ValueError as e:
            raise ValueError(str(e)) from None

    def __repr__(self) -> str:
        rest = ", ".join(f"{k}={v!r}" for k, v in self.args.items() if k != "method")
        return f"{self.args['method']}({rest})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Compressor) and other.args == self.args

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.args.items())))


def onebit(scaling: bool = True, ef: bool = True, momentum: float = 0.0) -> Compressor:
    """Signs and one scale per partition (32x); `scaling`: the scale is mean |g| (else 1)."""
    return Compressor(method="onebit", scaling=scaling, ef=ef, momentum=momentum)


def topk(k: float = 0.01, ef: bool = True, momentum: float = 0.0) -> Compressor:
    """The k largest |g| of each partition, with their indices; k a fraction (0.01) or a count per partition."""
    return Compressor(method="topk", k=k, ef=ef, momentum=momentum)


def randomk(k: float = 0.01, seed: int = 0, ef: bool = True, momentum: float = 0.0) -> Compressor:
    """k elements of each partition at indices every worker draws alike from `seed`, the key and the round."""
    return Compressor(method="randomk", k=k, seed=seed, ef=ef, momentum=momentum)


def dithering(
    s: int = 7,
    partition: str = "linear",
    norm: str = "max",
    seed: int = 0,
    ef: bool = False,
    momentum: float = 0.0,
) -> Compressor:
    """Unbiased stochastic quantisation to `s` levels of |g| / norm (`linear` or `natural`: powers of two; `max` or
    `l2` norm); 4 bits per element for s < 8, else 8."""
    return Compressor(method="dithering", s=s, partition=partition, norm=norm, seed=seed, ef=ef, momentum=momentum)


METHODS = {"onebit": onebit, "topk": topk, "randomk": randomk, "dithering": dithering}


def args_of(value: object) -> dict | None:
    """The compressor arguments of `compression=`: a Compressor, a dict of BytePS's spelling, or anything else
    (Horovod's classes, None: not a compressor the servers run)."""
    if isinstance(value, Compressor):
        return value.args
    if isinstance(value, dict):
        found = from_byteps(value)
        return found.args if found is not None else None
    return None


def _flag(value: object) -> bool:
    return value is True or str(value).lower() in ("1", "true", "yes", "on")


def from_byteps(params: dict, momentum_mu: float = 0.9) -> Compressor | None:
    """BytePS's `compression_params` (MXNet's DistributedTrainer) or its declaration attributes (`byteps_` prefix):
    compressor onebit/topk/randomk/dithering, ef "vanilla", momentum "nesterov"/"vanilla" (mu: `momentum_mu`, or
    the optimizer's), scaling, k, seed, partition, normalize. None where no compressor is named (or "none")."""
    plain = {str(k).removeprefix("byteps_"): v for k, v in params.items()}
    method = plain.get("compressor", plain.get("compressor_type", "none"))
    if method in (None, "none", ""):
        return None
    if method not in METHODS:
        raise ValueError(f"BytePS compressor {method!r}: gradwire runs {', '.join(METHODS)}")
    ef = plain.get("ef", plain.get("error_feedback_type"))
    momentum = plain.get("momentum", plain.get("momentum_type"))
    args: dict[str, Any] = {"method": method, "ef": ef not in (None, "", "none")}
    if momentum not in (None, "", "none"):
        args["momentum"] = float(plain.get("momentum_mu", momentum_mu))
    if method == "onebit":
        names = ("scaling", "compressor_onebit_scaling", "compressor_onebit_enable_scale")
        scaling = next((plain[n] for n in names if n in plain), None)
        args["scaling"] = _flag(scaling) if scaling is not None else True
    if method in ("topk", "randomk"):
        k = float(plain.get("k", plain.get("compressor_k", 0.01)))
        args["k"] = int(k) if k >= 1 else k
    if method in ("randomk", "dithering") and "seed" in plain:
        args["seed"] = int(plain["seed"])
    if method == "dithering":
        args["s"] = int(plain.get("k", plain.get("compressor_k", 7)))
        args["partition"] = str(plain.get("partition", plain.get("dithering_partition", "linear")))
        args["norm"] = str(plain.get("normalize", plain.get("dithering_normalize", "max")))
    return Compressor(**args)
