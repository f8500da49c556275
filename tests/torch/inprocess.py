"""What the in-process torch tests share: N, the ranks of the `cluster` fixture (conftest.py), and `run`, which
calls fn(rank) on every rank at once with that rank's worker current."""

import torch

N = 2
torch.set_num_threads(1)


def run(cluster, fn):
    return cluster.run_ranks(fn)
