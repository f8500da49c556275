"""The native data path's suite (gradwire-native): skipped where the extension is not installed (the `gn` fixture,
tests/conftest.py), which `make test` refuses (GRADWIRE_EXPECT_NATIVE=1: tests/native/test_package.py fails
instead)."""
