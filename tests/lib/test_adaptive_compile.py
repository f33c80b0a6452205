"""gradlab.adaptive under torch.compile: one graph, no graph break, no recompile.

A step that calls ``threshold`` then ``update`` compiles with ``fullgraph=True`` (a
graph break would raise) and runs the same graph whatever the values: spikes, NaN,
rejected steps, a checkpoint loaded in between. The "eager" backend counts graphs and
runs them as they are, so its thresholds are the eager ones bit for bit; inductor
(about 20 s of compilation for the three policies on two cores) must agree to rounding.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from gradlab.adaptive import AutoClip, SigmaSkip, ZClip, agc_

POLICIES = {
    "autoclip": lambda: AutoClip(quantile=0.8, window=6),
    "zclip": lambda: ZClip(alpha=0.9, z_thresh=2.0, warmup=3),
    "sigmaskip": lambda: SigmaSkip(k=2.0, window=6, min_count=3),
}
STREAM = [1.0, 1.2, 0.9, 1.1, 30.0, math.nan, 1.0, 0.8, math.inf, 1.3, 25.0, 1.1, 0.95, 1.05]
ACCEPTED = [i % 4 != 3 for i in range(len(STREAM))]


def step(policy, stat, accepted):
    tau = policy.threshold(stat)
    policy.update(stat, accepted)
    return tau


def thresholds(policy, fn):
    out = []
    for x, ok in zip(STREAM, ACCEPTED, strict=True):
        out.append(fn(policy, torch.tensor(x), torch.tensor(ok)))
    return torch.stack(out)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(POLICIES))
def test_one_graph_and_no_recompile(name):
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    policy = POLICIES[name]()
    got = thresholds(policy, compiled)
    want = thresholds(POLICIES[name](), step)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # A checkpoint loaded in between copies into the same tensors: still one graph.
    policy.load_state_dict(POLICIES[name]().state_dict())
    assert torch.equal(thresholds(policy, compiled).view(torch.int32), want.view(torch.int32))
    assert counter.frame_count == 1


@pytest.mark.parametrize("name", list(POLICIES))
def test_inductor_agrees_without_recompiling(name):
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    got = thresholds(POLICIES[name](), compiled)
    want = thresholds(POLICIES[name](), step)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    assert counter.frame_count == 1


def test_agc_compiles_to_one_graph():
    counter = CompileCounter()
    compiled = torch.compile(
        lambda ps, head: agc_(ps, exclude=head), backend=counter, fullgraph=True
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    params = list(model.parameters())
    for scale in (1e-3, 1.0, 1e3, math.nan):
        grads = [torch.randn_like(p) * scale for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        n_compiled = compiled(params, params[-2:])
        got = [p.grad.clone() for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        assert int(n_compiled) == int(agc_(params, exclude=params[-2:]))
        for a, p in zip(got, params, strict=True):
            assert torch.equal(a.view(torch.int32), p.grad.view(torch.int32))
    assert counter.frame_count == 1
