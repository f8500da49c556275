"""Worker script: push_pulls checked exactly for GRADWIRE_JOB_SECONDS (as long as every worker agrees to go on),
then the data-path settings in force and this worker's host, as the job saw them."""

import json
import os
import time

import numpy as np

import gradwire as gw

gw.init()
n, seconds = gw.size(), float(os.environ.get("GRADWIRE_JOB_SECONDS", "8"))
x = np.empty(256 * 1024, np.float32)  # 1 MiB
started, rounds = time.monotonic(), 0
while True:
    go_on = np.array([time.monotonic() - started < seconds], np.int32)
    if gw.push_pull(go_on, name="go_on")[0] < n:  # every worker stops after the same round
        break
    x.fill(gw.rank() + 1 + rounds)
    out = gw.push_pull(x, name="g")
    assert np.all(out == n * (n + 1) / 2 + n * rounds), (rounds, out[:4])
    rounds += 1
worker = gw.current_worker()
print("DATA_PATH " + json.dumps(worker.status()["data_path"]), flush=True)
print(f"DONE rank {gw.rank()} of {n}: {rounds} rounds, local rank {gw.local_rank()} of {gw.local_size()}", flush=True)
gw.shutdown()
