import pytest

from gradwire.testing import LocalCluster
from tests.torch.inprocess import N


@pytest.fixture(scope="module", params=[{}, {"failover_copy_bytes": 0}], ids=["copies", "held"])
def cluster(request):
    """N ranks in this process (a thread and a Worker each), one cluster per test module; each module's tests run
    twice: sums copied for a failover (small models), and held in the outputs (past the budget: docs/faults.md)."""
    with LocalCluster(num_workers=N, num_servers=2, partition_bytes=16 << 10, **request.param) as c:
        yield c
