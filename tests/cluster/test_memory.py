import tracemalloc

import numpy as np

from gradwire.testing import LocalCluster


def test_memory_does_not_grow_with_rounds():
    with LocalCluster(num_workers=2, num_servers=1, partition_bytes=64 << 10) as c:
        grads = [np.ones(100_000, np.float32) for _ in c.workers]

        def rounds(count):
            c.run(lambda w: [w.push_pull_inplace(grads[w.rank], "g", average=True) for _ in range(count)])

        rounds(20)  # allocate the accumulators, warm every path
        tracemalloc.start()
        try:
            rounds(20)
            after_warm, _ = tracemalloc.get_traced_memory()
            rounds(300)
            after_many, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # 300 rounds move 240 MB through the server; what stays behind must be unrelated noise
        assert after_many - after_warm < 256 << 10, (after_warm, after_many)
