"""Horovod's `horovod.common` module paths, for the code that imports its helpers from there (Horovod's own test
suites do: `from horovod.common.util import is_version_greater_equal_than`); gradwire's own code does not use them."""
