"""A Horovod-style script run as `python standalone_job.py` with no launcher and no GRADWIRE_* set: it prints what
tests/multiprocess/test_standalone.py checks."""

import sys

import gradwire.session
import gradwire.torch as hvd
import torch

hvd.init()
print(f"SIZE {hvd.size()} RANK {hvd.rank()} LOCAL {hvd.local_rank()} {hvd.local_size()}", flush=True)
x = torch.arange(6, dtype=torch.float32)
checks = {
    "allreduce": torch.equal(hvd.allreduce(x, name="sum"), x),
    "sum": torch.equal(hvd.allreduce(x, name="total", op=hvd.Sum), x),
    "allgather": torch.equal(hvd.allgather(x.reshape(3, 2), name="gather"), x.reshape(3, 2)),
    "broadcast": torch.equal(hvd.broadcast(x, 0, name="bcast"), x),
    "alltoall": torch.equal(hvd.alltoall(x, name="a2a"), x),
    "reducescatter": torch.equal(hvd.reducescatter(x, name="rs"), x),
}
inplace = x.clone()
hvd.allreduce_(inplace, name="inplace")
checks["inplace"] = torch.equal(inplace, x)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
reference.load_state_dict(model.state_dict())
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
plain = torch.optim.SGD(reference.parameters(), lr=0.1)
for _ in range(3):
    batch = torch.randn(16, 4)
    for m, o in ((model, opt), (reference, plain)):
        o.zero_grad()
        m(batch).pow(2).mean().backward()
        o.step()
checks["training"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
server = gradwire.session._standalone[0].server
checks["no frame to the server"] = server.state.metrics.bytes_pushed == 0
failed = [name for name, ok in checks.items() if not ok]
print("FAILED " + ", ".join(failed) if failed else "ALL OK", flush=True)
sys.exit(1 if failed else 0)
