"""The optimizer's step on one partition (parameter-server mode, docs/ps-mode.md), apart from the rounds that feed it
(server/optimizer_op.py) and the state it keeps (server/held.py). Two implementations of each algorithm: `TorchStep`
runs torch.optim's own single-tensor step, so the parameters are bit-identical to every worker stepping the same torch
optimizer on the averaged gradients; `NumpyStep` follows torch's formulas in float32 or float64 (without fused
multiply-adds its last bits differ).
"""

from __future__ import annotations

import numpy as np

from gradwire.protocol import update


class NumpyStep:
    """An optimizer's state for one partition, and its step, in numpy (torch.optim's formulas)."""

    def __init__(self, args: dict, params: np.ndarray) -> None:
        self.args, self.params = args, params
        self.algorithm = args["algorithm"]
        self.names = update.state_names(args)
        self.count = 0  # updates applied
        fill = float(args.get("initial_accumulator_value", 0.0))
        self.tensors = {n: np.full_like(params, fill if n == "sum" else 0.0) for n in self.names}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def step(self, grad: np.ndarray, hyper: np.ndarray) -> None:
        p, t, f = self.params, self.tensors, self.params.dtype.type
        h = [float(x) for x in hyper[: len(update.HYPER[self.algorithm])]]
        self.count += 1
        if self.algorithm == "sgd":
            lr, momentum, dampening, wd, nesterov, maximize = h
            g = -grad if maximize else grad
            if wd:
                g = g + f(wd) * p
            if momentum:
                buf = t["momentum_buffer"]
                if self.count == 1:
                    np.copyto(buf, g)
                else:
                    buf *= f(momentum)
                    buf += f(1 - dampening) * g
                g = g + f(momentum) * buf if nesterov else buf
            p -= f(lr) * g
            return
        if self.algorithm == "adagrad":
            lr, lr_decay, wd, eps, maximize = h
            g = -grad if maximize else grad
            if wd:
                g = g + f(wd) * p
            clr = lr / (1 + (self.count - 1) * lr_decay)
            t["sum"] += g * g
            p -= f(clr) * (g / (np.sqrt(t["sum"]) + f(eps)))
            return
        lr, beta1, beta2, eps, wd, maximize = h  # adam, adamw
        g = -grad if maximize else grad
        if self.algorithm == "adamw":
            p *= f(1 - lr * wd)
        elif wd:
            g = g + f(wd) * p
        m, v = t["exp_avg"], t["exp_avg_sq"]
        m += f(1 - beta1) * (g - m)
        v *= f(beta2)
        v += f(1 - beta2) * g * g
        bias1, bias2 = 1 - beta1**self.count, 1 - beta2**self.count
        if "max_exp_avg_sq" in t:
            np.maximum(t["max_exp_avg_sq"], v, out=t["max_exp_avg_sq"])
            v = t["max_exp_avg_sq"]
        denom = np.sqrt(v) / f(bias2**0.5) + f(eps)
        p -= f(lr / bias1) * (m / denom)

    def read(self, name: str) -> np.ndarray | None:
        return self.tensors.get(name)

    def write(self, name: str, data: np.ndarray) -> None:
        np.copyto(self.tensors[name], data)

    def set_count(self, count: int) -> None:
        self.count = count


class TorchStep:
    """torch.optim's own optimizer over one partition (the parameters share the key's memory)."""

    CLASSES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad"}

    def __init__(self, args: dict, params: np.ndarray) -> None:
        import torch  # only servers of torch jobs, whose environment has it

        self.torch = torch
        self.args, self.algorithm = args, args["algorithm"]
        self.names = update.state_names(args)
        self.param = torch.nn.Parameter(torch.from_numpy(params), requires_grad=True)
        kwargs: dict = {"foreach": False}
        if self.algorithm in ("adam", "adamw"):
            kwargs["amsgrad"] = bool(args["amsgrad"])
        if self.algorithm == "adagrad":
            kwargs["initial_accumulator_value"] = float(args["initial_accumulator_value"])
        self.optimizer = getattr(torch.optim, self.CLASSES[self.algorithm])([self.param], **kwargs)
        self.count = 0
        if self.algorithm in ("adam", "adamw"):  # allocated now (at declaration), as torch's first step would
            state = self.optimizer.state[self.param]
            state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
            for name in self.names:
                state[name] = torch.zeros_like(self.param, memory_format=torch.preserve_format)

    @property
    def nbytes(self) -> int:
        state = self.optimizer.state.get(self.param, {})
        return sum(v.numel() * v.element_size() for v in state.values() if self.torch.is_tensor(v) and v.dim())

    def step(self, grad: np.ndarray, hyper: np.ndarray) -> None:
        group = self.optimizer.param_groups[0]
        h = [float(x) for x in hyper[: len(update.HYPER[self.algorithm])]]
        if self.algorithm == "sgd":
            group["lr"], group["momentum"], group["dampening"], group["weight_decay"] = h[:4]
            group["nesterov"], group["maximize"] = bool(h[4]), bool(h[5])
        elif self.algorithm == "adagrad":
            group["lr"], group["lr_decay"], group["weight_decay"], group["eps"] = h[:4]
            group["maximize"] = bool(h[4])
        else:
            group["lr"], group["betas"], group["eps"], group["weight_decay"] = h[0], (h[1], h[2]), h[3], h[4]
            group["maximize"] = bool(h[5])
        self.param.grad = self.torch.from_numpy(grad)
        self.optimizer.step()
        self.param.grad = None
        self.count += 1

    def read(self, name: str) -> np.ndarray | None:
        value = self.optimizer.state.get(self.param, {}).get(name)
        return value.numpy() if self.torch.is_tensor(value) else None

    def write(self, name: str, data: np.ndarray) -> None:
        self.optimizer.state[self.param][name] = self.torch.from_numpy(np.array(data, copy=True))

    def set_count(self, count: int) -> None:
        self.count = count
        if update.HAS_STEP[self.algorithm]:
            self.optimizer.state[self.param]["step"] = self.torch.tensor(float(count), dtype=self.torch.float32)
