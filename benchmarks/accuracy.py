"""`python -m benchmarks --accuracy`: what compression costs in accuracy (docs/compression.md). A classifier trained the
same epochs with SGD and momentum, DistributedOptimizer uncompressed and with onebit, top-k 1% (both with error
feedback) and PowerSGD rank 2; several runs each (another seed: the initialisation and the data's order), one after
the other on this machine with `gradwire launch` (n workers, k servers). `--task digits`: the README demo's CNN on
scikit-learn's digits; `--task mnist1d`: the larger task (benchmarks/mnist1d.py), a 1-D CNN on 16,000 samples of
MNIST-1D, its learning rate on a cosine schedule. Prints each way's mean test accuracy, its spread, and its
difference from uncompressed."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from benchmarks.ps import launch_task

WAYS = ("none", "onebit", "topk", "powersgd")
TASKS = {
    "digits": "digits CNN (scikit-learn's digits), SGD momentum 0.9",
    "mnist1d": "MNIST-1D 1-D CNN (16,000 samples), SGD momentum 0.9, cosine learning rate",
}


def run_accuracy(args: argparse.Namespace) -> int:
    n, k, runs, task = args.num_workers, args.num_servers, args.accuracy_runs, args.task
    print(f"{TASKS[task]}, {args.epochs} epochs, {n} workers, {k} servers, {runs} runs per way:")
    found: dict[str, list[float]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="gradwire-accuracy-") as tmp:
        data: list[str] = []
        if task == "mnist1d":  # made once, read by every worker of every run
            from benchmarks import mnist1d

            data = ["--data", os.path.join(tmp, "mnist1d.npz")]
            mnist1d.save(data[1])
        for seed in range(runs):  # the ways interleaved, so the machine's drift falls on every way alike
            for way in WAYS:
                argv = [task, "--mode", "local", "--compression", way, "--seed", str(seed), *data]
                found[way].append(launch_task(n, k, [*argv, "--epochs", str(args.epochs)])[0]["test_accuracy"])
    base = statistics.mean(found["none"])
    print("| compression | test accuracy (mean) | spread (min-max) | against uncompressed |")
    print("|---|---:|---:|---:|")
    for way, accuracy in found.items():
        mean = statistics.mean(accuracy)
        print(f"| {way} | {mean:.4f} | {min(accuracy):.4f}-{max(accuracy):.4f} | {100 * (mean - base):+.2f} points |")
    return 0
