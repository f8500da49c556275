"""Which ways `gradwire bench --netem --train` runs: its set's, or those `--ways` names with their peer; the cross
barrier only where named."""

import argparse

import pytest

from gradwire.bench.netem_cli import train_ways


def _args(ways=None, compression=False, keras=False):
    return argparse.Namespace(ways=ways, compression=compression, keras=keras)


def test_the_plain_set_runs_by_default_and_the_cross_barrier_only_where_named():
    assert train_ways(_args()) == ("optimizer", "hook", "ddp")
    assert train_ways(_args("crossbarrier")) == ("ddp", "crossbarrier")
    assert train_ways(_args("optimizer,crossbarrier")) == ("optimizer", "ddp", "crossbarrier")


def test_a_way_of_another_set_is_refused_naming_the_set_s_ways():
    with pytest.raises(SystemExit, match=r"no such way here: \['crossbarrier'\].*optimizer-powersgd"):
        train_ways(_args("crossbarrier", compression=True))
    assert train_ways(_args("hook-powersgd", compression=True)) == ("hook-powersgd", "ddp")


def test_every_way_the_emulated_network_runs_is_one_the_workers_train():
    from gradwire.bench import netem_train
    from gradwire.bench.train import WAYS

    torch_ways = netem_train.TRAIN_WAYS + netem_train.OPT_IN_WAYS + netem_train.COMPRESSION_WAYS
    for way in torch_ways + netem_train.DRIFT_WAYS:
        argv = netem_train._way_job(way, 1, 1, {})[1]
        assert argv[2] == "gradwire.bench.train" and argv[3] in WAYS, (way, argv)
