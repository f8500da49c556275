"""Pacing a worker's network links against each other (worker/credit.py): the bytes to each server leave in proportion
to its placement share, a link never waits for a link that is gone, and pacing can delay a push but never hold it."""

import socket
import time

import numpy as np
import pytest

from gradwire.protocol import dtypes
from gradwire.testing import LocalCluster
from gradwire.transport import tcp
from gradwire.worker import credit as link
from gradwire.worker.credit import Credit
from gradwire.worker.handle import Handle
from gradwire.worker.link import ServerLink
from gradwire.worker.work import Work


def _paced(lead: int, **links: tuple[float, int]) -> Credit:
    """A credit pacing links `s0`, `s1`, ... given as (share, bytes queued)."""
    credit = Credit(1 << 30, lead=lead)
    for name, (share, _) in links.items():
        credit.pace(int(name[1:]), share)
    for name, (_, queued) in links.items():
        credit.queue(int(name[1:]), queued)
    return credit


def test_a_link_ahead_of_its_share_waits_for_the_link_behind():
    credit = _paced(100, s0=(0.75, 3000), s1=(0.25, 1000))  # both 4000 bytes of the step behind: either may go
    assert credit.take(500, 1)  # link 1 is now 2000 behind, link 0 still 4000
    assert not credit.take(500, 1)
    assert credit.take(1000, 0)  # link 0: 2000/0.75 = 2667 behind; still more than 100 ahead of link 1's 2000
    assert not credit.take(500, 1)
    assert credit.take(500, 0)  # link 0: 2000 behind, level with link 1
    assert credit.take(500, 1)
    assert credit.used == 2500


def test_the_link_furthest_behind_never_waits():
    credit = _paced(1, s0=(0.5, 10_000), s1=(0.5, 100))
    assert all(credit.take(1000, 0) for _ in range(10))


def test_a_link_that_goes_away_releases_the_links_waiting_for_it():
    credit = _paced(1, s0=(0.5, 10_000), s1=(0.5, 1000))
    assert not credit.take(1000, 1)
    credit.unpace(0)  # its server died: its work moves to the others
    assert credit.take(1000, 1)


def test_a_waiting_link_may_go_once_its_turn_comes_from_its_own_queue_or_freed_credit():
    credit = _paced(100, s0=(0.5, 10_000), s1=(0.5, 1000))
    assert not credit.take(500, 1)
    credit.queue(1, 20_000)  # link 1 is now the furthest behind
    assert credit.take(500, 1)
    limited = Credit(1000)
    assert limited.take(800)
    assert not limited.take(500, 0)
    limited.release(800)
    assert limited.take(500, 0) and limited.used == 500


def test_pacing_delays_a_push_but_never_holds_it(monkeypatch):
    """A link whose turn never comes (the link it waits for sends nothing) still pushes, PACE_GIVE_UP_SECONDS late:
    the link loop wakes for it with no other event."""
    monkeypatch.setattr(link, "PACE_GIVE_UP_SECONDS", 0.2)
    credit = _paced(1, s0=(0.5, 1 << 30), s1=(0.5, 0))  # link 0 is far behind and never sends
    ours, theirs = socket.socketpair()
    server = tcp.Connection(theirs, 1 << 20)
    paced = ServerLink(tcp.Connection(ours, 1 << 20), server=1, rank=0, epoch=1, window=4, credit=credit)
    out = np.zeros(16, np.float32)
    work = Work("t", 5, 1, dtypes.from_numpy(out.dtype).code, out.copy(), out, 1, Handle("t", out, 1, lambda h: None))
    started = time.monotonic()
    paced.start()
    paced.submit(work, 0)
    assert server.recv_header().key == 5
    assert 0.15 < time.monotonic() - started < 2
    paced.close(RuntimeError("done"))
    paced.join(2)
    theirs.close()


def test_links_that_are_not_paced_never_wait():
    credit = Credit(1 << 30, lead=1)
    credit.pace(0, 0.5)
    credit.queue(0, 10_000)
    credit.queue(1, 1000)  # link 1 was not paced (a same-host link): ignored
    assert credit.take(1000, 1)
    off = _paced(0, s0=(0.5, 10_000), s1=(0.5, 1000))  # GRADWIRE_PACING=0
    assert off.take(1000, 1)


@pytest.mark.parametrize("pacing", [0, 1, 8])
def test_paced_tcp_links_give_exact_sums(pacing):
    with LocalCluster(
        num_workers=3, num_servers=3, transport="tcp", partition_bytes=4096, window=2, unanswered=2, pacing=pacing
    ) as c:
        shares = [dict(w.credit._shares) for w in c.workers]
        if pacing:
            assert all(sorted(s) == [0, 1, 2] and sum(s.values()) == pytest.approx(1) for s in shares)
        else:
            assert shares == [{}, {}, {}]
        sizes = [10, 5000, 20_000, 3, 70_000]

        def job(worker):
            handles = [worker.push_pull_async(np.full(n, worker.rank + 1.0, np.float32), f"t{n}") for n in sizes]
            return [worker.synchronize(h) for h in handles]

        for results in c.run(job):
            for n, out in zip(sizes, results, strict=True):
                assert out.shape == (n,) and np.all(out == 6.0)
        assert all(w.credit._queued == {s: 0 for s in range(3)} for w in c.workers if pacing)
