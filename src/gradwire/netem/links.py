"""How busy every emulated link is over time: the bytes each bridge port moved, sampled in a thread.

Every host's veth ends on a port of the cluster's bridge, so the bridge's namespace sees all traffic: a port's
received bytes are what its host sent (after the host's upload shaper), its transmitted bytes what the host got (after
the download shaper). A `sleep` started in that namespace lets us read them from /proc/<pid>/net/dev, with no process
started per sample. Used by `gradwire bench --netem --links DIR` (docs/netem.md): it showed the dedicated and the
colocated servers' bytes leaving at different paces within a step, which pacing fixed (docs/placement.md).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Sequence

from gradwire.errors import GradwireError
from gradwire.netem.cluster import EmulatedCluster
from gradwire.netem.topology import parse_rate


class LinkSampler:
    """`start()`, run a job, `stop()`; then `samples` holds (monotonic time, {link: bytes}) and `utilization()` the
    fraction of each link's rate used between samples. Links are named "<host> up" and "<host> down"."""

    def __init__(self, cluster: EmulatedCluster, interval: float = 0.05) -> None:
        self.interval = interval
        self.cluster = cluster
        self._ports = {f"v{cluster.run_id}{i}": h for i, h in enumerate(cluster.topology.hosts)}
        self.rates = {}  # link -> bytes per second
        for host in cluster.topology.hosts:
            self.rates[f"{host.name} up"] = parse_rate(host.up) / 8
            self.rates[f"{host.name} down"] = parse_rate(host.down) / 8
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._first = threading.Event()

    def start(self) -> LinkSampler:
        self._proc = self.cluster.spawn_in(self.cluster.bridge_namespace, ["sleep", "infinity"])
        self._stop.clear()
        self._first.clear()
        self._thread = threading.Thread(target=self._run, name="gw-link-sampler", daemon=True)
        self._thread.start()
        if not self._first.wait(10):
            self.stop()
            raise GradwireError(f"cannot read the bridge's counters of emulated cluster {self.cluster.run_id}")
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def _run(self) -> None:
        assert self._proc is not None
        path = f"/proc/{self._proc.pid}/net/dev"
        while not self._stop.is_set():
            try:
                with open(path) as f:
                    text = f.read()
            except OSError:  # not yet inside the namespace, or gone
                text = ""
            counters = self._parse(text)
            if counters:
                self.samples.append((time.monotonic(), counters))
                self._first.set()
            self._stop.wait(self.interval)

    def _parse(self, text: str) -> dict[str, int]:
        out = {}
        for line in text.splitlines()[2:]:
            name, _, fields = line.partition(":")
            host = self._ports.get(name.strip())
            if host is None:
                continue
            values = fields.split()
            out[f"{host.name} up"] = int(values[0])  # the port received what the host sent
            out[f"{host.name} down"] = int(values[8])  # and transmitted what the host got
        return out

    def utilization(self, every: int = 1) -> list[tuple[float, dict[str, float]]]:
        """(seconds since the first sample, {link: fraction of its rate}) between every `every`-th sample."""
        if len(self.samples) < 2:
            return []
        t0 = self.samples[0][0]
        picked = self.samples[::every]
        rows = []
        for (ta, a), (tb, b) in zip(picked, picked[1:], strict=False):
            dt = tb - ta
            rows.append((ta - t0, {k: (b[k] - a[k]) / dt / self.rates[k] for k in a if k in b}))
        return rows

    def busy(self, links: Sequence[str], threshold: float = 0.5) -> dict[str, float]:
        """Each link's mean use over the samples where some link ran above `threshold` of its rate: how busy the
        links are while the job moves data (start-up and barriers left out)."""
        rows = [u for _, u in self.utilization() if u and max(u.values()) > threshold]
        return {k: sum(u.get(k, 0.0) for u in rows) / len(rows) if rows else 0.0 for k in links}

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"rates_bytes_per_s": self.rates, "samples": self.samples}, f)


def plot(sampler: LinkSampler, path: str, title: str, every: int = 2) -> None:
    """Each link's use over time, one line per link, workers' and servers' links apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sampler.utilization(every)
    links = [k for k in sampler.rates if not k.startswith("sched") and any(k in u for _, u in rows)]
    fig, axes = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
    for ax, role in zip(axes, ("w", "s"), strict=True):
        for link in (k for k in links if k.startswith(role)):
            ax.plot([t for t, _ in rows], [u.get(link, 0) * 100 for _, u in rows], label=link, lw=0.8)
        ax.set_ylabel(("workers'" if role == "w" else "servers'") + " links, % of rate")
        ax.set_ylim(0, 120)
        ax.legend(fontsize=6, ncol=4, loc="lower right")
    axes[0].set_title(title)
    axes[1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
