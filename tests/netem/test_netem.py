"""The emulated cluster: shaped links, a gradwire job across hosts, and teardown that leaves nothing."""

import json
import os
import subprocess
import sys
import time

import pytest

from gradwire import split
from gradwire.netem import EmulatedCluster, NetemUnavailable, Topology
from gradwire.netem.cli import RECEIVER, SENDER, measure_link
from gradwire.netem.cluster import check_available
from gradwire.netem.jobs import start_gradwire
from gradwire.netem.links import LinkSampler
from tests.multiprocess.harness import ROOT

try:
    check_available()
except NetemUnavailable as e:
    pytest.skip(f"no emulated network here: {e}", allow_module_level=True)

pytestmark = pytest.mark.netem


def test_a_shaped_link_runs_at_its_configured_rate():
    bits_per_s = measure_link("20mbit", 6 << 20)
    assert 0.8 * 20e6 <= bits_per_s <= 1.2 * 20e6, bits_per_s


def test_the_link_sampler_sees_a_transfer_on_the_links_it_crossed(tmp_path):
    nbytes = 3 << 20
    topo = Topology(workers=1, servers=1, worker_rate="40mbit", server_rate="40mbit")
    with EmulatedCluster(topo) as c:
        worker, server = topo.of("worker")[0], topo.of("server")[0]
        sampler = LinkSampler(c, interval=0.05).start()
        rx = c.spawn(server, [sys.executable, "-c", RECEIVER, server.address], stdout=subprocess.PIPE, text=True)
        port = rx.stdout.readline().strip()
        c.spawn(worker, [sys.executable, "-c", SENDER, server.address, port, str(nbytes)]).wait(60)
        rx.communicate(timeout=60)
        time.sleep(0.2)
        sampler.stop()
        sampler.write(str(tmp_path / "links.json"))
    first, last = sampler.samples[0][1], sampler.samples[-1][1]
    moved = {k: last[k] - first[k] for k in last}
    # payload plus TCP/IP and Ethernet headers (about 4.5% at a 1500-byte MTU)
    assert nbytes <= moved["w0 up"] <= 1.1 * nbytes and nbytes <= moved["s0 down"] <= 1.1 * nbytes, moved
    assert moved["w0 down"] < 0.05 * nbytes and moved["s0 up"] < 0.05 * nbytes, moved  # ACKs only
    busy = sampler.busy(["w0 up", "s0 down", "s0 up"])
    assert busy["w0 up"] > 0.8 and busy["s0 down"] > 0.8 and busy["s0 up"] < 0.1, busy
    assert json.loads((tmp_path / "links.json").read_text())["rates_bytes_per_s"]["w0 up"] == 40e6 / 8


@pytest.mark.parametrize("mtu", [1500, 9000])
def test_every_link_carries_frames_of_the_topologys_mtu(mtu):
    """The MTU holds end to end: a TCP connection between two hosts (through both veths and the bridge) settles on
    segments that fill frames of that size (MSS = MTU - 40 bytes of headers - 12 of timestamps)."""
    topo = Topology(workers=1, servers=1, worker_rate="80mbit", server_rate="80mbit", mtu=mtu)
    sender = (
        "import socket, sys; c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); c.sendall(b'x' * 100000);"
        "print(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG), flush=True)"
    )
    with EmulatedCluster(topo) as c:
        worker, server = topo.of("worker")[0], topo.of("server")[0]
        rx = c.spawn(server, [sys.executable, "-c", RECEIVER, server.address], stdout=subprocess.PIPE, text=True)
        port = rx.stdout.readline().strip()
        tx = c.spawn(worker, [sys.executable, "-c", sender, server.address, port], stdout=subprocess.PIPE, text=True)
        segment = int(tx.communicate(timeout=60)[0])
        rx.communicate(timeout=60)
    assert mtu - 64 <= segment <= mtu - 40, segment
    with pytest.raises(ValueError, match="MTU"):
        Topology(workers=1, servers=1, mtu=65536)


def test_a_workers_status_shows_its_links_jumbo_frames():
    """/status's servers[].tcp_segment_bytes: what a user checks to see that the job's links run jumbo frames."""
    topo = Topology(workers=2, servers=2, worker_rate="200mbit", server_rate="200mbit", mtu=9000)
    code = (
        "import json, numpy as np, gradwire as gw; gw.init(); gw.push_pull(np.ones(1000, np.float32), name='x');"
        "print('SEGMENTS ' + json.dumps([s['tcp_segment_bytes'] for s in gw.current_worker().status()['servers']]),"
        " flush=True); gw.shutdown()"
    )
    with EmulatedCluster(topo) as c:
        with start_gradwire(c, [sys.executable, "-c", code], env={"GRADWIRE_TRANSPORT": "tcp"}) as job:
            outputs = job.wait(timeout=120)
    for out in outputs:
        (line,) = [line for line in out.splitlines() if line.startswith("SEGMENTS ")]
        assert json.loads(line.split(" ", 1)[1]) == [8948, 8948], out


