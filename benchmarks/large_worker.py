"""One worker of `python -m benchmarks --large` (started by `gradwire launch`, or as a gloo rank).

    python -m benchmarks.large_worker tensor --way inplace --elements 300000000 --calls 3
    python -m benchmarks.large_worker model --way optimizer --steps 4

`tensor`: one float32 tensor pushed and pulled `calls` times (`inplace`: push_pull_inplace; `outofplace`: push_pull;
`gloo`: torch.distributed all_reduce in place). `model`: a GPT-2-medium-sized transformer (24 blocks of width 1024,
16 heads, a 50,257-token vocabulary: about 0.35B parameters) trained `steps` steps with SGD, gradwire's
DistributedOptimizer (`optimizer`) or torch's DDP over gloo (`ddp`). Every rank prints `LARGE {json}`: call or step
times, the time to set up (wrapping and broadcasting the parameters), and its peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch

VOCAB, WIDTH, BLOCKS, HEADS, CONTEXT = 50257, 1024, 24, 16, 1024


class GPT(torch.nn.Module):
    """A GPT-2-medium-sized decoder: token and position embeddings, pre-norm causal blocks, a tied LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, WIDTH)
        self.positions = torch.nn.Embedding(CONTEXT, WIDTH)
        block = torch.nn.TransformerEncoderLayer(
            WIDTH, HEADS, 4 * WIDTH, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(block, BLOCKS, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(seq))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(seq)
        x = self.norm(self.blocks(x, mask=mask, is_causal=True))
        return x @ self.tokens.weight.T


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _gloo() -> int:
    import torch.distributed as dist

    init = os.environ["GRADWIRE_BENCH_INIT"]
    dist.init_process_group(
        "gloo", init_method=init, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
    )
    return dist.get_rank()


def tensor(args: argparse.Namespace) -> dict:
    t = torch.ones(args.elements)
    if args.way == "gloo":
        import torch.distributed as dist

        rank = _gloo()
        call = lambda: dist.all_reduce(t)  # noqa: E731
    else:
        import gradwire.torch as gw

        gw.init()
        rank = gw.rank()
        if args.way == "inplace":
            call = lambda: gw.push_pull_inplace(t, name="large")  # noqa: E731
        else:
            call = lambda: gw.push_pull(t, name="large")  # noqa: E731
    times = []
    for _ in range(args.calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return {"rank": rank, "times": times}


def model(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    net = GPT()
    params = sum(p.numel() for p in net.parameters())
    start = time.perf_counter()
    if args.way == "ddp":
        rank = _gloo()
        wrapped = torch.nn.parallel.DistributedDataParallel(net)  # broadcasts rank 0's parameters
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    else:
        import gradwire.torch as gw

        gw.init()
        rank = gw.rank()
        wrapped = net
        gw.broadcast_parameters(net.state_dict(), root_rank=0)
        opt = gw.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=1e-4), named_parameters=net.named_parameters()
        )
    setup = time.perf_counter() - start
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args.steps):
        ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)
        start = time.perf_counter()
        opt.zero_grad()
        logits = wrapped(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return {"rank": rank, "times": times, "setup": setup, "parameters": params}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("task", choices=["tensor", "model"])
    parser.add_argument("--way", required=True)
    parser.add_argument("--elements", type=int, default=300_000_000)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=65)
    args = parser.parse_args()
    torch.set_num_threads(1)
    found = tensor(args) if args.task == "tensor" else model(args)
    found |= {"task": args.task, "way": args.way, "peak_rss": _peak_rss()}
    print("LARGE " + json.dumps(found), flush=True)
    if args.way in ("gloo", "ddp"):
        import torch.distributed as dist

        dist.barrier()  # a rank that tears gloo down while its peer still sends aborts ("terminate called ...")
        dist.destroy_process_group()
    else:
        import gradwire.torch as gw

        gw.shutdown()


if __name__ == "__main__":
    main()
