"""gradwire on Ray (issue 16): a local two-node Ray cluster (ray.cluster_utils.Cluster) runs a torch job of two
workers and two servers with RayExecutor and with Ray Train's TorchTrainer; the parameters are those `gradwire
launch` gives; a killed server actor fails over, a killed worker actor ends the run with WorkerLost naming it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import gradwire.ray as gray  # noqa: E402 - after the skip
from gradwire.errors import WorkerLost  # noqa: E402
from tests.ray import ray_job  # noqa: E402

pytestmark = [
    pytest.mark.ray,
    # Ray's own modules warn about their own deprecations; gradwire's warnings still fail the tests
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray"),
    pytest.mark.filterwarnings("ignore::FutureWarning:ray"),
    pytest.mark.filterwarnings("ignore::UserWarning:ray"),
]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])  # the actors import tests
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False})
    c.add_node(num_cpus=3, resources={"server_node": 2})  # a second node; only it may hold servers
    ray.init(address=c.address)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def launched() -> str:
    """The digest `gradwire launch -n 2 -s 2` gives for the same job."""
    cmd = [sys.executable, "-m", "gradwire", "launch", "-n", "2", "-s", "2", "--", sys.executable, ray_job.__file__]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    digests = set(re.findall(r"DIGEST \d (\w+)", out))
    assert len(digests) == 1, out
    return digests.pop()


def test_ray_executor_trains_to_the_same_parameters_as_gradwire_launch(cluster, launched):
    executor = gray.RayExecutor(num_workers=2, num_servers=2, server_resources={"server_node": 1})
    executor.start()
    try:
        results = executor.run(ray_job.train)
        again = executor.run(ray_job.train)  # a second run on the same actors: a new generation of the job
    finally:
        executor.shutdown()
    assert [r for r, _ in results] == [0, 1]
    assert {d for _, d in results} == {d for _, d in again} == {launched}


def test_ray_train_torch_trainer_with_gradwires_backend(cluster, launched, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(config):
        rank, digest = ray_job.train()
        Path(config["out"], f"rank{rank}").write_text(digest)

    trainer = TorchTrainer(
        loop,
        train_loop_config={"out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        torch_config=gray.GradwireConfig(num_servers=2, cpus_per_server=0.5),
        run_config=RunConfig(storage_path=str(tmp_path / "ray")),
    )
    trainer.fit()
    assert {p.read_text() for p in tmp_path.glob("rank*")} == {launched}
    assert sorted(p.name for p in tmp_path.glob("rank*")) == ["rank0", "rank1"]


def test_a_killed_server_actor_fails_over_and_the_job_completes(cluster, launched):
    executor = gray.RayExecutor(num_workers=2, num_servers=2)
    executor.start()
    try:
        refs = executor.run_remote(ray_job.train, kwargs={"steps": 40, "pause": 0.05})
        time.sleep(3)  # mid-training
        ray.kill(executor.cluster.servers[1], no_restart=True)
        results = [ray.get(r, timeout=120) for r in refs]
    finally:
        executor.shutdown()
    assert [r for r, _ in results] == [0, 1]
    assert len({d for _, d in results}) == 1  # the same parameters on both workers (bit-identical failover)


def test_a_killed_worker_actor_ends_the_run_with_worker_lost_naming_it(cluster):
    executor = gray.RayExecutor(num_workers=2, num_servers=1)
    executor.start()
    try:
        killer = threading.Timer(3, lambda: ray.kill(executor.workers[1], no_restart=True))
        killer.start()
        started = time.monotonic()
        with pytest.raises(WorkerLost, match="worker 1"):
            executor.run(ray_job.train, kwargs={"steps": 400, "pause": 0.05})
        assert time.monotonic() - started < 60  # reported, not a hang until GRADWIRE_TIMEOUT
    finally:
        executor.shutdown()


def test_a_job_the_cluster_cannot_hold_fails_at_once_saying_what_is_missing(cluster):
    executor = gray.RayExecutor(num_workers=8, num_servers=2)
    with pytest.raises(gray.ConfigError, match="CPU: needs 10, the cluster has 6"):
        executor.start()
