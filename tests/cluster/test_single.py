"""A worker alone in a job that init() made (gradwire/standalone.py) answers reductions, gathers and reduce-scatters
in place (worker/single.py); a launched job of one worker still goes through its server."""

import numpy as np
import pytest

from gradwire import standalone
from gradwire.config import Config
from gradwire.errors import ConfigError, TensorError
from gradwire.testing import LocalCluster


@pytest.fixture
def alone():
    with LocalCluster(num_workers=1, num_servers=1) as c:
        yield c


def test_a_launched_worker_of_one_goes_through_its_server(alone):
    worker = alone.workers[0]
    x = np.arange(8, dtype=np.float32)
    assert np.array_equal(worker.push_pull(x, name="x", average=True), x)
    assert alone.servers[0].state.metrics.bytes_pushed == x.nbytes


def test_a_standalone_worker_answers_in_place(alone):
    worker = alone.workers[0]
    worker.state.standalone = True
    x = np.arange(8, dtype=np.float32)
    out = np.empty_like(x)
    assert worker.push_pull_async(x, name="x", average=True, out=out).wait(1) is out
    assert np.array_equal(out, x)
    inplace = x.copy()
    assert worker.push_pull_async(inplace, name="y", out=inplace).wait(1) is inplace
    assert np.array_equal(inplace, x)
    for op in ("sum", "min", "max", "product"):
        assert np.array_equal(worker.push_pull(x, name=f"op-{op}", op=op), x)
    part = np.empty(3, np.float32)
    assert np.array_equal(worker.reduce_scatter_async(x, "rs", [(2, 3)], part).wait(1), x[2:5])
    whole = np.empty(8, np.float32)
    assert np.array_equal(worker.gather_async(x, "g", [8], whole).wait(1), x)
    assert alone.servers[0].state.metrics.bytes_pushed == 0


def test_a_standalone_worker_still_sends_what_needs_a_server(alone):
    worker = alone.workers[0]
    worker.state.standalone = True
    x = np.arange(8, dtype=np.float32)
    # a process set naming another rank is not its own input: the usual path says what is wrong
    with pytest.raises(TensorError, match="ranks"):
        worker.push_pull_async(x, name="set", members=[0, 1]).wait(5)


def _needed(env):
    return standalone.needed(Config.from_env(env), env)


def test_standalone_only_without_a_scheduler_and_for_one_worker():
    assert _needed({})
    assert _needed({"HOROVOD_SIZE": "1", "SLURM_STEP_NUM_TASKS": "1"})
    assert not _needed({"GRADWIRE_SCHEDULER": "10.0.0.1:9000"})
    assert not _needed({"DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9000"})
    assert not _needed({"GRADWIRE_ROLE": "server"})
    with pytest.raises(ConfigError, match="4 workers expected"):
        _needed({"WORLD_SIZE": "4"})
    # another launcher's processes with no gradwire scheduler would each train alone: said, not started
    for name in standalone.OTHER_LAUNCHERS:
        with pytest.raises(ConfigError, match=f"one of 3 processes \\({name}=3\\)"):
            _needed({name: "3"})
