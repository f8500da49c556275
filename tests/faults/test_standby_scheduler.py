"""Standby schedulers (scheduler/lease.py, docs/faults.md): a standby takes a running job over only once a majority of
its nodes are free of the scheduler they lost, a scheduler that loses its lease steps down without acting, and the job
goes on bit-identical. In-process clusters and the lease's parts; tests/faults/test_killed_processes.py SIGKILLs and
SIGSTOPs real scheduler processes."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gradwire.config import Config
from gradwire.errors import GradwireError, JobAborted
from gradwire.protocol import messages
from gradwire.protocol.frames import FrameType
from gradwire.scheduler import client
from gradwire.scheduler.client import Promise
from gradwire.scheduler.lease import Proof
from gradwire.scheduler.recovery import Recovery
from gradwire.scheduler.roster import Roster
from gradwire.testing import LocalCluster
from gradwire.transport import endpoints, tcp
from tests.faults.test_scheduler_recovery import SIZES, reference, same, step

SETTINGS = {"partition_bytes": 64 * 1024, "heartbeat_interval": 0.2, "heartbeat_timeout": 5.0}
SETTINGS |= {"scheduler_timeout": 20.0}


def test_a_standby_takes_the_job_over_twice_and_the_sums_stay_bit_identical():
    """The scheduler dies; its standby takes over (a new tensor declared meanwhile is placed by it); a new standby
    started at the dead one's address takes over from the second."""
    want = reference(8, extra=("late",))
    got = []
    with LocalCluster(num_workers=2, num_servers=2, standby_schedulers=1, **SETTINGS) as c:
        got += [c.run(lambda w, n=n: step(w, n)) for n in range(2)]
        dead = c.kill_scheduler()
        got.append(c.run(lambda w: step(w, 2)))  # the data path needs no scheduler
        names = (*SIZES, "late")
        got += [c.run(lambda w, n=n: step(w, n, names)) for n in range(3, 5)]  # "late": declared during the takeover
        first = c.await_takeover(10)
        assert first.roster.term == 2 and first.recovery.record["reported"] == [
            "server 0",
            "server 1",
            "worker 0",
            "worker 1",
        ]
        c.start_standby_scheduler(dead)  # as `gradwire launch` does
        c.run(lambda w: w.barrier())
        c.kill_scheduler()
        got += [c.run(lambda w, n=n: step(w, n, names)) for n in range(5, 8)]
        second = c.await_takeover(10)
        c.run(lambda w: w.barrier())
        assert second.roster.term == 3 and second.address == dead
        assert all(w.control.at == 0 for w in c.workers)  # back at GRADWIRE_SCHEDULER's address
    same(got, want)


def test_a_scheduler_whose_lease_lapsed_answers_nothing_and_steps_down():
    """No beat answered for longer than the lease (a fake clock stands for the silence): the next request is not
    answered, the scheduler steps down and closes every connection; the worker finds no other to resume with."""
    now = [0.0]
    settings = SETTINGS | {"heartbeat_interval": 5.0, "heartbeat_timeout": 40.0, "scheduler_timeout": 0.5}
    settings |= {"scheduler_standby": "127.0.0.1:1"}  # a standby nobody runs: the lease is on
    with LocalCluster(num_workers=2, num_servers=1, clock=lambda: now[0], **settings) as c:
        c.run(lambda w: w.push_pull(np.ones(10, np.float32), "a"))
        assert c.scheduler.lease.held()
        now[0] += 20.5  # past the lease (half the timeout); no beat went out meanwhile (every 5 s of real time)
        assert not c.scheduler.lease.held()
        with pytest.raises(JobAborted, match="lost the scheduler"):
            c.workers[0].push_pull(np.ones(10, np.float32), "b")  # its declaration is refused
        assert c.scheduler.stepped_down and "only 0 of the job's 3 nodes" in c.scheduler.stepped_down
        assert c.scheduler.roster.declarations.tensors.keys() == {"a"}
        for w in c.workers[1:]:
            w.state.closed = True  # the job is over; they need not wait for their shutdown


def test_a_standby_refuses_registration_with_a_clear_error():
    with LocalCluster(num_workers=1, num_servers=1, standby_schedulers=1, **SETTINGS) as c:
        standby = c.standby_schedulers[0].address
        config = Config(scheduler=standby, role="worker", timeout=5)
        with pytest.raises(JobAborted, match="registered with a standby scheduler"):
            client.join(config, "worker", port=1)


def _resume(role: str, rank: int, promise: dict, book: dict | None = None) -> messages.Resume:
    report = {"scheduler": promise} | ({"book": book, "tensors": [], "barriers": 0} if book else {"kept": []})
    return messages.Resume.of(role, rank, "127.0.0.1", (1, 1), {"port": 1}, report)


