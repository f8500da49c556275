"""Elastic training on scikit-learn's digits: the job survives a worker's death and takes in new workers.

    gradwire launch -n 3 -s 2 --min-workers 2 --max-workers 3 -- python examples/elastic_train.py

Kill one worker (`kill -9` its pid) while it trains: the others roll back to their last commit and go on with two,
the launcher starts a replacement, and it joins at the next commit with the model, the optimizer state and the
counters broadcast from rank 0. Each worker shards the data by its current rank and size, so the shards follow the
membership.
"""

import argparse
import json
import time

from sklearn.datasets import load_digits

import gradwire.torch as gw
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--step-seconds", type=float, default=0.02, help="a pause per step, time to kill a worker")
parser.add_argument("--batch", type=int, default=32)
args = parser.parse_args()

torch.set_num_threads(1)
gw.init()
digits = load_digits()
x = torch.tensor(digits.images, dtype=torch.float32).reshape(-1, 64) / 16.0
y = torch.tensor(digits.target)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
optimizer = gw.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), named_parameters=model.named_parameters()
)
state = gw.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0)


@gw.elastic.run
def train(state):
    for state.epoch in range(state.epoch, args.epochs):  # noqa: B020 - the elastic idiom: the state holds the loop
        shard = torch.arange(gw.rank(), len(x), gw.size())  # this worker's share, for the current membership
        batches = len(shard) // args.batch
        losses = []  # this run of the epoch's: after a reset it may resume at its last batch, or past it (a new
        # membership cuts the data into other shards), and then has no batch left to run
        for state.batch in range(state.batch, batches):  # noqa: B020
            idx = shard[state.batch * args.batch : (state.batch + 1) * args.batch]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            time.sleep(args.step_seconds)
            if state.batch % 10 == 9:
                state.batch += 1  # this batch is done
                state.commit()  # a copy to roll back to; joining workers come in here
        state.batch = 0
        if gw.rank() == 0 and losses:
            print(f"epoch {state.epoch}: loss {losses[-1]:.4f} with {gw.size()} workers", flush=True)


train(state)
accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
if gw.rank() == 0:
    print(json.dumps({"accuracy": round(accuracy, 4), "workers": gw.size()}), flush=True)
gw.shutdown()
