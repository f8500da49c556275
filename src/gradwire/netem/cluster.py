"""Build, use and tear down an emulated cluster: one network namespace per host, all on one bridge.

Layout, for a run id R (unique per run, so two runs never collide):
- namespace `gwR-br` holds the bridge `br0`; the root namespace is never touched;
- namespace `gwR-<host>` per host, with `eth0` (one end of a veth) at the host's address in 198.18.0.0/16; both
  ends of every veth take the topology's MTU;
- the veth's other end, `vR<i>`, is a port of the bridge;
- tbf on the host's `eth0` shapes its upload, tbf on the bridge port shapes its download (tbf `burst 64kb latency
  50ms`, which measured 95.7% of the rate for one TCP stream); an optional delay is netem under the tbf.

Deleting a namespace deletes its veth ends and qdiscs, so teardown is deleting every namespace of the run. It
runs on exit, on error, on Ctrl-C (SIGINT and SIGTERM become KeyboardInterrupt while a cluster is up), and as a
last resort at interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence

from gradwire.errors import GradwireError
from gradwire.netem.topology import Host, Topology

log = logging.getLogger("gradwire.netem")


class NetemUnavailable(GradwireError):
    """This machine cannot emulate a cluster (not root, or iproute2/tc missing)."""


def check_available() -> None:
    """Raise NetemUnavailable saying why, if namespaces and tc cannot be used here."""
    if os.geteuid() != 0:
        raise NetemUnavailable("the emulated cluster needs root (network namespaces, veth and tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetemUnavailable(f"`{tool}` not found: install iproute2 (apt-get install iproute2)")


class EmulatedCluster:
    """A context manager: `with EmulatedCluster(topology) as c: c.spawn(host, argv)`."""

    def __init__(self, topology: Topology, run_id: str | None = None) -> None:
        check_available()
        self.topology = topology
        self.run_id = run_id or secrets.token_hex(3)
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._previous: dict[int, object] = {}

    def namespace(self, host: Host) -> str:
        return f"gw{self.run_id}-{host.name}"

    @property
    def bridge_namespace(self) -> str:
        return f"gw{self.run_id}-br"

    def __enter__(self) -> EmulatedCluster:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, _interrupt)
        atexit.register(self.teardown)
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _build(self) -> None:
        br = self.bridge_namespace
        self._add_namespace(br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i, host in enumerate(self.topology.hosts):
            ns, port = self.namespace(host), f"v{self.run_id}{i}"
            self._add_namespace(ns)
            _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", port, "netns", br)
            _ip("-n", br, "link", "set", port, "mtu", str(self.topology.mtu), "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{host.address}/16", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "mtu", str(self.topology.mtu), "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _shape(ns, "eth0", host.up, host.delay_ms)
            _shape(br, port, host.down, host.delay_ms)
        log.info("emulated cluster %s: %d hosts", self.run_id, len(self.topology.hosts))

    def reshape(self, rate: str) -> None:
        """Every link to `rate` from now on, both ways (tc's spelling): links that get slower or faster mid-job, as
        when another job starts or stops sharing the network."""
        for i, host in enumerate(self.topology.hosts):
            if host.delay_ms > 0:
                raise GradwireError("reshape() changes rate-only links (no netem delay)")
            for ns, dev in ((self.namespace(host), "eth0"), (self.bridge_namespace, f"v{self.run_id}{i}")):
                _run(["tc", "-n", ns, "qdisc", "change", "dev", dev, "root", *_tbf(rate)])

    def cut(self, host: Host, off: bool = True) -> None:
        """Cut `host` off from every other host, both ways, while its processes live on (its port on the bridge down:
        nothing passes, and nothing tells either side); `off=False` mends it."""
        port = f"v{self.run_id}{self.topology.hosts.index(host)}"
        _ip("-n", self.bridge_namespace, "link", "set", port, "down" if off else "up")

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)

    def spawn(
        self, host: Host, argv: Sequence[str], env: Mapping[str, str] | None = None, **popen: object
    ) -> subprocess.Popen:
        """Start a process inside a host's namespace; it is killed at teardown if still running."""
        return self.spawn_in(self.namespace(host), argv, env, **popen)

    def spawn_in(
        self, namespace: str, argv: Sequence[str], env: Mapping[str, str] | None = None, **popen: object
    ) -> subprocess.Popen:
        """Start a process inside one of this run's namespaces (a host's, or the bridge's)."""
        if namespace not in self._namespaces:
            raise GradwireError(f"{namespace} is not a namespace of emulated cluster {self.run_id}")
        proc = subprocess.Popen(["ip", "netns", "exec", namespace, *argv], env=dict(env or os.environ), **popen)  # type: ignore[call-overload]
        self._procs.append(proc)
        return proc

    def teardown(self) -> None:
        """Kill what was started here and delete every namespace of this run. Idempotent."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self._procs.clear()
        for name in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._namespaces.clear()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
        atexit.unregister(self.teardown)

    def leftovers(self) -> list[str]:
        """Namespaces and links of this run that still exist (empty after teardown)."""
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        found = [line.split()[0] for line in namespaces.splitlines() if line.startswith(f"gw{self.run_id}-")]
        found += [line for line in links.splitlines() if f"v{self.run_id}" in line]
        return found


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _tbf(rate: str) -> list[str]:
    return ["tbf", "rate", rate, "burst", "64kb", "latency", "50ms"]


def _shape(ns: str, dev: str, rate: str, delay_ms: float) -> None:
    tbf = _tbf(rate)
    if delay_ms > 0:
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms"])
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf])
    else:
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf])


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise GradwireError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
