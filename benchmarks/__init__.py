"""The lab: research harnesses beside the product (docs/benchmarks.md). `gradwire bench` keeps the benchmarks a user
runs on a cluster (push_pull against gloo, the emulated network, training against DDP); what measures gradwire's own
parts and claims runs from a checkout of this repository, as `python -m benchmarks ...` (or `make lab ARGS=...`):

- the floor of a data path, in Python and native (floor.py), and CPU per GB by partition size (partitions.py), with the
  native worker's rule over lent links (native_worker.py);
- a training thread's step beside a busy data path (gil.py);
- large models: a 1.2 GB tensor and a 0.35B-parameter transformer (large.py, large_worker.py);
- accuracy to the same epochs and time to accuracy (accuracy.py, mnist1d.py, time_to_accuracy.py);
- parameter-server mode (ps.py, ps_worker.py);
- failover and elastic timing (failover.py, failover_worker.py, failover_netem.py, elastic.py);
- scaling with replayed compute (scale.py) and the profiler that writes the layer profiles (replay.py).

Nothing under src/ imports this package. The processes a harness starts find it through PYTHONPATH, which importing it
extends with the repository's root.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _on_pythonpath() -> None:
    """The repository's root on PYTHONPATH, for `python -m benchmarks.X` in the processes a harness starts (through
    the launcher, and in an emulated network's namespaces)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *paths])


_on_pythonpath()
