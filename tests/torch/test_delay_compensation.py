"""BytePS's delay-compensation ops (gradwire/torch/delay_compensation.py) against the reference formulas of BytePS's
own tests (tests/torch/test_dc_op.py, test_dc_adam.py): float32 bit for bit, float16 computed in float32."""

import math
import random

import pytest

import gradwire.torch as gwt
import torch
from gradwire.torch.ops import dc_adam_


def _lists(seed, count, dtype=torch.float32, moments_dtype=torch.float32):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shapes = [rng.sample(range(1, 60), 2) for _ in range(count)]
    make = [[torch.rand(s).to(dtype) for s in shapes] for _ in range(3)]
    moments = [[torch.rand(s).to(moments_dtype) for s in shapes] for _ in range(2)]
    return (*make, *moments)


@torch.no_grad()
def _dc_reference(params, grads, prev_params, dc_lambda):
    return [g + dc_lambda * g * g * (p - pp) for p, g, pp in zip(params, grads, prev_params, strict=True)]


@torch.no_grad()
def _dc_adam_reference(params, grads, prev, dc_lambda, exp_avgs, exp_avg_sqs, steps, lr, eps, wd, beta1, beta2):
    for i in range(len(params)):
        p, prev_p, g = params[i].clone(), prev[i].clone(), grads[i].clone()
        m, v = exp_avgs[i], exp_avg_sqs[i]
        prev[i].copy_(p)
        g += dc_lambda * g * g * (p - prev_p)
        m = m * beta1 + (1 - beta1) * g
        v = v * beta2 + (1 - beta2) * g * g
        denom = torch.sqrt(v) + eps
        step_size = lr * math.sqrt(1 - math.pow(beta2, steps[i])) / (1 - math.pow(beta1, steps[i]))
        if wd != 0.0:
            p -= wd * lr * p
        p -= step_size * m / denom
        params[i].copy_(p)
        grads[i].copy_(g)
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)


def test_delay_compensation_float32_is_the_reference_bit_for_bit_and_remembers_the_parameters():
    params, grads, prev, _, _ = _lists(1, 30)
    dc_lambda = 0.37
    expected = _dc_reference(params, grads, prev, dc_lambda)
    kept = [p.clone() for p in params]
    assert gwt.delay_compensation_(params, grads, prev, dc_lambda) == 0
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    assert all(torch.equal(p, k) for p, k in zip(params, kept, strict=True))  # params untouched
    assert all(torch.equal(pp, p) for pp, p in zip(prev, params, strict=True))  # prev_params <- params


def test_delay_compensation_float16_is_computed_in_float32_and_narrowed_once():
    params, grads, prev, _, _ = _lists(2, 20, torch.float16)
    expected = [r.half() for r in _dc_reference(*[[t.float() for t in ts] for ts in (params, grads, prev)], 0.8)]
    gwt.delay_compensation_(params, grads, prev, 0.8)
    assert all(g.dtype == torch.float16 and torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    assert all(torch.equal(pp, p) for pp, p in zip(prev, params, strict=True))


def test_lambda_zero_leaves_the_gradient_as_it_was():
    params, grads, prev, _, _ = _lists(3, 5)
    before = [g.clone() for g in grads]
    gwt.delay_compensation_(params, grads, prev, 0.0)
    assert all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_dc_adam_float32_is_the_reference_bit_for_bit(weight_decay):
    args = dict(lr=0.001, eps=1e-5, weight_decay=weight_decay, beta1=0.5, beta2=0.5)
    mine = _lists(4, 25)
    theirs = tuple([t.clone() for t in ts] for ts in mine)
    steps = list(range(1, 26))
    original = [p.clone() for p in mine[0]]
    _dc_adam_reference(*theirs[:3], 1.0, *theirs[3:], steps, args["lr"], args["eps"], weight_decay, 0.5, 0.5)
    assert dc_adam_(*mine[:3], 1.0, *mine[3:], steps, **args) == 0
    for got, want in zip(mine, theirs, strict=True):  # params, grads, prev_params, exp_avgs, exp_avg_sqs
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(torch.equal(pp, o) for pp, o in zip(mine[2], original, strict=True))  # the parameters before


def test_dc_adam_float16_parameters_with_float32_moments_match_the_float32_computation():
    mine = _lists(5, 10, torch.float16, torch.float32)
    wide = tuple([t.float() for t in ts] for ts in mine[:3]) + tuple([t.clone() for t in ts] for ts in mine[3:])
    steps = list(range(1, 11))
    _dc_adam_reference(*wide[:3], 1.0, *wide[3:], steps, 0.001, 1e-5, 0.0, 0.5, 0.5)
    dc_adam_(*mine[:3], 1.0, *mine[3:], steps, 0.001, 1e-5, 0.0, 0.5, 0.5)
    assert mine[0][0].dtype == torch.float16 and not torch.isnan(mine[0][0]).any()
    for got, want in zip(mine, wide, strict=True):
        assert all(torch.equal(a.float(), b.to(a.dtype).float()) for a, b in zip(got, want, strict=True))


def test_the_lists_must_match():
    with pytest.raises(TypeError, match="list of tensors"):
        gwt.delay_compensation_(torch.ones(2), [torch.ones(2)], [torch.ones(2)], 0.1)
    with pytest.raises(ValueError, match="one of each"):
        gwt.delay_compensation_([torch.ones(2)], [], [torch.ones(2)], 0.1)
