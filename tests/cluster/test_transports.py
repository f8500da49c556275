"""Every transport gives the same sums: shared memory (same host), Unix sockets, TCP; GRADWIRE_TRANSPORT chooses for
workers' links and servers' replica links alike."""

import os

import numpy as np
import pytest

from gradwire.protocol.frames import FrameType
from gradwire.server.replier import Replier
from gradwire.testing import LocalCluster
from gradwire.transport import shm


def _ours():
    return {f for f in os.listdir(shm.SHM_DIR) if f.startswith(f"gradwire-{os.getpid()}-")}


@pytest.mark.parametrize("transport,shared,unix", [("auto", True, True), ("unix", False, True), ("tcp", False, False)])
def test_sums_over_every_transport(transport, shared, unix):
    # window 1: two pull slots per link, so most of the 12 tensors in flight take the inline fallback
    # failover_copy_bytes 0 and no holding: every key is replicated, so every server also links to its replica
    config = dict(transport=transport, window=1, partition_bytes=8192, failover_copy_bytes=0, failover_hold=False)
    with LocalCluster(num_workers=3, num_servers=2, **config) as c:
        links = [link for w in c.workers for link in w.links]
        assert all((link.arena is not None) == shared for link in links)
        assert all(link.conn.peer.startswith("unix:") == unix for link in links)
        # /status says the TCP segment size of each TCP link (its path's MTU: loopback's is 65536), none elsewhere
        segments = [entry["tcp_segment_bytes"] for w in c.workers for entry in w.status()["servers"]]
        assert all((s is None) == unix for s in segments) and all(s > 1448 for s in segments if s is not None)
        assert not _ours()  # attached and unlinked: nothing left in /dev/shm

        def job(w):
            handles = [w.push_pull_async(np.full(5000 + i, w.rank + i, np.float64), f"t{i}") for i in range(12)]
            return [w.synchronize(h) for h in handles]

        for results in c.run(job):
            for i, r in enumerate(results):
                assert np.all(r == sum(rank + i for rank in range(3)))
        replica_links = [link for s in c.servers for link in s.state.replicas._links.values()]
        assert len(replica_links) == 2
        assert all(link.conn.peer.startswith("unix:") == unix for link in replica_links)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_held_sums_over_every_transport_in_place_and_not(transport):
    """Sums held in the workers' outputs (past GRADWIRE_FAILOVER_COPY_BYTES): in place and out of place, averaged and
    not, several tensors in flight; each call completes once every worker has its sums, and no server keeps any round
    waiting for a receipt afterwards."""
    config = dict(transport=transport, window=2, partition_bytes=8192, failover_copy_bytes=0)
    with LocalCluster(num_workers=3, num_servers=2, **config) as c:

        def job(w):
            ins = [np.full(5000 + i, w.rank + i, np.float32) for i in range(6)]
            handles = [
                w.push_pull_async(x, f"t{i}", out=x if i % 2 else None, average=i % 3 == 0) for i, x in enumerate(ins)
            ]
            return [w.synchronize(h).copy() for h in handles]

        for _ in range(3):
            for results in c.run(job):
                for i, r in enumerate(results):
                    total = sum(rank + i for rank in range(3))
                    assert np.all(r == (total / 3 if i % 3 == 0 else total)), i
        assert all(t.held for w in c.workers for t in w.table.tensors.values())
        assert all(len(link.holds) == 0 for w in c.workers for link in w.links)
        assert all(len(s.state.receipts) == 0 for s in c.servers)
        assert not any(s.state.replicas._links for s in c.servers)  # no replicas: nothing forwarded


class _Recorder:
    """Stands in for a server's connection to a worker: records what the server sends."""

    peer_rank = 0

    def __init__(self):
        self.sent = []

    def send_json(self, ftype, body, **fields):
        self.sent.append((ftype, body))


@pytest.mark.parametrize("where", ["tmp", "shm-other-name", "shm-subdir-escape"])
def test_the_server_refuses_shared_memory_outside_its_own_files(tmp_path, where):
    # real files of exactly the offered size: only the path check stands between them and the server
    name = f"other-{os.getpid()}"
    target = {
        "tmp": tmp_path / "f",
        "shm-other-name": f"{shm.SHM_DIR}/{name}",
        "shm-subdir-escape": f"{shm.SHM_DIR}/{name}",
    }[where]
    path = {"shm-subdir-escape": f"{shm.SHM_DIR}/gradwire-x/../{name}"}.get(where, str(target))
    with open(target, "wb") as f:
        f.write(b"\0" * 16)
    try:
        with LocalCluster(num_workers=1, num_servers=1) as c:
            link = Replier(_Recorder())
            c.servers[0].reader.attach(link, {"path": path, "push": 1, "pull": 1, "slot_bytes": 8})
            assert link.arena is None
            assert link.conn.sent[0][1]["ok"] is False and "refusing" in link.conn.sent[0][1]["error"]
    finally:
        os.unlink(target)


def test_the_server_maps_a_well_formed_offer():
    arena = shm.Arena.create(2, 2, 64)
    try:
        with LocalCluster(num_workers=1, num_servers=1) as c:
            link = Replier(_Recorder())
            c.servers[0].reader.attach(link, {"path": arena.path, "push": 2, "pull": 2, "slot_bytes": 64})
            assert link.conn.sent == [(FrameType.SHM_ATTACH, {"ok": True})]
            arena.push_slot(1, 4)[:] = [1, 2, 3, 4]  # the same memory on both sides
            assert list(link.arena.push_slot(1, 4)) == [1, 2, 3, 4]
            link.arena.close()
    finally:
        arena.unlink()
        arena.close()


def test_a_held_call_whose_sums_no_worker_is_told_all_have_times_out_naming_why():
    """A server that never says every worker has a held round (a bug, or a worker that never says it has it): the
    call fails at GRADWIRE_TIMEOUT, naming the server whose sums it holds, rather than hanging."""
    import dataclasses

    from gradwire.errors import GradwireTimeout

    with LocalCluster(num_workers=2, num_servers=1, failover_copy_bytes=0) as c:
        c.run(lambda w: w.push_pull(np.ones(100, np.float32), "g"))  # declared, and held
        c.servers[0].state.receipts._notify = lambda rank, pairs: None
        for w in c.workers:
            w.state.config = dataclasses.replace(w.config, timeout=1.0)
        errors = c.run(lambda w: _timeout_of(lambda: w.push_pull(np.ones(100, np.float32), "g")))
        for e in errors:
            assert isinstance(e, GradwireTimeout), e
            assert "sums held until every worker has them, from server 0" in str(e)


def _timeout_of(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 - returned for the test to check
        return e
    return None
