"""Worker script: a small MLP trained for STEPS steps with gradwire's DistributedOptimizer, on each rank's own
synthetic data (OPTIMIZER=server: ServerOptimizer, the same SGD on the servers); prints the digest of the final
parameters and the failovers this worker went through.

KILL_AT=k (or k1,k2,...): worker 0 prints `KILL <role>` at step k (the test then SIGKILLs that process). KILL_WAIT=1:
worker 0 then waits until it has seen the failover before it pushes again (so the others are mid-round when it
happens); without it the kill lands wherever the job happens to be. Every 5 steps the workers meet at a barrier and
average the loss under a new name (a declaration): what needs the scheduler, after it is killed too. KILL_FILE: worker
0 also creates this file then (for a test that cannot read its output as it runs). STEP_SLEEP: seconds each step
sleeps, to stretch the run.
"""

import os
import time

from digest import parameter_digest  # beside this script

import gradwire
import gradwire.torch as gw
import torch

STEPS = int(os.environ.get("STEPS", "40"))
torch.set_num_threads(1)
gw.init()
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
)
if os.environ.get("OPTIMIZER") == "server":  # parameter-server mode: parameters and momentum on the servers
    opt = gw.ServerOptimizer(model, "sgd", lr=0.05, momentum=0.9)
else:
    gw.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = gw.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), named_parameters=model.named_parameters()
    )
data = torch.Generator().manual_seed(100 + gw.rank())
kill_at = {int(k) for k in os.environ.get("KILL_AT", "-1").split(",")}
worker = gradwire.current_worker()
for step in range(STEPS):
    if step in kill_at and gw.rank() == 0:
        print(f"KILL {os.environ.get('KILL_ROLE', '')}", flush=True)
        if os.environ.get("KILL_FILE"):
            open(os.environ["KILL_FILE"], "w").close()
        if os.environ.get("KILL_WAIT") == "1":
            deadline = time.monotonic() + 30
            while not worker.failovers and time.monotonic() < deadline:
                time.sleep(0.005)
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
    x = torch.randn(64, 32, generator=data)
    y = (x[:, :10] * 3).argmax(dim=1)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    if step % 5 == 4:
        gradwire.barrier()
        gw.allreduce(loss.detach().reshape(1), name=f"loss.{step}")
print(f"DIGEST {parameter_digest(model)}", flush=True)
print(f"FAILOVERS {[(f['server'], f['standby'], f['resent'], f['seeds']) for f in worker.failovers]}", flush=True)
gw.shutdown()
print("DONE", flush=True)
