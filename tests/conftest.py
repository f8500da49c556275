import pytest
from hypothesis import HealthCheck, settings

from gradwire import native

# Hypothesis times its own input generation and each example. On a loaded 2-core CI machine a scheduling stall
# failed a fuzz test with "input generation is slow" (1 input in 1.2 s): timing, not behaviour. The inputs and
# every assertion stay as they are.
settings.register_profile("gradwire", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("gradwire")


@pytest.fixture(scope="session")
def gn():
    """gradwire-native's module; skips the test where it cannot be used, saying why (which `make test` refuses:
    GRADWIRE_EXPECT_NATIVE=1 makes tests/native/test_package.py fail instead)."""
    loaded = native.load()
    if loaded.module is None:
        pytest.skip(loaded.reason)
    return loaded.module
