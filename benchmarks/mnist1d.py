"""The larger accuracy task of `python -m benchmarks --accuracy --task mnist1d` (docs/compression.md): MNIST-1D
(Greydanus, 2020), ten classes of one-dimensional digit templates, shifted, scaled, sheared and noised, made by the
`mnist1d` package's own generator (its published settings and seed; 20,000 samples here instead of its 5,000: 16,000 to
train, 4,000 held out), and a 1-D CNN of 0.4M parameters with layers of mixed sizes (the three largest compressed).

Generating takes seconds of Python, so `gradwire bench` makes the set once and hands its workers the file
(`--data`); a worker started alone makes it itself.
"""

from __future__ import annotations

import numpy as np

import torch

SAMPLES = 20_000


def make(samples: int = SAMPLES) -> dict[str, np.ndarray]:
    """MNIST-1D with the package's settings and seed (42) and `samples` samples (80% train)."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError:  # pragma: no cover - an install without the bench extra
        raise SystemExit("the mnist1d task needs the mnist1d package: pip install 'gradwire[bench]'") from None
    args = get_dataset_args()
    args.num_samples = samples
    made = make_dataset(args)
    return {name: np.asarray(made[name]) for name in ("x", "y", "x_test", "y_test")}


def save(path: str, samples: int = SAMPLES) -> None:
    np.savez(path, **make(samples))


def load(path: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train inputs (N, 1, 40), train labels, test inputs, test labels: from `path` (made by `save`), or made now."""
    found = dict(np.load(path)) if path else make()
    x = torch.tensor(found["x"], dtype=torch.float32).unsqueeze(1)
    x_test = torch.tensor(found["x_test"], dtype=torch.float32).unsqueeze(1)
    return x, torch.tensor(found["y"]), x_test, torch.tensor(found["y_test"])


def model() -> torch.nn.Module:
    """Convolutions of 0.3, 96 and 192 KiB, a 1.25 MiB dense layer and a small head."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv1d(1, 64, 5, padding=2), nn.ReLU(),
        nn.Conv1d(64, 128, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv1d(128, 128, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(128 * 10, 256), nn.ReLU(), nn.Linear(256, 10),
    )  # fmt: skip
