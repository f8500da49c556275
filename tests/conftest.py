import threading

import pytest


@pytest.fixture(autouse=True)
def _no_thread_leaks_into_failures():
    # gradwire's threads are daemons; this only keeps a hung test's report readable
    yield
    assert threading.main_thread().is_alive()
