"""gradwire.run (Horovod's horovod.run): a function on N workers of a job on this machine, results by rank, and a
worker that raises or dies named in the error, never a hang."""

import os

import numpy as np
import pytest

import gradwire
from gradwire.errors import GradwireError, NotSupported


def _sum_of_ranks(scale):
    gradwire.init()
    total = gradwire.push_pull(np.full(4, float(gradwire.rank() + 1)), name="local_job.sum")
    return gradwire.rank(), gradwire.size(), (total * scale).tolist(), os.environ["HOROVOD_RANK"]


def _rank_1_raises():
    gradwire.init()
    if gradwire.rank() == 1:
        raise ValueError("rank 1's own mistake")
    gradwire.barrier()  # rank 0 waits for a rank that never comes: the job's end must not hang on it
    return "unreachable"


def _rank_0_dies():
    gradwire.init()
    if gradwire.rank() == 0:
        os._exit(3)
    gradwire.barrier()


@pytest.mark.timeout(120)
def test_a_function_runs_on_every_worker_and_returns_its_results_by_rank():
    results = gradwire.run(_sum_of_ranks, args=(10.0,), np=2, hosts="localhost:2")
    assert results == [(0, 2, [30.0] * 4, "0"), (1, 2, [30.0] * 4, "1")]


@pytest.mark.timeout(120)
def test_a_worker_that_raises_is_named_with_its_traceback_and_the_others_stopped():
    with pytest.raises(GradwireError, match=r"worker 1 raised:(.|\n)*ValueError: rank 1's own mistake") as e:
        gradwire.run(_rank_1_raises, np=2, start_timeout=60)
    assert e.value.context["rank"] == 1


@pytest.mark.timeout(120)
def test_a_worker_that_dies_is_named_with_its_exit_code():
    with pytest.raises(GradwireError, match="worker 0 died before returning \\(exit code 3\\)"):
        gradwire.run(_rank_0_dies, np=2, start_timeout=60)


def test_other_hosts_and_horovods_elastic_options_are_refused_before_anything_starts():
    with pytest.raises(NotSupported, match="this machine only, not on 'node7'"):
        gradwire.run(_sum_of_ranks, np=2, hosts="node7:2")
    with pytest.raises(NotSupported, match="min_np"):
        gradwire.run(_sum_of_ranks, np=2, min_np=1)
    with pytest.raises(ValueError, match="1 slots for np=2"):
        gradwire.run(_sum_of_ranks, np=2, hosts="localhost:1")
