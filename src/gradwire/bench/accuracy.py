"""`gradwire bench --accuracy`: what compression costs in accuracy (docs/compression.md). The README demo's CNN on
scikit-learn's digits, SGD with momentum, the same epochs, DistributedOptimizer uncompressed and with onebit, top-k
1% (both with error feedback) and PowerSGD rank 2; several runs each (another seed: the initialisation and the data's
order), one after the other on this machine with `gradwire launch` (n workers, k servers). Prints each way's mean
test accuracy, its spread, and its difference from uncompressed."""

from __future__ import annotations

import argparse
import statistics

from gradwire.bench.ps import launch_task

WAYS = ("none", "onebit", "topk", "powersgd")


def run_accuracy(args: argparse.Namespace) -> int:
    n, k, runs = args.num_workers, args.num_servers, args.accuracy_runs
    print(f"digits CNN, SGD momentum 0.9, {args.epochs} epochs, {n} workers, {k} servers, {runs} runs per way:")
    found: dict[str, list[float]] = {way: [] for way in WAYS}
    for seed in range(runs):  # the ways interleaved, so the machine's drift falls on every way alike
        for way in WAYS:
            task = [
                "digits",
                "--mode",
                "local",
                "--compression",
                way,
                "--seed",
                str(seed),
                "--epochs",
                str(args.epochs),
            ]
            found[way].append(launch_task(n, k, task)[0]["test_accuracy"])
    base = statistics.mean(found["none"])
    print("| compression | test accuracy (mean) | spread (min-max) | against uncompressed |")
    print("|---|---:|---:|---:|")
    for way, accuracy in found.items():
        mean = statistics.mean(accuracy)
        print(f"| {way} | {mean:.4f} | {min(accuracy):.4f}-{max(accuracy):.4f} | {100 * (mean - base):+.2f} points |")
    return 0
