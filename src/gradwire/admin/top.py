"""`gradwire top`: a terminal view of the scheduler's /status, refreshing.

gradwire top http://127.0.0.1:PORT        (the scheduler prints its admin URL at start; so does the launcher)
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

MB = 1e6


def fetch(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=timeout) as r:
        return json.loads(r.read())


def render(status: dict) -> str:
    """The screen: the job's phase, then a line per node with rounds/s and MB/s (between its last two heartbeats)."""
    head = (
        f"gradwire  phase {status['phase']}  epoch {status['epoch']}  "
        f"{'healthy' if status['healthy'] else 'UNHEALTHY'}  tensors {status['tensors']}  "
        f"declared {status['declared_bytes'] / MB:.1f} MB"
    )
    lines = [head]
    if status.get("abort_reason"):
        lines.append(f"aborted: {status['abort_reason']}")
    data_path = status.get("data_path")
    if data_path:  # derived from the measured links (gradwire/tuning.py)
        lines.append(
            f"data path: {data_path['partition_bytes'] // 1024} KiB partitions, window {data_path['window']}: "
            f"{data_path['reason']}"
            + (f" (derived again: {data_path['derived_for']})" if data_path.get("derived_for") else "")
        )
    local = status.get("local_aggregation")
    if local:  # several workers per host: each host's sum crosses its link once (worker/aggregation.py)
        hosts = "; ".join(
            f"workers {','.join(map(str, h['workers']))} on server {','.join(map(str, h['colocated_servers']))}"
            for h in local["hosts"]
        )
        lines.append(
            f"local aggregation: {'on' if local['on'] else 'off'} ({local['why']})" + (f": {hosts}" if hosts else "")
        )
    lines.append(f"{'node':<10} {'state':<6} {'rounds/s':>9} {'MB/s':>9} {'placed MB':>10} {'hb age':>7}  admin")
    placed = {s["rank"]: s["placed_bytes"] for s in status.get("servers", [])}
    for n in status["nodes"]:
        rounds = n["rounds_per_s"]  # between the node's last two heartbeats
        load = f"{placed.get(n['rank'], 0) / MB:10.1f}" if n["role"] == "server" else " " * 10
        lines.append(
            f"{n['role'] + ' ' + str(n['rank']):<10} {n['state']:<6} {rounds:9.1f} "
            f"{n['throughput_bytes_per_s'] / MB:9.1f} {load} {n['heartbeat_age_seconds']:6.1f}s  "
            f"{n['admin'] or '-'}"
        )
    return "\n".join(lines)


def main(url: str, interval: float = 1.0, once: bool = False) -> int:
    while True:
        try:
            status = fetch(url)
        except (urllib.error.URLError, OSError) as e:
            print(f"gradwire top: cannot read {url}/status: {e}", file=sys.stderr)
            return 1
        screen = render(status)
        if once:
            print(screen)
            return 0
        sys.stdout.write("\x1b[H\x1b[2J" + screen + "\n")
        sys.stdout.flush()
        if status["phase"] in ("done", "aborted"):
            return 0
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return 0
