"""Any start order (Kubernetes starts pods in any order, srun starts tasks together): servers and workers that come
up before the scheduler keep trying to reach it, and a node that never finds it says where it looked."""

import logging
import socket
import threading
import time

import numpy as np
import pytest

from gradwire.config import Config
from gradwire.errors import GradwireTimeout
from gradwire.scheduler import Scheduler
from gradwire.scheduler.client import join
from gradwire.server import Server
from gradwire.testing import LocalCluster
from gradwire.worker import Worker


def _free_port() -> int:
    # bound to port 0 and released: the scheduler takes it up later, as a restarted pod would take its address
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("late", ["scheduler", "servers"])
def test_roles_started_before_the_scheduler_complete_the_job(late):
    port = _free_port()
    base = Config(num_workers=2, num_servers=2, scheduler=f"127.0.0.1:{port}", timeout=20.0, switch_interval=0)
    started: dict[str, list] = {"servers": [], "workers": []}
    errors: list[BaseException] = []

    def start(kind, make):
        try:
            started[kind].append(make())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def servers():
        make = lambda: Server(_with(base, role="server")).start()  # noqa: E731
        return [threading.Thread(target=start, args=("servers", make)) for _ in range(2)]

    workers = [
        threading.Thread(target=start, args=("workers", lambda r=r: Worker(_with(base, rank=r)).start()))
        for r in range(2)
    ]
    first = workers + (servers() if late == "scheduler" else [])
    for t in first:
        t.start()
    time.sleep(1.5)  # everyone started so far is retrying against a closed port
    scheduler = Scheduler(_with(base, role="scheduler")).start()
    rest = servers() if late == "servers" else []
    for t in rest:
        t.start()
    for t in first + rest:
        t.join(30)
    try:
        assert not errors, errors
        results = []

        def push(w):
            results.append(w.push_pull(np.full(1000, w.rank + 1.0, np.float32), "late"))

        threads = [threading.Thread(target=push, args=(w,)) for w in started["workers"]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert len(results) == 2 and all(np.all(r == 3.0) for r in results)
    finally:
        for w in started["workers"]:
            w.shutdown()
        scheduler.wait(5)
        for s in started["servers"]:
            s.stop()
        scheduler.stop()


def test_a_node_that_never_finds_the_scheduler_names_the_address(caplog):
    port = _free_port()
    config = Config(num_workers=1, num_servers=1, scheduler=f"127.0.0.1:{port}", timeout=1.5)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gradwire.rendezvous"):
        with pytest.raises(GradwireTimeout, match=rf"could not join the job at the scheduler 127.0.0.1:{port} in 1.5s"):
            join(config, "worker")
    assert 1.0 <= time.monotonic() - started <= 4.0
    assert len(caplog.records) <= 1  # said every 5 s at most, not once per try


def test_the_waiting_is_said_every_few_seconds_not_every_try(caplog, monkeypatch):
    import gradwire.scheduler.client as client

    clock = [0.0]
    monkeypatch.setattr(client.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    port = _free_port()
    config = Config(num_workers=1, num_servers=1, scheduler=f"127.0.0.1:{port}", timeout=30.0)
    with caplog.at_level(logging.WARNING, logger="gradwire.rendezvous"):
        with pytest.raises(GradwireTimeout, match=r"\d+ tries"):
            join(config, "server", clock=lambda: clock[0])
    # 30 s of backoff (0.05 s doubling to 2 s): about 20 tries, and a line every 5 s
    assert 4 <= len(caplog.records) <= 7, [r.getMessage() for r in caplog.records]
    assert all(f"127.0.0.1:{port}" in r.getMessage() for r in caplog.records)


def _with(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def test_a_scheduler_that_restarts_during_the_rendezvous_is_joined_again():
    port = _free_port()
    base = Config(num_workers=1, num_servers=1, scheduler=f"127.0.0.1:{port}", timeout=20.0, switch_interval=0)
    first = Scheduler(_with(base, role="scheduler")).start()
    started, errors = [], []

    def worker():
        try:
            started.append(Worker(_with(base, rank=0)).start())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    deadline = time.monotonic() + 10
    while not first.roster.nodes and time.monotonic() < deadline:  # registered, waiting for the server
        time.sleep(0.01)
    assert first.roster.nodes
    first.stop()  # the scheduler goes away mid-rendezvous ...
    second = Scheduler(_with(base, role="scheduler")).start()  # ... and comes back at its address
    server = Server(_with(base, role="server")).start()
    t.join(30)
    try:
        assert not errors and started, errors
        assert started[0].push_pull(np.ones(10, np.float32), "again")[0] == 1.0
    finally:
        for w in started:
            w.shutdown()
        second.wait(5)
        server.stop()
        second.stop()


def test_a_stopped_server_leaves_no_acceptor_running():
    """Server.stop() wakes the threads blocked in accept() (a bare close() left them, and the port, for the life of
    the process: one per listener and server of every in-process job)."""

    def acceptors():
        return [t for t in threading.enumerate() if t.name == "gw-server-accept"]

    before = len(acceptors())
    with LocalCluster(num_workers=1, num_servers=2):
        assert len(acceptors()) == before + 4  # TCP and Unix, per server
    deadline = time.monotonic() + 5
    while len(acceptors()) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(acceptors()) == before
