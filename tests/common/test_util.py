"""gradwire.common.util: the helpers of horovod.common.util that code imports from Horovod (its test suites do)."""

import os

import pytest

from gradwire.common.util import env, is_iterable, is_version_greater_equal_than, num_rank_is_power_2, split_list


def test_versions_compare_as_releases_with_a_pre_release_before_its_release():
    assert is_version_greater_equal_than("2.16.1", "2.16.0")
    assert is_version_greater_equal_than("2.16", "2.16.0")
    assert is_version_greater_equal_than("2.10.0", "2.9.0")
    assert not is_version_greater_equal_than("2.16.0rc1", "2.16.0")
    assert is_version_greater_equal_than("2.16.0+cpu", "2.16.0")
    assert not is_version_greater_equal_than("1.15.5", "2.0.0")
    with pytest.raises(ValueError, match="major.minor.patch"):
        is_version_greater_equal_than("2.16.0", "2.16")
    with pytest.raises(ValueError, match="strings"):
        is_version_greater_equal_than(2, "2.0.0")


def test_env_sets_variables_for_a_block_and_puts_back_what_was_there():
    os.environ["GW_TEST_KEPT"] = "before"
    os.environ.pop("GW_TEST_NEW", None)
    with env(GW_TEST_KEPT="inside", GW_TEST_NEW="new", GW_TEST_NONE=None):
        assert (os.environ["GW_TEST_KEPT"], os.environ["GW_TEST_NEW"]) == ("inside", "new")
        assert "GW_TEST_NONE" not in os.environ
    assert os.environ.pop("GW_TEST_KEPT") == "before" and "GW_TEST_NEW" not in os.environ


def test_split_list_power_of_two_and_iterable():
    assert split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_list([], 2) == [[], []]
    assert [num_rank_is_power_2(n) for n in (0, 1, 2, 3, 4, 6, 8)] == [False, True, True, False, True, False, True]
    assert is_iterable([1]) and is_iterable("ab") and not is_iterable(3)
