"""The optimizers of torch.optim and the helpers that compare a run with a reference run.

Shared by the tests of step_if_ (test_step.py) and of StepGuard (test_guard_optimizers.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

optim = torch.optim

#: name -> (factory, host reads of a bare step per parameter with a gradient).
OPTIMIZERS = {
    "SGD": (lambda p: optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.1), 0),
    "SGD-nesterov": (lambda p: optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True), 0),
    "SGD-fused": (lambda p: optim.SGD(p, lr=0.05, momentum=0.9, fused=True), 0),
    "Adam": (lambda p: optim.Adam(p, lr=0.01, weight_decay=0.01), 1),
    "Adam-single-tensor": (lambda p: optim.Adam(p, lr=0.01, foreach=False), 1),
    "Adam-amsgrad": (lambda p: optim.Adam(p, lr=0.01, amsgrad=True), 1),
    "Adam-fused": (lambda p: optim.Adam(p, lr=0.01, fused=True), 0),
    "AdamW": (lambda p: optim.AdamW(p, lr=0.01, weight_decay=0.1), 1),
    "AdamW-fused": (lambda p: optim.AdamW(p, lr=0.01, weight_decay=0.1, fused=True), 0),
    "Adagrad": (lambda p: optim.Adagrad(p, lr=0.05), 1),
    "Adagrad-fused": (lambda p: optim.Adagrad(p, lr=0.05, fused=True), 0),
    "Adadelta": (lambda p: optim.Adadelta(p), 0),
    "Adafactor": (lambda p: optim.Adafactor(p, lr=0.01), 3),
    "Adamax": (lambda p: optim.Adamax(p, lr=0.01), 1),
    "ASGD": (lambda p: optim.ASGD(p, lr=0.05), 3),
    "NAdam": (lambda p: optim.NAdam(p, lr=0.01), 3),
    "RAdam": (lambda p: optim.RAdam(p, lr=0.01), 1),
    "RMSprop": (lambda p: optim.RMSprop(p, lr=0.01, momentum=0.5), 0),
    "Rprop": (lambda p: optim.Rprop(p, lr=0.01), 4),
    "Muon": (lambda p: optim.Muon(p, lr=0.02), 0),
}
#: Optimizers that create their state in __init__ rather than at the first step.
EAGER_STATE = {"Adagrad", "Adagrad-fused"}


def model_for(name: str) -> nn.Module:
    torch.manual_seed(0)
    bias = name != "Muon"  # Muon takes 2-d parameters only
    return nn.Sequential(nn.Linear(5, 8, bias=bias), nn.Tanh(), nn.Linear(8, 2, bias=bias))


def batches_of(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]


def corrupt(batch, kind: str):
    x, y = batch
    if kind == "big":
        return x, y * 1e4
    x = x.clone()
    x[0, 0] = math.nan
    return x, y


class Hooks:
    """Pre/post step hooks that log their calls and keep an EMA of the parameters."""

    def __init__(self, opt):
        self.calls: list[str] = []
        self.ema = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
        opt.register_step_pre_hook(lambda o, a, k: self.calls.append("pre"))
        opt.register_step_post_hook(self._post)

    def _post(self, opt, args, kwargs):
        self.calls.append("post")
        params = [p for g in opt.param_groups for p in g["params"]]
        for e, p in zip(self.ema, params, strict=True):
            e.mul_(0.5).add_(p.detach(), alpha=0.5)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b or (a != a and b != b)  # NaN == NaN for Python floats


def assert_identical(got, ref) -> None:
    for p, q in zip(got[0].parameters(), ref[0].parameters(), strict=True):
        assert torch.equal(p, q), "parameters differ"
    assert same(got[1].state_dict(), ref[1].state_dict()), "optimizer state differs"
    if ref[2] is not None:
        assert got[2].calls == ref[2].calls, "step hooks fired on a skipped step"
        assert all(map(torch.equal, got[2].ema, ref[2].ema)), "an EMA hook saw a skipped step"
