"""A worker script for the multi-process tests: `job.py MODE MARKER`.

MODE ok: push_pull several tensors and check the sums; fail1: worker 1 exits with code 3 mid-job;
kill1: worker 1 SIGKILLs itself mid-job. MARKER only makes the command line unique to the test.
"""

import os
import signal
import sys

import numpy as np

import gradwire as gw

mode = sys.argv[1]
gw.init()
rank, size = gw.rank(), gw.size()
for step in range(5):
    if step == 2 and rank == 1 and mode == "fail1":
        print("worker 1 failing on purpose", flush=True)
        sys.exit(3)
    if step == 2 and rank == 1 and mode == "kill1":
        os.kill(os.getpid(), signal.SIGKILL)
    for i, n in enumerate([1, 1000, 300_001]):
        grad = np.full(n, rank + step + i, np.float32)
        total = gw.push_pull(grad, name=f"g{i}")
        expected = sum(r + step + i for r in range(size))
        assert np.all(total == expected), (rank, step, i, total[:3], expected)
print(f"DONE rank {rank} of {size}", flush=True)
gw.shutdown()
