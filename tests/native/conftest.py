"""The native data path's suite (gradwire-native): skipped where the extension is not installed, which `make test`
refuses (GRADWIRE_EXPECT_NATIVE=1: tests/native/test_package.py fails instead)."""

import pytest

from gradwire import native


@pytest.fixture(scope="session")
def gn():
    """The extension module; skips the test where it cannot be used, saying why."""
    loaded = native.load()
    if loaded.module is None:
        pytest.skip(loaded.reason)
    return loaded.module
