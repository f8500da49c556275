"""Flow control on a worker's link: the cap on unanswered partitions holds, and its escape prevents deadlock."""

import threading
import time

import numpy as np

from gradwire.testing import LocalCluster
from gradwire.worker.link import ESCAPE_SECONDS


def test_the_cap_keeps_a_fast_worker_from_running_ahead_of_the_rounds():
    with LocalCluster(num_workers=2, num_servers=1, partition_bytes=4096, window=8, unanswered=4) as c:
        fast, slow = c.workers
        data = np.ones(20 * 1024, np.float32)  # 20 partitions, all on the one server
        h = fast.push_pull_async(data, "t")
        time.sleep(ESCAPE_SECONDS / 2)
        assert len(fast._links[0]._pending) == 4  # not 8 (the window), not 20: the slow worker has not pushed yet
        slow.push_pull(data, "t")
        assert np.all(fast.synchronize(h) == 2)


def test_opposite_submission_orders_complete_through_the_escape():
    # each worker's first push is the other's second: with a cap of 1 and no escape, both would wait forever
    with LocalCluster(num_workers=2, num_servers=1, unanswered=1) as c:
        a, b = c.workers
        start = threading.Barrier(2)

        values = {(0, "A"): 1.0, (0, "B"): 10.0, (1, "B"): 100.0, (1, "A"): 1000.0}

        def job(worker, first, second):
            start.wait()
            h1 = worker.push_pull_async(np.full(10, values[worker.rank, first], np.float32), first)
            h2 = worker.push_pull_async(np.full(10, values[worker.rank, second], np.float32), second)
            return float(worker.synchronize(h1)[0]), float(worker.synchronize(h2)[0])

        results = {}
        threads = [
            threading.Thread(target=lambda w=w, f=f, s=s: results.__setitem__(w.rank, job(w, f, s)))
            for w, f, s in ((a, "A", "B"), (b, "B", "A"))
        ]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == {0: (1001.0, 110.0), 1: (110.0, 1001.0)}  # A = 1 + 1000, B = 10 + 100
        assert time.monotonic() - t0 < 10
