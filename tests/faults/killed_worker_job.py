"""Worker script: push_pull in a loop; rank 2 SIGKILLs itself at step 5, the others report how they learnt of it."""

import os
import signal
import sys
import time

import numpy as np

import gradwire as gw

gw.init()
try:
    for step in range(1000):
        if gw.rank() == 2 and step == 5:
            print(f"KILLED {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        gw.push_pull(np.ones(10_000, np.float32), name="g")
except gw.WorkerLost as e:
    print(f"LOST rank={e.lost_rank} at={time.time():.6f} message={e}", flush=True)
    sys.exit(0)
print("NEVER-LOST", flush=True)
sys.exit(1)