class _Conn:
    peer, closed = "127.0.0.1:1", False

    def send_message(self, message: messages.Message) -> None:
        pass


def test_a_standby_takes_over_only_at_a_majority_free_of_their_promise():
    """Voters: 2 workers and 2 live servers (the lost server does not vote): 3 free of their promise are needed. A
    node whose connection was closed from the scheduler's end is free at once; one that found it silent once
    LEASE + MARGIN have passed since it last answered a beat."""
    config = Config(role="scheduler", standby=True, heartbeat_timeout=2.0, num_workers=2, num_servers=3)
    roster = Roster(config, clock=lambda: 0.0)
    recovery = Recovery(roster)
    server = {"host": "127.0.0.1", "port": 1, "lost": False}
    book = {"num_workers": 2, "servers": [server, server | {"lost": True}, server], "epoch": 1}
    recovery.report(_Conn(), _resume("worker", 0, {"dropped": True, "since_beat": 0.1}, book), 10.0)
    recovery.report(_Conn(), _resume("server", 0, {"dropped": False, "since_beat": 0.5}, None), 10.0)  # free at 11.0
    assert not recovery.taken_over  # 1 of 4
    late = _Conn()
    recovery.report(late, _resume("worker", 1, {"dropped": False, "since_beat": 2.0}, book), 10.5)  # free at once
    assert not recovery.taken_over  # 2 of 4
    recovery.check_deadline(10.9)
    assert not recovery.taken_over
    recovery.check_deadline(11.0)  # server 0's promise is over: 3 of 4
    assert recovery.taken_over and not recovery.done.is_set()  # server 2 has not reported yet
    recovery.report(_Conn(), _resume("server", 2, {"dropped": True}, None), 11.1)
    assert recovery.done.is_set() and roster.term == 2


def test_a_report_withdrawn_before_the_takeover_no_longer_counts():
    config = Config(role="scheduler", standby=True, heartbeat_timeout=2.0, num_workers=2, num_servers=1)
    recovery = Recovery(Roster(config, clock=lambda: 0.0))
    book = {"num_workers": 2, "servers": [{"host": "127.0.0.1", "port": 1}], "epoch": 1}
    recovery.report(_Conn(), _resume("worker", 0, {"dropped": True}, book), 1.0)
    node = recovery.report(_Conn(), _resume("worker", 1, {"dropped": True}, book), 1.0)
    assert recovery.taken_over  # 2 of 3
    assert Proof(config).wait == 1.5
    assert recovery.withdraw(node) and not recovery.done.is_set()


def test_a_node_s_promise_tells_a_closed_connection_from_a_silent_one():
    config = Config(heartbeat_timeout=2.0, scheduler_standby="127.0.0.1:1")
    clock = [5.0]
    promise = Promise(config, clock=lambda: clock[0])
    listener = endpoints.listen("127.0.0.1", 0)
    accepted: list = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    conn = tcp.Connection(
        __import__("socket").create_connection(listener.getsockname()), max_payload=0, peer="scheduler"
    )
    deadline = time.monotonic() + 5
    while not accepted and time.monotonic() < deadline:
        time.sleep(0.01)
    promise.watch(conn)
    assert conn.sock.gettimeout() == 2.0
    accepted[0].close()  # the scheduler's end closes
    with pytest.raises(tcp.PeerClosed) as closed:
        conn.recv_header()
    promise.lost(conn, closed.value)
    clock[0] = 6.5
    assert promise.report() == {"dropped": True, "since_beat": 1.5}
    promise.lost(conn, GradwireError("timed out reading from scheduler 0"))  # silence
    assert promise.report()["dropped"] is False
    conn.close()
    promise.lost(conn, tcp.PeerClosed("closed"))  # our own close is not the scheduler's
    assert promise.report()["dropped"] is False
    endpoints.close_listener(listener)


def test_a_node_still_in_the_rendezvous_answers_beats_and_still_gets_its_book():
    """A leased job's scheduler beats every node it knows, also one that registered and still waits for the address
    book (a server in the rendezvous, a replacement joining a running job): the node answers and keeps waiting (it
    gave up on the job at the first beat: CI, the emulated-network cut-off test)."""
    import socket

    ours, theirs = socket.socketpair()
    node = tcp.Connection(ours, max_payload=0, peer="scheduler")
    scheduler = tcp.Connection(theirs, max_payload=0, peer="server 0")
    scheduler.send_message(messages.Beat(seq=7))
    scheduler.send_message(messages.AddressBook(rank=0, num_workers=1, servers=[], term=2))
    book = client._await_book(node)
    assert isinstance(book, messages.AddressBook) and book.term == 2
    _, body = scheduler.recv_json(FrameType.CONTROL)
    assert messages.parse(body) == messages.Beat(seq=7)
    node.close()
    scheduler.close()
