"""Worker script for elastic mode: a small MLP trained with gradwire.torch.elastic for STEPS steps, committing
every 5. Worker 0 prints `KILL` at step KILL_AT (the test SIGKILLs worker 2 then), or with KILL_AT=done once its
training is over, before it shuts down; with RAISE_AT, worker 0's script raises at that step. Every worker prints the
batch it (re)started from, the sizes it trained at, and the digest of the final parameters."""

import os
import time

from digest import parameter_digest  # beside this script

import gradwire.torch as gw
import torch

STEPS = int(os.environ.get("STEPS", "100"))
KILL_AFTER_TRAINING = os.environ.get("KILL_AT") == "done"
KILL_AT = -1 if KILL_AFTER_TRAINING else int(os.environ.get("KILL_AT", "-1"))
RAISE_AT = int(os.environ.get("RAISE_AT", "-1"))
STEP_SECONDS = float(os.environ.get("STEP_SECONDS", "0.05"))  # slow enough for a replacement to join
torch.set_num_threads(1)
gw.init()
print(f"PID {os.getpid()}", flush=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = gw.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), named_parameters=model.named_parameters()
)
state = gw.elastic.TorchState(model=model, optimizer=opt, batch=0)
sizes = []
killed = []  # not in the state: a restore must not bring the kill back


@gw.elastic.run
def train(state):
    print(f"START batch={state.batch} size={gw.size()} rank={gw.rank()}", flush=True)
    for state.batch in range(state.batch, STEPS):  # noqa: B020
        if state.batch == KILL_AT and gw.rank() == 0 and not killed:
            killed.append(state.batch)
            print("KILL worker 2", flush=True)
        if state.batch == RAISE_AT and gw.rank() == 0:
            raise RuntimeError(f"a bug in the training script at batch {state.batch}")
        data = torch.Generator().manual_seed(1000 * state.batch + gw.rank())
        x = torch.randn(32, 32, generator=data)
        y = (x[:, :10] * 3).argmax(dim=1)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(STEP_SECONDS)
        if not sizes or sizes[-1] != gw.size():
            sizes.append(gw.size())
        if state.batch % 5 == 4:
            state.batch += 1  # committed: this batch is done
            state.commit()


train(state)
if KILL_AFTER_TRAINING and gw.rank() == 0:
    print("KILL worker 2", flush=True)
    time.sleep(0.5)  # the kill lands while this worker is still in the job
print(f"SIZES {sizes}", flush=True)
print(f"DIGEST {parameter_digest(model)}", flush=True)
gw.shutdown()
print("DONE", flush=True)
