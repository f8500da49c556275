"""gradwire on Ray: a local two-node Ray cluster (ray.cluster_utils.Cluster) runs a torch job of two
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
    return _launched(20)


def _launched(steps: int) -> str:
    cmd = [sys.executable, "-m", "gradwire", "launch", "-n", "2", "-s", "2", "--", sys.executable, ray_job.__file__]
    env = os.environ | {"STEPS": str(steps)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120).stdout
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


def test_a_killed_scheduler_actor_is_restarted_at_its_address_and_the_job_goes_on(cluster):
    """Ray restarts the scheduler's actor on its node; it listens on its old port, the workers and servers (training on
    meanwhile) report to it, and it resumes the job: the parameters are `gradwire launch`'s."""
    executor = gray.RayExecutor(num_workers=2, num_servers=2)
    executor.start()
    try:
        refs = executor.run_remote(ray_job.train, kwargs={"steps": 300, "pause": 0.05})  # 15 s at least
        time.sleep(3)  # mid-training
        ray.kill(executor.cluster.scheduler, no_restart=False)
        term = _term_once_restarted(executor.cluster.scheduler)
        results = [ray.get(r, timeout=120) for r in refs]
    finally:
        executor.shutdown()
    assert term == 2
    assert [r for r, _ in results] == [0, 1]
    assert {d for _, d in results} == {_launched(300)}


def _term_once_restarted(scheduler, timeout: float = 60) -> int:
    """The restarted scheduler actor's term once it has resumed the job (Ray says "unavailable" as it restarts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            term = ray.get(scheduler.term.remote(), timeout=10)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            term = 0
        if term > 1:
            return term
        time.sleep(0.2)
    raise AssertionError(f"the scheduler actor did not resume the job in {timeout:g}s")


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
