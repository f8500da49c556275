"""Test helpers shipped with the package: a whole cluster in one process.

`LocalCluster` runs the scheduler and the servers as threads of this process over real loopback TCP, and
starts `num_workers` `Worker` objects (each in its own thread, since `start` blocks in rendezvous). It is
what most of gradwire's own tests use, and it suits users' tests of code that calls gradwire.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gradwire.config import Config
from gradwire.scheduler import Scheduler
from gradwire.server import Server
from gradwire.session import use_worker
from gradwire.transport.tcp import ConnectionClosed
from gradwire.worker import Worker

T = TypeVar("T")


class FakeClock:
    """A clock for tests: `clock()` returns the time, `advance(s)` moves it. Thread-safe enough for reads."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class LocalCluster:
    """A scheduler, `num_servers` servers and `num_workers` workers in this process. A context manager."""

    def __init__(
        self,
        num_workers: int = 2,
        num_servers: int = 1,
        clock: Callable[[], float] | None = None,
        colocated: int = 0,
        hosts: int = 0,
        standby_schedulers: int = 0,
        server_config: dict[int, dict] | None = None,
        **config: object,
    ) -> None:
        """`colocated` of the `num_servers` servers say they run on a worker host (GRADWIRE_COLOCATED); here every
        node shares this process's host, unless `hosts` > 0: then the workers act as if on that many hosts (ranks in
        contiguous blocks), colocated server c on host c % hosts, each dedicated server on a host of its own
        (GRADWIRE_HOST_ID: between hosts, sockets instead of shared memory). `standby_schedulers`: standby schedulers
        (`standby_schedulers` in this object), their addresses in every node's GRADWIRE_SCHEDULER_STANDBY.
        `server_config`: settings of server i (by its start order) that differ from the others'."""
        self._server_overrides = server_config or {}
        base = Config(
            num_workers=num_workers,
            num_servers=num_servers,
            timeout=30.0,
            switch_interval=0,
            explicit=frozenset(config),
            **config,  # type: ignore[arg-type]
        )
        standby = dataclasses.replace(base, role="scheduler", standby=True)
        self.standby_schedulers = [Scheduler(standby).start() for _ in range(standby_schedulers)]
        if self.standby_schedulers:
            base = dataclasses.replace(base, scheduler_standby=",".join(s.address for s in self.standby_schedulers))
        scheduler_config = dataclasses.replace(base, role="scheduler")
        self.scheduler = (Scheduler(scheduler_config, clock) if clock else Scheduler(scheduler_config)).start()
        base = dataclasses.replace(base, scheduler=self.scheduler.address)
        self.config = base
        self.servers: list[Server] = []
        self.workers: list[Worker] = []
        self.standby: list[Server] = []
        num_standby = base.num_standby
        configs = [self._server_config(i, num_servers, colocated, hosts) for i in range(num_servers + num_standby)]
        starters = [threading.Thread(target=self._start_server, args=(c,)) for c in configs]
        for t in starters:
            t.start()
        with ThreadPoolExecutor(num_workers) as pool:
            self.workers = list(pool.map(lambda r: Worker(self._worker_config(r, hosts)).start(), range(num_workers)))
        for t in starters:
            t.join()
        self.standby = [s for s in self.servers if s.standby]
        self.servers = sorted((s for s in self.servers if not s.standby), key=lambda s: s.rank)

    def _server_config(self, i: int, num_servers: int, colocated: int, hosts: int) -> Config:
        """Server `i`'s (the last `colocated` of the `num_servers` on worker hosts; standby ones after them)."""
        on_host = i - (num_servers - colocated)  # the colocated servers' host index (negative: a host of its own)
        return dataclasses.replace(
            self.config,
            role="server",
            standby=i >= num_servers,
            colocated=0 <= on_host < colocated,
            host_id=_host(hosts, on_host, f"server{i}") if hosts else "",
            **self._server_overrides.get(i, {}),
        )

    def _worker_config(self, rank: int, hosts: int) -> Config:
        host = _host(hosts, rank * hosts // self.config.num_workers) if hosts else ""
        return dataclasses.replace(self.config, rank=rank, host_id=host)

    def kill_server(self, rank: int) -> Server:
        """Stop server `rank` abruptly (its connections close as if its process died); returns it."""
        server = next(s for s in self.servers if s.rank == rank)
        server.stop()
        return server

    def kill_scheduler(self) -> str:
        """Stop the scheduler abruptly (its connections close as if its process died); returns its address."""
        self.scheduler.stop()
        return self.scheduler.address

    def restart_scheduler(self) -> Scheduler:
        """Start a scheduler at the stopped one's address, as a restarted process would: the nodes report to it and
        it resumes the job (scheduler/recovery.py)."""
        config = dataclasses.replace(self.config, role="scheduler", scheduler=self.scheduler.address)
        self.scheduler = Scheduler(config).start()
        return self.scheduler

    def start_standby_scheduler(self, address: str) -> Scheduler:
        """A new standby scheduler at `address` (a dead one's, as `gradwire launch` starts one)."""
        config = dataclasses.replace(self.config, role="scheduler", scheduler=address, standby=True)
        standby = Scheduler(config).start()
        self.standby_schedulers.append(standby)
        return standby

    def await_takeover(self, timeout: float = 30.0) -> Scheduler:
        """The standby scheduler that has taken the job over (it becomes `scheduler`); TimeoutError if none has in
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for standby in self.standby_schedulers:
                if standby.recovery.done.is_set():
                    self.standby_schedulers.remove(standby)
                    self.scheduler = standby
                    return standby
            time.sleep(0.01)
        raise TimeoutError(f"no standby scheduler took the job over in {timeout:g}s")

    def kill_worker(self, rank: int) -> Worker:
        """Cut worker `rank` off abruptly (its connections close without a bye, as if its process died)."""
        worker = next(w for w in self.workers if w.rank == rank)
        worker.state.closed = True  # its own threads stay quiet about it
        if worker.state.native is not None:  # the native loop lets go of the sockets before they close under it
            worker.state.native.stop(ConnectionClosed(f"worker {rank} was killed"))
        if worker.control.conn is not None:
            worker.control.conn.close()
        for link in worker.links:
            link.conn.close()
        self.workers.remove(worker)
        return worker

    def add_worker(self) -> threading.Thread:
        """Start one more worker (elastic jobs: it joins at the next reset); it is in `workers` once started."""

        def start() -> None:
            worker = Worker(dataclasses.replace(self.config, rank=None)).start()
            self.workers.append(worker)

        thread = threading.Thread(target=start, daemon=True)
        thread.start()
        return thread

    def _start_server(self, config: Config) -> None:
        self.servers.append(Server(config).start())

    def run(self, fn: Callable[[Worker], T]) -> list[T]:
        """Call fn(worker) on every worker at once (one thread each); returns results in rank order."""
        with ThreadPoolExecutor(len(self.workers)) as pool:
            return list(pool.map(fn, self.workers))

    def run_ranks(self, fn: Callable[[int], T]) -> list[T]:
        """Call fn(rank) on every worker at once, each worker current in its thread (`gradwire.use_worker`, so the
        module functions and the frameworks' APIs act on it); returns results in rank order."""

        def as_current(worker: Worker) -> T:
            with use_worker(worker):
                return fn(worker.rank)

        return self.run(as_current)

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.wait(5)
        for server in self.servers + self.standby:
            server.stop()
        self.scheduler.stop()
        for standby in self.standby_schedulers:
            standby.stop()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _host(hosts: int, index: int, alone: str = "") -> str:
    """The host identity LocalCluster gives host `index` of `hosts` (a negative index: a node on a host of its own)."""
    return f"local-host-{index % hosts}" if index >= 0 else f"local-{alone}"
