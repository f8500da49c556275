import pytest

from gradwire.testing import LocalCluster
from tests.torch.inprocess import N


@pytest.fixture(scope="module")
def cluster():
    """N ranks in this process (a thread and a Worker each), one cluster per test module."""
    with LocalCluster(num_workers=N, num_servers=2, partition_bytes=16 << 10) as c:
        yield c
