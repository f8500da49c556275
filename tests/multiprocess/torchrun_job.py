"""Worker script for torchrun: nothing but gradwire.init(); sums checked exactly; a tiny model trained; the pids of
the roles this process started, for the test to check that nothing is left. CRASH_RANK=r: in torchrun's first
attempt (restart count 0) rank r dies after the first allreduce, as a crashed worker would. KILL_SCHEDULER=1: rank 0
SIGKILLs the scheduler it started, after the first allreduce; the job must go on (restarted, or a standby taking over),
and each rank prints the scheduler's term at its end."""

import os
import signal
import sys

import gradwire
import gradwire.torch as gw
import torch
from gradwire.launch import torchrun

gw.init()
total = gw.allreduce(torch.full((1000,), float(gw.rank() + 1)), op=gw.Sum, name="sum")
n = gw.size()
assert torch.all(total == n * (n + 1) / 2), total[:4]
if torchrun.CHILDREN:  # one write per line: the ranks of a node share torchrun's stdout
    sys.stdout.write(f"CHILDREN {' '.join(str(c.pid) for c in torchrun.CHILDREN)}\n")
    sys.stdout.flush()
if os.environ.get("KILL_SCHEDULER") == "1" and gw.rank() == 0:
    os.kill(torchrun.CHILDREN[0].pid, signal.SIGKILL)  # the first child rank 0 starts is the scheduler
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
if os.environ.get("CRASH_RANK") == str(gw.rank()) and attempt == "0":
    sys.stdout.write(f"CRASH rank {gw.rank()} in attempt {attempt}\n")
    sys.stdout.flush()
    os._exit(3)
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = gw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
g = torch.Generator().manual_seed(gw.rank())
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step()
digest = float(sum(p.detach().sum() for p in model.parameters()))
digests = gw.allreduce(torch.tensor([digest]), op=gw.Sum, name="digest")
assert abs(float(digests[0]) - n * digest) < 1e-4 * max(1.0, abs(digest)), (digests, digest)  # same model everywhere
status = gradwire.current_worker().status()
servers = len(status["servers"])
if os.environ.get("KILL_SCHEDULER") == "1":
    sys.stdout.write(f"TERM rank {gw.rank()} {status['term']}\n")
if torchrun.CHILDREN:  # again: a scheduler started anew meanwhile
    sys.stdout.write(f"CHILDREN {' '.join(str(c.pid) for c in torchrun.CHILDREN)}\n")
sys.stdout.write(f"DONE rank {gw.rank()} of {n} with {servers} servers {sys.argv[1]} in attempt {attempt}\n")
sys.stdout.flush()
gw.shutdown()
