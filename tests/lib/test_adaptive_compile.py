"""gradlab.adaptive under torch.compile: one graph, no graph break, no recompile.

A step that calls ``threshold`` then ``update`` compiles with ``fullgraph=True`` (a
graph break would raise) and runs the same graph whatever the values: spikes, NaN,
skipped steps, a checkpoint loaded in between. The "eager" backend counts graphs and
runs them as they are, so its thresholds are the eager ones bit for bit; inductor
(about 20 s of compilation for the policies on two cores) must agree to rounding.
AutoClip's whole history grows, and recompiles while it starts to grow, as its
docstring says: a few graphs, then none.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

import gradlab.adaptive as adaptive
from gradlab.adaptive import AutoClip, SigmaSkip, ZClip, agc_

#: The policies whose state keeps its shape: one graph, ever.
POLICIES = {
    "autoclip_window": lambda: AutoClip(percentile=80.0, window=6),
    "zclip": lambda: ZClip(alpha=0.9, z_thresh=2.0, warmup=3),
    "sigma_all": lambda: SigmaSkip(k=2.0, window=6, min_count=3),
    "sigma_taken": lambda: SigmaSkip(k=2.0, window=6, min_count=3, steps="taken"),
}
STREAM = [1.0, 1.2, 0.9, 1.1, 30.0, math.nan, 1.0, 0.8, math.inf, 1.3, 25.0, 1.1, 0.95, 1.05]
TAKEN = [i % 4 != 3 for i in range(len(STREAM))]


def step(policy, stat, taken):
    tau = policy.threshold(stat)
    policy.update(stat, taken)
    return tau


def thresholds(policy, fn, stream=STREAM, taken=TAKEN):
    out = []
    for x, ok in zip(stream, taken, strict=True):
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
    """Inductor may hand a frame to its backend twice while it compiles it the first time
    (a restart of the analysis, seen on an AVX-512 machine); after that call, never."""
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    policy = POLICIES[name]()
    frames = []

    def counted(*args):
        tau = compiled(*args)
        frames.append(counter.frame_count)
        return tau

    got = thresholds(policy, counted)
    want = thresholds(POLICIES[name](), step)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    assert 1 <= frames[0] <= 2 and frames[-1] == frames[0], frames


@pytest.mark.parametrize("name", list(POLICIES))
def test_aot_eager_keeps_every_update_of_float64_state(name):
    """aot_eager (inductor's front end, without its compilation time) on float64 state,
    ZClip's whatever its dtype: a copy_ into a 0-dim float64 tensor was dropped there."""
    made = POLICIES[name]()

    def build():  # the same policy, float64; its config is its constructor's keywords
        return type(made)(**made.state_dict()["config"], dtype=torch.float64)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    policy, eager = build(), build()
    got, want = thresholds(policy, compiled), thresholds(eager, step)
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))
    mine, theirs = policy.state_dict()["state"], eager.state_dict()["state"]
    assert all(torch.equal(mine[key], theirs[key]) for key in mine)


def test_whole_history_recompiles_only_while_it_starts_to_grow(monkeypatch):
    """The buffer doubles from 4 slots seven times over 300 steps; dynamo compiles at the
    first two calls and the first two doublings (5 graphs), then never again."""
    monkeypatch.setattr(adaptive, "_HISTORY_START", 4)
    stream = [STREAM[i % len(STREAM)] * (1 + i / 100) for i in range(300)]
    taken = [i % 3 != 0 for i in range(300)]
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    policy, eager = AutoClip(percentile=30.0), AutoClip(percentile=30.0)
    frames = []
    for x, ok in zip(stream, taken, strict=True):
        stat, flag = torch.tensor(x), torch.tensor(ok)
        assert torch.equal(compiled(policy, stat, flag), step(eager, stat, flag))
        frames.append(counter.frame_count)
    assert policy.state_dict()["state"]["history"].numel() == 512
    assert frames[-1] <= 5 and frames[16] == frames[-1]  # none after the second doubling
    # A checkpoint of another size is taken at its size, and the compiled step goes on.
    policy.load_state_dict(eager.state_dict())
    x, ok = torch.tensor(2.0), torch.tensor(True)
    assert torch.equal(compiled(policy, x, ok), step(eager, x, ok))


def test_whole_history_under_inductor():
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    got = thresholds(AutoClip(percentile=30.0), compiled)
    want = thresholds(AutoClip(percentile=30.0), step)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    assert counter.frame_count <= 2  # the first call, then the host count as a symbol


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
