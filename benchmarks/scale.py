"""`python -m benchmarks --netem --scale`: throughput against the number of workers on the emulated network, with a real
model's compute replayed (gradwire.profiles.replay_model) so that two cores do not bound the curve, and the model's
prediction (gradwire/predict.py) beside every point (docs/scaling.md).

For n = 1, 2, 4, 8 (`--scale-workers`) on links of `--scale-rate`: gradwire's DistributedOptimizer with k = n
dedicated servers, and with colocated servers only (k = 0), each beside DDP over gloo with the same replayed compute
in the same emulated cluster. Per point: samples/s, the scaling efficiency (samples/s at n over n x samples/s at 1),
the bound (compute alone, or the bytes alone at the layout's rate) and the prediction, with its error.
"""

from __future__ import annotations

import argparse
import json

from gradwire import predict, profiles
from gradwire.netem.topology import Topology, parse_rate

LAYOUTS = {"dedicated": lambda n, rate: Topology(n, n, rate, rate), "colocated": lambda n, rate: _colocated(n, rate)}


def _colocated(n: int, rate: str) -> Topology:
    return Topology(n, 0, rate, rate, colocate=True)


def model_step(
    layers: list[predict.Layer], n: int, layout: str, way: str, rate: str, settings: dict, overhead_s: float = 0.0
) -> predict.Prediction:
    """The model's step for one point: `way` (gradwire or ddp) with `layout`'s servers on links of `rate`, with the
    partition size and window the job ran with (`settings`; none: the defaults') and `overhead_s`, a step's time
    outside its layers (the loss, the optimizer's step)."""
    links = predict.Links(parse_rate(rate) / 8, parse_rate(rate) / 8)
    if way == "ddp":
        return predict.ring_step(layers, n, links, overhead_s)
    k, colocated = (n, False) if layout == "dedicated" else (0, True)
    partition = int(settings.get("partition_bytes") or 4 << 20)
    window = int(settings.get("window") or 0)
    return predict.gradwire_step(layers, n, k, links, colocated, partition, window, overhead_s)


def run_scale(args: argparse.Namespace, env: dict[str, str]) -> int:
    from gradwire.bench.netem_train import run_train_config

    profile = profiles.load(args.replay or profiles.BENCH_MODEL)
    layers = profiles.layers(profile)
    env = env | {"GRADWIRE_BENCH_REPLAY": str(args.replay or profiles.BENCH_MODEL)}
    rows = []
    for n in [int(x) for x in args.scale_workers.split(",")]:
        for layout, make in LAYOUTS.items():
            topo = make(n, args.scale_rate)
            for r in run_train_config(topo, args.steps, args.warmup, env, ways=("optimizer", "ddp")):
                way = "gradwire" if r["way"] == "optimizer" else "ddp"
                settings = {"partition_bytes": (r.get("partition_bytes") or [None])[-1], "window": r.get("window")}
                row = {"n": n, "layout": layout, "way": way, "rate": args.scale_rate}
                row |= {"samples_per_s": r["samples_per_s"], "step_s": r["step_seconds_median"]}
                row |= {"cpu_utilization": r["cpu_utilization"], "settings": settings}
                row["bound_step_s"] = model_step(layers, n, layout, way, args.scale_rate, {}).bound_s
                rows.append(row)
    _predictions(rows, layers)
    _efficiencies(rows)
    for row in rows if args.json else ():
        print(json.dumps(row), flush=True)
    if not args.json:
        print(table(rows, profile), flush=True)
    return 0


def _predictions(rows: list[dict], layers: list[predict.Layer]) -> None:
    """Each row's predicted step. A step's time outside the layers (the loss, the optimizer's step, Python) is the
    one thing the model takes from a measurement: DDP's at n = 1 (no communication) less the layers' compute; that
    point is the calibration, and its error is 0 by construction."""
    alone = [r["step_s"] for r in rows if r["n"] == 1 and r["way"] == "ddp"]
    overhead = max(0.0, min(alone) - predict.compute_s(layers)) if alone else 0.0
    for r in rows:
        args = (layers, r["n"], r["layout"], r["way"], r["rate"], r["settings"], overhead)
        r["predicted_step_s"], r["overhead_s"] = model_step(*args).step_s, overhead


def _efficiencies(rows: list[dict]) -> None:
    """Each row's scaling efficiency against the same layout's and way's n = 1 (if measured)."""
    ones = {(r["layout"], r["way"]): r["samples_per_s"] for r in rows if r["n"] == 1}
    for r in rows:
        one = ones.get((r["layout"], r["way"]))
        r["efficiency"] = r["samples_per_s"] / (r["n"] * one) if one else None


def table(rows: list[dict], profile: dict) -> str:
    """A markdown table of every point: measured and predicted, against DDP in the same cluster."""
    total = sum(sum(layer["elements"]) for layer in profile["layers"])
    overhead = rows[0].get("overhead_s", 0.0) if rows else 0.0
    head = (
        f"Replayed compute: {profile['model']}, {total / 1e6:.2f}M parameters, profiled on {profile['device']}, batch "
        f"{profile['batch']} per worker; a step's time outside its layers {overhead * 1e3:.1f} ms (DDP at n = 1)\n\n"
        "| n | layout | way | samples/s | efficiency | step s | bound s | predicted s | error | x DDP | CPU |\n"
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    ddp = {(r["n"], r["layout"]): r["samples_per_s"] for r in rows if r["way"] == "ddp"}
    lines = [head]
    for r in rows:
        eff = f"{r['efficiency']:.2f}" if r.get("efficiency") is not None else "-"
        error = r["predicted_step_s"] / r["step_s"] - 1
        lines.append(
            f"| {r['n']} | {r['layout']} | {r['way']} | {r['samples_per_s']:.1f} | {eff} | {r['step_s']:.3f} | "
            f"{r['bound_step_s']:.3f} | {r['predicted_step_s']:.3f} | {error:+.0%} | "
            f"{r['samples_per_s'] / ddp[(r['n'], r['layout'])]:.2f}x | {r['cpu_utilization']:.0%} |"
        )
    return "\n".join(lines)
