"""The larger accuracy task of `python -m benchmarks --accuracy --task mnist1d` (benchmarks/mnist1d.py): MNIST-1D as its
package makes it, saved once and read back by every worker alike, and the 1-D CNN over it."""

import pytest

import torch

pytest.importorskip("mnist1d")

from benchmarks import mnist1d  # noqa: E402


def test_the_set_is_made_alike_saved_and_read_back(tmp_path):
    path = str(tmp_path / "m.npz")
    mnist1d.save(path, samples=400)
    x, y, x_test, y_test = mnist1d.load(path)
    assert x.shape == (320, 1, 40) and x_test.shape == (80, 1, 40) and x.dtype == torch.float32
    assert set(y.tolist()) == set(range(10)) and len(y_test) == 80
    again = mnist1d.make(400)  # the package's seed: every worker that makes it gets the same set
    assert torch.equal(x, torch.tensor(again["x"], dtype=torch.float32).unsqueeze(1))


def test_the_model_classifies_its_inputs_and_has_layers_past_the_compression_threshold():
    model = mnist1d.model()
    assert model(torch.zeros(5, 1, 40)).shape == (5, 10)
    large = [p.numel() * 4 for p in model.parameters() if p.numel() * 4 >= 64 << 10]
    assert len(large) == 3  # the two deeper convolutions and the dense layer are compressed