def test_netem_run_runs_a_job_and_cleans_up():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradwire",
            "netem",
            "run",
            "-n",
            "2",
            "-s",
            "1",
            "--worker-rate",
            "200mbit",
            "--server-rate",
            "200mbit",
            "--",
            sys.executable,
            str(ROOT / "examples" / "sum_numpy.py"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[worker 1] rank 1/2: sum 3 (expected 3)" in out.stdout
    run_id = out.stdout.split("run ", 1)[1].split(":", 1)[0]
    assert run_id not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_a_gradwire_job_across_emulated_hosts_sums_correctly():
    topo = Topology(workers=2, servers=2, worker_rate="200mbit", server_rate="200mbit")
    with EmulatedCluster(topo) as c:
        with start_gradwire(c, [sys.executable, str(ROOT / "tests" / "multiprocess" / "job.py"), "ok", "netem"]) as job:
            outputs = job.wait(timeout=120)
    for rank, out in enumerate(outputs):
        assert f"DONE rank {rank} of 2" in out, out


def test_auto_placement_measures_the_links_and_splits_as_the_configured_truth_would():
    """Servers at a quarter of the workers' rate, colocated servers beside the workers: the scheduler measures
    every link (GRADWIRE_PLACEMENT=auto) and must find the configured rates within 25%, and a split within 0.05 of
    the one the true rates give; the colocated job's sums are exact."""
    topo = Topology(workers=3, servers=1, worker_rate="100mbit", server_rate="25mbit", colocate=True)
    script = [sys.executable, str(ROOT / "tests" / "netem" / "placement_job.py")]
    with EmulatedCluster(topo) as c:
        with start_gradwire(c, script, os.environ | {"GRADWIRE_PLACEMENT": "auto"}) as job:
            outputs = job.wait(timeout=120)
    placements = [json.loads(out.split("PLACEMENT ", 1)[1].splitlines()[0]) for out in outputs]
    assert all(p == placements[0] for p in placements)  # every worker got the same
    chosen = placements[0]
    rates = chosen["rates_bytes_per_s"]
    for rate in rates["worker_hosts"]:
        assert 0.75 * 100e6 / 8 <= rate <= 1.25 * 100e6 / 8, rates
    assert 0.75 * 25e6 / 8 <= rates["servers"][0] <= 1.25 * 25e6 / 8, rates
    efficiency = chosen["server_efficiency"]  # GRADWIRE_SERVER_EFFICIENCY, applied to the dedicated server's rate
    truth = split.optimal(1.0, [100e6 / 8] * 3, [efficiency * 25e6 / 8])
    assert abs(chosen["dedicated_fraction"] - truth.dedicated_fraction) <= 0.05, (chosen, truth)
    assert chosen["colocated"] == [False, True, True, True]


def test_the_partition_size_chosen_for_20_mbit_links_is_far_below_loopback_s():
    """No GRADWIRE_* tuning set: the scheduler measures the links and derives the data path's settings."""
    script = [sys.executable, str(ROOT / "tests" / "netem" / "placement_job.py")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADWIRE_")}
    with EmulatedCluster(Topology(workers=2, servers=2, worker_rate="20mbit", server_rate="20mbit")) as c:
        with start_gradwire(c, script, env) as job:
            outputs = job.wait(timeout=120)
    shaped = [json.loads(out.split("DATA_PATH ", 1)[1].splitlines()[0]) for out in outputs]
    loopback = subprocess.run(
        [sys.executable, "-m", "gradwire", "launch", "-n", "2", "-s", "2", "--", *script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert loopback.returncode == 0, loopback.stdout + loopback.stderr
    local = json.loads(loopback.stdout.split("DATA_PATH ", 1)[1].splitlines()[0])
    assert shaped[0] == shaped[1] and "Mbit/s" in shaped[0]["why"] and not shaped[0]["set_explicitly"]
    # 128 KiB in flight per worker over its two servers: 4 partitions of 16 KiB per server
    assert shaped[0]["partition_bytes"] == 16 << 10 and shaped[0]["window"] == 4, shaped
    assert local["partition_bytes"] >= 64 * shaped[0]["partition_bytes"], (local, shaped)


def test_torchrun_across_two_emulated_hosts_starts_gradwire_by_itself():
    """Two hosts, `torchrun --nnodes 2 --nproc-per-node 2` with c10d rendezvous on the first: nothing but
    gradwire.init() in the script; correct sums, a trained model, and no gradwire process left afterwards."""
    import uuid

    marker = uuid.uuid4().hex
    topo = Topology(workers=2, servers=1)  # the server host stays idle: torchrun's nodes bring their own servers
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADWIRE_")} | {"PYTHONUNBUFFERED": "1"}
    job = str(ROOT / "tests" / "multiprocess" / "torchrun_job.py")
    with EmulatedCluster(topo) as c:
        first = topo.of("worker")[0]
        pick = "import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1])"
        port = c.spawn(first, [sys.executable, "-c", pick, first.address], stdout=subprocess.PIPE, text=True)
        port = port.communicate(timeout=30)[0].strip()  # a free port in that host's namespace, for the rendezvous
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{first.address}:{port}", "--rdzv-id", marker]
        # the namespaces share this machine's hostname, so each node says its address (--local-addr) and which
        # one hosts the rendezvous (is_host), as hosts with their own names would not need to
        procs = [
            c.spawn(
                h,
                argv + ["--local-addr", h.address, "--rdzv-conf", f"is_host={str(h is first).lower()}", job, marker],
                env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for h in topo.of("worker")
        ]
        outputs = [p.communicate(timeout=180)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
        text = "\n".join(outputs)
        for rank in range(4):
            assert f"DONE rank {rank} of 4 with 2 servers {marker}" in text, text
        # each process prints its children twice (after the first allreduce, and at its end): each pid once
        pids = sorted({int(p) for line in text.splitlines() if "CHILDREN" in line for p in line.split() if p.isdigit()})
        assert len(pids) == 3, text  # the scheduler, and a server per node
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if os.path.exists(f"/proc/{p}")]


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


def test_workers_sharing_a_host_link_get_settings_for_their_share_and_no_re_cut():
    """2 hosts x 4 workers, a colocated server per host, 100 Mbit/s host links, the defaults (heartbeats every 0.5 s,
    so the drift check judges many intervals): the scheduler measures each host's link once, derives the settings
    for a worker's share of it, and judges drift per host, so the job never re-derives them (a re-cut mid-job, with
    workers at different steps, can hang it). Every sum exact; the workers know their local ranks from the hosts."""
    topo = Topology(workers=8, servers=0, worker_rate="100mbit", colocate=True, per_host=4)
    script = [sys.executable, str(ROOT / "tests" / "netem" / "shared_link_job.py")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADWIRE_")}
    env |= {"GRADWIRE_HEARTBEAT_INTERVAL": "0.5", "GRADWIRE_JOB_SECONDS": "10"}
    with EmulatedCluster(topo) as c:
        with start_gradwire(c, script, env) as job:
            outputs = job.wait(timeout=180)
    for rank, out in enumerate(outputs):
        assert f"DONE rank {rank} of 8" in out and f"local rank {rank % 4} of 4" in out, out
    chosen = [json.loads(out.split("DATA_PATH ", 1)[1].splitlines()[0]) for out in outputs]
    assert all(c == chosen[0] for c in chosen)
    assert chosen[0]["derived_again"] is None and not chosen[0]["recuts"], chosen[0]
    assert "shared by 4 workers" in chosen[0]["why"], chosen[0]
    assert chosen[0]["partition_bytes"] == 16 << 10, chosen[0]  # a quarter of 100 Mbit/s


def test_a_scheduler_cut_off_from_the_network_steps_down_and_its_standby_alone_takes_over(tmp_path):
    """The scheduler's host cut off (both ways) for 1.5x GRADWIRE_HEARTBEAT_TIMEOUT while the scheduler lives, with
    a standby scheduler on a server's host: the cut-off scheduler steps down when its lease lapses (exit code 3), the
    nodes take it as lost by its silence and go to the standby, which alone resumes the job (term 2); mended, the old
    one is gone. Training goes on through it, and the parameters equal a failure-free run's (on loopback)."""
    script = str(ROOT / "tests" / "faults" / "training_job.py")
    env = os.environ | {"GRADWIRE_PARTITION_BYTES": "16384", "STEPS": "40"}
    reference = subprocess.run(
        [sys.executable, "-m", "gradwire", "launch", "-n", "2", "-s", "2", "--", sys.executable, script],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    (want,) = {line.split()[-1] for line in reference.stdout.splitlines() if " DIGEST " in line}
    marker, log = tmp_path / "cut", tmp_path / "schedulers.log"
    env |= {"GRADWIRE_HEARTBEAT_TIMEOUT": "4", "GRADWIRE_HEARTBEAT_INTERVAL": "0.5", "KILL_AT": "5"}
    env |= {"KILL_FILE": str(marker), "STEP_SLEEP": "0.1"}
    topo = Topology(workers=2, servers=2, worker_rate="1gbit", server_rate="1gbit")
    with (
        EmulatedCluster(topo) as c,
        open(log, "w") as out,
        start_gradwire(c, [sys.executable, script], env, standby_scheduler=True, scheduler_output=out) as job,
    ):
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert marker.exists(), "worker 0 never reached the step of the cut"
        sched = topo.of("scheduler")[0]
        c.cut(sched)
        time.sleep(6.0)  # past the heartbeat timeout: the nodes leave it, it steps down
        c.cut(sched, off=False)
        outputs = job.wait(timeout=120)
        old, standby = job.services[0], job.services[1]
    said = log.read_text()
    assert old.returncode == 3, said
    assert "scheduler of term 1 steps down: only 0 of the job's 4 nodes" in said, said
    assert said.count("gradwire scheduler resumed the job in term ") == 1, said
    assert "gradwire scheduler resumed the job in term 2" in said and standby.returncode == 0, said
    assert any("lost the scheduler (timed out" in out for out in outputs), outputs
    digests = [line.split()[-1] for out in outputs for line in out.splitlines() if line.startswith("DIGEST")]
    assert digests == [want, want], outputs
