"""Worker script: one push_pull checked exactly, then the placement and data-path settings the scheduler chose."""

import json

import numpy as np

import gradwire as gw

gw.init()
out = gw.push_pull(np.full(300_000, gw.rank() + 1, np.float32), name="g")
n = gw.size()
assert np.all(out == n * (n + 1) / 2), out[:4]
print("PLACEMENT " + json.dumps(gw.current_worker().placement), flush=True)
print("DATA_PATH " + json.dumps(gw.current_worker().status()["data_path"]), flush=True)
print(f"DONE rank {gw.rank()} of {n}", flush=True)
gw.shutdown()
