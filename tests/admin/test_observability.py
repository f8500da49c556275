"""The admin endpoint, metrics, cluster status and the timeline, on an in-process cluster."""

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from gradwire import tuning
from gradwire.admin.timeline import Timeline, path_for
from gradwire.testing import LocalCluster


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.headers.get("Content-Type"), r.read().decode()


def _samples(text, name):
    """{labels string: value} of one metric in Prometheus text format."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            out[key[len(name) :]] = float(value)
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    timeline = str(tmp_path_factory.mktemp("tl") / "trace.json")
    with LocalCluster(
        num_workers=2, num_servers=2, partition_bytes=64 << 10, heartbeat_interval=0.2, timeline=timeline
    ) as c:
        yield c


def test_healthz_and_unknown_paths(cluster):
    base = cluster.workers[0].admin.http.url
    assert _get(base + "/healthz")[2] == "ok\n"
    with pytest.raises(urllib.error.HTTPError) as e:
        _get(base + "/nope")
    e.value.close()
    assert e.value.code == 404


def test_pushed_bytes_in_metrics_equal_what_was_sent(cluster):
    sizes = [1, 1000, 100_000, 300_001]  # elements of float32; some span several partitions
    worker = cluster.workers[0]
    before = _samples(_get(worker.admin.http.url + "/metrics")[2], "gradwire_pushed_bytes_total")

    def job(w):
        for i, n in enumerate(sizes):
            w.push_pull(np.ones(n, np.float32), f"m{i}")

    cluster.run(job)
    status, ctype, text = _get(worker.admin.http.url + "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    after = _samples(text, "gradwire_pushed_bytes_total")
    assert after['{role="worker"}'] - before.get('{role="worker"}', 0) == 4 * sum(sizes)
    stages = _samples(text, "gradwire_partition_stage_seconds_count")
    assert set(stages) == {'{stage="queued"}', '{stage="push"}', '{stage="wait"}', '{stage="pull"}'}
    # and the servers received exactly that, from both workers
    received = sum(
        _samples(_get(s.admin.http.url + "/metrics")[2], "gradwire_pushed_bytes_total")['{role="server"}']
        for s in cluster.servers
    )
    assert received == worker.metrics.bytes_pushed + cluster.workers[1].metrics.bytes_pushed
    assert "gradwire_ring_occupancy" in _get(cluster.servers[0].admin.http.url + "/metrics")[2]


def test_scheduler_status_lists_every_node_with_its_admin_port(cluster):
    status = json.loads(_get(cluster.scheduler.admin_url + "/status")[2])
    assert status["phase"] == "running" and status["healthy"]
    roles = sorted((n["role"], n["rank"]) for n in status["nodes"])
    assert roles == [("server", 0), ("server", 1), ("worker", 0), ("worker", 1)]
    for node in status["nodes"]:
        assert node["state"] == "alive"
        assert json.loads(_get(node["admin"] + "/status")[2])["rank"] == node["rank"]
    assert [s["rank"] for s in status["servers"]] == [0, 1]
    text = _get(cluster.scheduler.admin_url + "/metrics")[2]
    assert _samples(text, "gradwire_nodes") == {
        '{role="server",state="alive"}': 2.0,
        '{role="worker",state="alive"}': 2.0,
    }


def test_heartbeats_carry_counters_to_the_scheduler(cluster):
    import time

    cluster.run(lambda w: w.push_pull(np.ones(50_000, np.float32), "hb"))
    time.sleep(0.6)  # three heartbeat intervals
    status = json.loads(_get(cluster.scheduler.admin_url + "/status")[2])
    workers = [n for n in status["nodes"] if n["role"] == "worker"]
    assert all(n["heartbeat_age_seconds"] < 0.6 and n["stats"]["bytes_pushed"] > 0 for n in workers)


def test_timeline_is_valid_json_with_every_stage(cluster):
    cluster.run(lambda w: w.push_pull(np.ones(100_000, np.float32), "tl"))
    for w in cluster.workers:
        w.timeline.flush()
        trace = json.loads(Path(w.timeline.path).read_text())
        events = trace["traceEvents"]
        stages = {e["name"] for e in events if e["ph"] == "X"}
        assert stages == {"queued", "push", "wait", "pull"}
        assert any(e["ph"] == "C" and e["name"] == "bytes in flight" for e in events)
        names = {e["args"]["name"] for e in events if e["ph"] == "M"}
        assert f"worker {w.rank}" in names and "server 0" in names
    # one time base for every worker (the job's wall clock, in microseconds): the same step lies side by side
    firsts = []
    for w in cluster.workers:
        events = json.loads(Path(w.timeline.path).read_text())["traceEvents"]
        firsts.append(min(e["ts"] for e in events if e["ph"] == "X"))
    assert all(abs(ts / 1e6 - time.time()) < 60 for ts in firsts), firsts
    assert abs(firsts[0] - firsts[1]) < 5e6, firsts


def test_timeline_keeps_only_the_last_steps_and_stays_valid(tmp_path):
    path = str(tmp_path / "t.json")
    tl = Timeline(path, rank=3, steps=2)
    for step in range(5):
        tl.new_step()
        tl.complete("push", step, step + 0.5, 0, {"step": step})
    tl.flush()
    kept = [e["args"]["step"] for e in json.loads(Path(path).read_text())["traceEvents"] if e["ph"] == "X"]
    assert kept == [3, 4]
    tl.close()
    assert path_for("out/{rank}.json", 2) == "out/2.json" and path_for("trace.json", 1) == "trace.rank1.json"


def test_status_shows_the_data_path_settings_chosen_from_the_measured_links(cluster):
    chosen = json.loads(_get(cluster.scheduler.admin_url + "/status")[2])["data_path"]
    assert chosen["rate_bytes_per_s"] > 0 and 0 < chosen["rtt_seconds"] < 1.0  # measured at the rendezvous
    assert "Mbit/s per worker, RTT" in chosen["reason"]
    # derived from what was measured (how fast loopback reads depends on the machine's load: 2-20 Gbit/s seen, so 1-4
    # MiB partitions), and far larger than slow links get (20 Mbit/s: 16 KiB, tests/unit/test_tuning.py)
    again = tuning.derive([chosen["rate_bytes_per_s"]], chosen["rtt_seconds"])
    assert (chosen["partition_bytes"], chosen["window"]) == (again.partition_bytes, again.window)
    assert chosen["partition_bytes"] >= 256 << 10, chosen["reason"]
    mine = cluster.workers[0].status()["data_path"]
    assert mine["partition_bytes"] == 64 << 10 and mine["set_explicitly"] == ["partition_bytes"]  # the test's wins
