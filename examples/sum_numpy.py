"""The smallest gradwire job: every worker contributes its rank + 1; all receive the sum.

gradwire launch -n 4 -s 2 -- python examples/sum_numpy.py
"""

import numpy as np

import gradwire as gw

gw.init()
grad = np.full(1_000_000, gw.rank() + 1, dtype=np.float32)
total = gw.push_pull(grad, name="grad")
expected = gw.size() * (gw.size() + 1) / 2
assert np.all(total == expected), (total[:4], expected)
mean = gw.push_pull(grad, name="grad", average=True)
print(f"rank {gw.rank()}/{gw.size()}: sum {total[0]:.0f} (expected {expected:.0f}), mean {mean[0]:.2f}")
gw.shutdown()
