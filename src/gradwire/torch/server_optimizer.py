"""`ServerOptimizer`: parameter-server mode for PyTorch (docs/ps-mode.md).

The servers hold the parameters and the optimizer's state, sharded by partition, and apply the update; workers keep
no optimizer state. Each gradient is pushed from a post-accumulate-grad hook as backward produces it (as in
DistributedOptimizer), its servers average it over the workers and step torch.optim's own optimizer on their
partitions, and the new parameters come back straight into the parameter's memory. `step()` waits for them.

    model = Net()
    optimizer = gw.ServerOptimizer(model, "adam", lr=1e-3)          # collective: every worker, after gw.init()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)       # works: hyper-parameters go with every push
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

The object is an instance of the torch optimizer's class (isinstance(optimizer, torch.optim.Adam) holds), with its
param_groups and defaults, so LR schedulers and checkpoint code work. Synchronously (staleness=0) the parameters are
bit-identical to DistributedOptimizer wrapping the same torch optimizer on CPU. Asynchronously (staleness=s > 0) each
worker's gradient is applied as it arrives and a worker runs at most s updates ahead of the slowest.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from gradwire.errors import TensorError
from gradwire.parameters import server_compressor
from gradwire.protocol import update
from gradwire.session import current_worker
from gradwire.worker import Handle, Worker

from .gradients import current_worker_or_none
from .ops import as_numpy
from .optimizer import parameter_names

CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "adagrad": torch.optim.Adagrad}


def _hyper(algorithm: str, group: dict) -> list[float]:
    """A param group's per-push hyper-parameters, in the trailer's order (protocol/update.py)."""
    if algorithm == "sgd":
        keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")
        return [float(group[k]) for k in keys]
    if algorithm == "adagrad":
        return [float(group[k]) for k in ("lr", "lr_decay", "weight_decay", "eps", "maximize")]
    beta1, beta2 = group["betas"]
    return [float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
            float(group["maximize"])]  # fmt: skip


class _ServerOptimizer:
    """Mixed into the torch optimizer's class (as DistributedOptimizer is)."""

    def _gradwire_setup(
        self,
        algorithm: str,
        names: dict[int, str],
        staleness: int,
        passes: int,
        worker: Worker | None,
        dc: float = 0.0,
        compressor: dict | None = None,
    ) -> None:
        self._algorithm, self._staleness, self._passes, self._dc = algorithm, staleness, passes, dc
        self._compressor, self._lr = compressor, 0.0
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]  # type: ignore[attr-defined]
        self._names = {id(p): f"ps.{names[id(p)]}" for p in self._params}
        self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}  # type: ignore[attr-defined]
        self._priority = {id(p): len(self._params) - i for i, p in enumerate(self._params)}  # first layers first
        self._handles: dict[int, tuple[Handle, torch.Tensor | None]] = {}
        self._counts: dict[int, int] = {}
        self._worker = worker
        self._initialized = False
        self.state = defaultdict(dict)  # type: ignore[assignment] - the servers hold it: empty here, always
        for p in self._params:
            if p.dtype not in (torch.float32, torch.float64):
                raise TensorError(f"ServerOptimizer holds float32 or float64 parameters; {names[id(p)]!r} is {p.dtype}")
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]
        if worker is not None:
            self._initialize()

    # -- the servers' side of each parameter ------------------------------------------------------

    @property
    def _w(self) -> Worker:
        if self._worker is None:
            self._worker = current_worker()
        return self._worker

    def _args(self, p: torch.Tensor) -> dict:
        group = self._group_of[id(p)]
        args: dict = {"algorithm": self._algorithm, "impl": "torch", "staleness": self._staleness}
        if self._dc:
            args["delay_compensation"] = self._dc
        if self._compressor:
            args["compressor"] = self._compressor
        if self._algorithm in ("adam", "adamw"):
            args["amsgrad"] = bool(group["amsgrad"])
        if self._algorithm == "adagrad":
            args["initial_accumulator_value"] = float(group["initial_accumulator_value"])
        return args

    def _send(
        self, p: torch.Tensor, kind: int, data: torch.Tensor | None = None, which: int = 0, into: torch.Tensor = None
    ) -> tuple[Handle, torch.Tensor | None]:
        """Start one exchange of `p` with its servers; the answer lands in `into` (default: `p` itself; a CPU
        staging copy for a CUDA parameter, returned second, to be copied back)."""
        staged = None
        if into is None:
            if p.device.type == "cpu" and p.is_contiguous():
                into = p.data
            else:
                into = staged = torch.empty(p.shape, dtype=p.dtype)
        array = None
        if data is not None:
            data = data.detach()
            if data.device.type != "cpu" or not data.is_contiguous():
                data = data.to("cpu").contiguous()
            array = as_numpy(data)[0]
        out = as_numpy(into)[0]
        hyper = _hyper(self._algorithm, self._group_of[id(p)]) if kind == update.GRAD else None
        handle = self._w.update_async(
            array, self._names[id(p)], out, self._args(p), kind, hyper, which, self._priority[id(p)]
        )
        return handle, staged

    def _finish(self, p: torch.Tensor, handle: Handle, staged: torch.Tensor | None) -> None:
        self._w.synchronize(handle)
        if staged is not None:
            with torch.no_grad():
                p.copy_(staged)

    def _exchange_all(
        self,
        kind: int,
        data: Callable[[torch.Tensor], torch.Tensor | None] = lambda p: None,
        which: int = 0,
        params: list[torch.Tensor] | None = None,
        into: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """One exchange of every parameter (or of `params`) with its servers: all started, then all waited for.
        `data(p)` is what goes, `into(p)` where the answer lands (default: the parameter itself)."""
        params = self._params if params is None else params
        started = [(p, *self._send(p, kind, data(p), which, into(p) if into else None)) for p in params]
        for p, handle, staged in started:
            self._finish(p, handle, staged)

    def _initialize(self) -> None:
        """Every worker's parameters become the first worker's, on the servers and here (collective, once)."""
        if self._initialized:
            return
        self._initialized = True
        self._exchange_all(update.INIT, lambda p: p)

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._initialized:
            self._initialize()
        pid = id(p)
        if pid in self._handles:
            raise TensorError(
                f"worker {self._w.rank}: the gradient of {self._names[pid]!r} was computed more times than "
                f"backward_passes_per_step={self._passes} before step()",
                tensor=self._names[pid],
                rank=self._w.rank,
            )
        self._counts[pid] = self._counts.get(pid, 0) + 1
        if self._counts[pid] == self._passes:
            self._push(p)

    def _push(self, p: torch.Tensor) -> None:
        grad = p.grad
        assert grad is not None
        if grad.is_sparse:
            grad = p.grad = grad.to_dense()
        if self._passes > 1:
            grad.mul_(1.0 / self._passes)
        self._handles[id(p)] = self._send(p, update.GRAD, grad)

    # -- torch.optim.Optimizer's interface --------------------------------------------------------

    def synchronize(self) -> None:
        """Push what backward did not (a parameter without a gradient pushes zeros, as DistributedOptimizer), then
        wait for every parameter's update."""
        if not self._initialized:
            self._initialize()
        for p in self._params:
            if id(p) not in self._handles:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._push(p)
        for p in self._params:
            handle, staged = self._handles.pop(id(p))
            self._finish(p, handle, staged)
        self._counts.clear()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        if self._compressor and self._compressor["ef"]:
            self._follow_lr()
        return loss

    def _follow_lr(self) -> None:
        """A changed learning rate rescales the residuals of error feedback by old/new (as DistributedOptimizer's),
        so that what they carry moves the parameters as far as when it was dropped."""
        lr = float(self.param_groups[0].get("lr", 0.0))  # type: ignore[attr-defined]
        if self._lr and lr and lr != self._lr:
            self._w.calls.compressing.rescale(self._lr / lr)
        self._lr = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise TensorError(
                f"zero_grad() called with {len(self._handles)} updates pending: call step() first, or the gradients "
                "being pushed would be zeroed under the transfer"
            )
        return super().zero_grad(set_to_none)  # type: ignore[misc]

    def _read_all(self, which: int) -> dict[int, torch.Tensor]:
        bufs = {id(p): torch.empty(p.shape, dtype=p.dtype) for p in self._params}
        self._exchange_all(update.READ, which=which, into=lambda p: bufs[id(p)])
        return bufs

    @torch.no_grad()
    def pull_parameters(self) -> None:
        """Copy the servers' newest parameters into the model. Asynchronously, a worker holds the parameters of its
        own last update, which others may have moved on from: call it (after a barrier) before evaluating."""
        values = self._read_all(0)
        for p in self._params:
            p.copy_(values[id(p)])

    def state_dict(self) -> dict:
        """The torch optimizer's state_dict, its state gathered from the servers (the format of the same torch
        optimizer's own: a checkpoint loads into either). Not collective: any worker may call it between steps."""
        if self._handles:
            raise TensorError("state_dict() with updates pending: call step() first")
        if not self._initialized:
            self._initialize()
        names = update.state_names(self._args(self._params[0])) if self._params else []
        tensors = [self._read_all(which) for which in range(1, len(names) + 1)]
        counts = self._read_all(len(names) + 1)
        state: dict = defaultdict(dict)
        for p in self._params:
            pid = id(p)
            count = int(counts[pid].reshape(-1)[0]) if p.numel() else 0
            entry: dict = {}
            if self._algorithm == "sgd":
                if count:
                    momentum = self._group_of[pid]["momentum"]
                    entry["momentum_buffer"] = tensors[0][pid].to(p.device) if momentum else None
            elif count or self._algorithm == "adagrad":
                entry["step"] = torch.tensor(float(count), dtype=torch.float32)
                for name, values in zip(names, tensors, strict=True):
                    entry[name] = values[pid].to(p.device)
            if entry:
                state[p] = entry
        held, self.state = self.state, state  # type: ignore[has-type]
        try:
            return super().state_dict()  # type: ignore[misc]
        finally:
            self.state = held

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict (of this optimizer, or of the same torch optimizer) into the servers, with the model's
        current parameters: call model.load_state_dict first. Any worker may call it; every one may."""
        super().load_state_dict(state_dict)  # type: ignore[misc]  # param_groups here, state into self.state
        loaded, self.state = self.state, defaultdict(dict)  # type: ignore[has-type]
        self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}  # type: ignore[attr-defined]
        if not self._initialized:
            self._initialize()
        names = update.state_names(self._args(self._params[0])) if self._params else []
        self._exchange_all(update.WRITE, lambda p: p, -1)  # the parameters, with the state afresh
        for which, name in enumerate(names, 1):
            present = [p for p in self._params if torch.is_tensor(loaded.get(p, {}).get(name))]
            self._exchange_all(update.WRITE, lambda p, name=name: loaded[p][name], which, present)

        def count(p: torch.Tensor) -> torch.Tensor:
            entry = loaded.get(p, {})
            steps = entry["step"] if "step" in entry else int(entry.get("momentum_buffer") is not None)
            return torch.full(p.shape, float(steps), dtype=p.dtype)

        self._exchange_all(update.WRITE, count, len(names) + 1)


def ServerOptimizer(  # noqa: N802 - a factory that returns an instance of the torch optimizer's class
    params: torch.nn.Module | Iterable[Any],
    optimizer: str = "adam",
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    staleness: int = 0,
    backward_passes_per_step: int = 1,
    delay_compensation: float = 0.0,
    compression: object = None,
    **hyper: Any,
) -> torch.optim.Optimizer:
    """An optimizer whose parameters and state live on the summation servers (parameter-server mode).

    `params`: a model (its named_parameters name the tensors), or parameters / param groups as torch optimizers take
    them (then pass `named_parameters`, or the parameters are named by position: the same on every worker).
    `optimizer`: "sgd", "adam", "adamw" or "adagrad", with torch.optim's keyword arguments (lr, betas, momentum,
    weight_decay, ...; foreach/fused/capturable/differentiable are not taken: the servers run on CPU).
    `staleness`: 0, synchronous (bit-identical to DistributedOptimizer over the same torch optimizer); s > 0,
    asynchronous: each worker's gradient is applied as it arrives, and a worker waits when it is more than s
    updates ahead of the slowest. `delay_compensation` lambda > 0 (asynchronous only): the servers correct each
    gradient for the parameters' move since its worker last pulled them, g + lambda * g * g * (w_now - w_old)
    (DC-ASGD; docs/ps-mode.md). `compression`: a compressor the servers run (`Compression.onebit()`, `.topk(0.01)`,
    `.randomk(...)`, `.dithering(...)`) for the gradients pushed (float32 parameters large enough to gain), with this
    worker's error feedback, which follows the learning rate; the parameters come back as they are. Collective:
    every worker builds it, after gradwire.init() (or its first backward pass does the rest), and every worker's
    parameters become worker 0's.
    """
    if optimizer not in CLASSES:
        raise ValueError(f"unknown optimizer {optimizer!r}; gradwire's servers run {', '.join(sorted(CLASSES))}")
    if not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness must be an int >= 0, got {staleness!r}")
    update.check_args({"algorithm": optimizer, "staleness": staleness, "delay_compensation": delay_compensation})
    compressor = server_compressor(compression)
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    for key in ("foreach", "fused", "capturable", "differentiable"):
        if hyper.get(key):
            raise ValueError(f"{key}=True: a server-side optimizer runs torch's single-tensor step on CPU")
        hyper.pop(key, None)
    if isinstance(params, torch.nn.Module):
        named_parameters = list(params.named_parameters()) if named_parameters is None else named_parameters
        params = params.parameters()
    cls = CLASSES[optimizer]
    template = cls(params, **hyper)  # torch checks the arguments, and builds the param groups and defaults
    flat = [p for g in template.param_groups for p in g["params"]]
    names = parameter_names(flat, named_parameters)
    wrapped_cls = type(cls.__name__, (_ServerOptimizer, cls), {})
    wrapped = wrapped_cls.__new__(wrapped_cls)
    wrapped.__dict__.update(template.__dict__)
    worker = current_worker_or_none()
    dc = float(delay_compensation)
    wrapped._gradwire_setup(optimizer, names, staleness, backward_passes_per_step, worker, dc, compressor)
    return wrapped


def server_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state a local torch optimizer holds on this worker (what ServerOptimizer moves off it)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


__all__ = ["ServerOptimizer", "server_state_bytes"]
