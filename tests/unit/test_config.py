import re
from pathlib import Path

import pytest

import gradwire
from gradwire.config import ENV_VARS, Config, default_of, env_for
from gradwire.errors import ConfigError
from gradwire.tuning import Tuning

DOCS = Path(__file__).resolve().parents[2] / "docs" / "env.md"


def test_defaults():
    c = Config.from_env({})
    assert (c.role, c.num_workers, c.partition_bytes, c.rank) == ("worker", 1, 4 << 20, None)


def test_gradwire_names_win_over_aliases():
    c = Config.from_env({"GRADWIRE_NUM_WORKERS": "3", "DMLC_NUM_WORKER": "5", "WORLD_SIZE": "7"})
    assert c.num_workers == 3


def test_byteps_variables():
    c = Config.from_env(
        {
            "DMLC_ROLE": "server",
            "DMLC_PS_ROOT_URI": "10.0.0.1",
            "DMLC_PS_ROOT_PORT": "9000",
            "DMLC_NUM_WORKER": "4",
            "DMLC_NUM_SERVER": "2",
            "DMLC_WORKER_ID": "3",
        }
    )
    assert (c.role, c.scheduler, c.num_workers, c.num_servers, c.rank) == ("server", "10.0.0.1:9000", 4, 2, 3)
    assert c.scheduler_address == ("10.0.0.1", 9000)


def test_torchrun_variables():
    c = Config.from_env(
        {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GRADWIRE_SCHEDULER": "host:1234"}
    )
    assert (c.rank, c.num_workers, c.local_rank, c.local_size) == (2, 4, 0, 2)


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"GRADWIRE_ROLE": "boss"}, "GRADWIRE_ROLE"),
        ({"GRADWIRE_NUM_WORKERS": "two"}, "must be a number"),
        ({"GRADWIRE_PARTITION_BYTES": "4"}, "PARTITION_BYTES"),
        ({"GRADWIRE_SCHEDULER": "nohostport"}, "host:port"),
        ({"GRADWIRE_WINDOW": "0"}, "window"),
    ],
)
def test_bad_settings_are_clear_errors(env, needle):
    with pytest.raises(ConfigError, match=needle):
        Config.from_env(env)


def test_secret_is_not_in_repr_and_reads_from_a_file(tmp_path):
    f = tmp_path / "secret"
    f.write_text("from-file\n")
    assert Config.from_env({"GRADWIRE_SECRET_FILE": str(f)}).secret_bytes() == b"from-file"
    assert "hush" not in repr(Config.from_env({"GRADWIRE_SECRET": "hush"}))


def test_every_field_has_one_variable():
    import dataclasses

    fields = {f.name for f in dataclasses.fields(Config)} - {"explicit"}  # which of them the user set
    assert {v.field for v in ENV_VARS} == fields
    assert len({v.name for v in ENV_VARS}) == len(ENV_VARS)


def test_docs_table_agrees_with_the_code():
    rows = {}
    for line in DOCS.read_text().splitlines():
        m = re.match(r"\|\s*`(GRADWIRE_\w+)`\s*\|([^|]*)\|\s*`?([^|`]*)`?\s*\|", line)
        if m:
            rows[m.group(1)] = ({a.strip("` ") for a in m.group(2).split(",") if a.strip()}, m.group(3).strip())
    code = {v.name: (set(v.aliases), default_of(v)) for v in ENV_VARS}
    assert rows == code


def test_public_api_is_sorted_and_importable():
    assert gradwire.__all__ == sorted(gradwire.__all__)
    for name in gradwire.__all__:
        assert hasattr(gradwire, name)


def test_the_table_defaults_are_the_dataclass_defaults():
    from gradwire.config import _parse

    blank = Config()
    for var in ENV_VARS:
        expected = getattr(blank, var.field)
        assert (_parse(var, default_of(var)) if default_of(var) else expected) == expected, var.name
        if not default_of(var):
            assert expected in ("", None), var.name


def test_explicit_settings_win_over_the_derived_tuning():
    derived = Tuning(32768, 6, 0, 4e6, 0.001, "a test's")
    tuned = Config.from_env({}).tuned(derived)
    assert (tuned.partition_bytes, tuned.window, tuned.unanswered) == (32768, 6, 0)
    mine = Config.from_env({"GRADWIRE_PARTITION_BYTES": "65536", "BYTEPS_PARTITION_BYTES": "1"}).tuned(derived)
    assert (mine.partition_bytes, mine.window) == (65536, 6)
    assert Config.from_env({}, window=9).tuned(derived).window == 9  # overrides count as explicit
    assert Config.from_env({}).tuned(None) == Config.from_env({})


def test_the_launchers_environments_are_made_from_the_table_and_read_back_the_same():
    """env_for names each setting by the table (env_vars.py), so what a launcher sets is what Config reads."""

    fields = {"num_workers": 4, "num_servers": 6, "rank": 2, "standby": True, "timeout": 30.5, "link_rate": "100mbit"}
    env = env_for(**fields)
    assert env["GRADWIRE_NUM_WORKERS"] == "4" and env["GRADWIRE_STANDBY"] == "1"
    config = Config.from_env(env | {"GRADWIRE_ROLE": "server"})
    assert {f: getattr(config, f) for f in fields} == fields
    with pytest.raises(ConfigError, match="num_wrokers"):
        env_for(num_wrokers=4)
