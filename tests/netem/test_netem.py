"""The emulated cluster: shaped links, a gradwire job across hosts, and teardown that leaves nothing."""

import subprocess
import sys

import pytest

from gradwire.netem import EmulatedCluster, NetemUnavailable, Topology
from gradwire.netem.cluster import check_available
from gradwire.netem.jobs import start_gradwire
from tests.multiprocess.harness import ROOT

try:
    check_available()
except NetemUnavailable as e:
    pytest.skip(f"no emulated network here: {e}", allow_module_level=True)

pytestmark = pytest.mark.netem

RECEIVER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; first = None
while True:
    d = c.recv(1 << 20)
    if not d:
        break
    first = first or time.monotonic()
    n += len(d)
print(n * 8 / (time.monotonic() - first), flush=True)
"""
SENDER = (
    "import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); s.sendall(b'x' * (6 << 20))"
)


def test_a_shaped_link_runs_at_its_configured_rate():
    topo = Topology(workers=1, servers=1, worker_rate="20mbit", server_rate="20mbit")
    with EmulatedCluster(topo) as c:
        worker, server = topo.of("worker")[0], topo.of("server")[0]
        rx = c.spawn(server, [sys.executable, "-c", RECEIVER, server.address], stdout=subprocess.PIPE, text=True)
        port = rx.stdout.readline().strip()
        tx = c.spawn(worker, [sys.executable, "-c", SENDER, server.address, port])
        assert tx.wait(30) == 0
        bits_per_s = float(rx.communicate(timeout=30)[0].strip())
    assert 0.8 * 20e6 <= bits_per_s <= 1.2 * 20e6, bits_per_s


def test_a_gradwire_job_across_emulated_hosts_sums_correctly():
    topo = Topology(workers=2, servers=2, worker_rate="200mbit", server_rate="200mbit")
    with EmulatedCluster(topo) as c:
        job = start_gradwire(c, [sys.executable, str(ROOT / "tests" / "multiprocess" / "job.py"), "ok", "netem"])
        outputs = job.wait(timeout=120)
    for rank, out in enumerate(outputs):
        assert f"DONE rank {rank} of 2" in out, out


def test_teardown_leaves_nothing_even_after_a_failure_inside():
    cluster = EmulatedCluster(Topology(workers=2, servers=1))
    with pytest.raises(RuntimeError, match="boom"):
        with cluster:
            assert len(cluster.leftovers()) == 5  # namespaces: scheduler, 2 workers, 1 server, the bridge
            cluster.spawn(cluster.topology.hosts[1], ["sleep", "60"])
            raise RuntimeError("boom")
    assert cluster.leftovers() == []
    root_qdiscs = subprocess.run(["tc", "qdisc"], capture_output=True, text=True).stdout
    assert f"v{cluster.run_id}" not in root_qdiscs


def test_two_runs_never_collide():
    with EmulatedCluster(Topology(workers=1, servers=1)) as a, EmulatedCluster(Topology(workers=1, servers=1)) as b:
        assert a.run_id != b.run_id
        assert a.leftovers() and b.leftovers()
        assert not set(a.leftovers()) & set(b.leftovers())
    assert a.leftovers() == [] and b.leftovers() == []
