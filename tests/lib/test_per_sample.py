"""gradlab.per_sample: per-sample clip and ignore, against a naive per-sample loop.

The reference is the plainest possible DP-SGD clip step: one backward per sample, then
gradlab's own ``clip_grad_norm_`` / ``grad_ignore_norm_`` on that sample's gradient
(per parameter for per-layer thresholds), then the sum. Both the torch.func path
(``per_sample_grads`` + ``clip_per_sample_``) and ``GhostClipping`` must match it.
"""

import copy
import inspect
import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradlab
import gradlab.per_sample as per_sample
from gradlab.per_sample import (
    EPS,
    GhostClipping,
    clip_per_sample_,
    ignore_per_sample_,
    per_sample_grads,
    per_sample_norms,
)
from gradlab.sync import HostReadCounter

TOL64 = {"atol": 1e-10, "rtol": 1e-10}
TOL32 = {"atol": 1e-6, "rtol": 1e-6}


# ------------------------------------------------------------------ models and data


class MLP(nn.Module):
    def __init__(self, d_in=6, hidden=8, d_out=3):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.head(self.net(x))


class Sequence(nn.Module):
    """Linear layers applied along a sequence dimension T, then a mean over T.

    ``wide`` (T^2 <= d_in d_out) takes the ghost Gram path, ``narrow`` (T^2 > d_in
    d_out) the materialised one; ``narrow`` is called twice (its calls add up).
    """

    def __init__(self, d_in=5, d_out=3):
        super().__init__()
        self.wide = nn.Linear(d_in, 6)
        self.narrow = nn.Linear(6, 2, bias=False)
        self.head = nn.Linear(2, d_out)

    def forward(self, x):  # x: (B, T, d_in)
        h = torch.tanh(self.wide(x))
        h = self.narrow(h) + self.narrow(h.flip(1))
        return self.head(h.mean(1))


class Tokens(nn.Module):
    """Embedding (with padding) -> Linear per token -> mean -> head."""

    def __init__(self, vocab=7, dim=4, d_out=3, padding_idx=0):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, d_out)

    def forward(self, ids):  # (B, T)
        return self.head(torch.tanh(self.proj(self.emb(ids))).mean(1))


class Normed(nn.Module):
    """Embedding -> LayerNorm -> Linear -> RMSNorm (no bias) -> LayerNorm (reused) -> head."""

    def __init__(self, vocab=7, dim=4, d_out=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.ln = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.rms = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, d_out)

    def forward(self, ids):  # (B, T)
        h = self.ln(self.emb(ids))
        h = self.ln(torch.tanh(self.rms(self.proj(h))) + h)
        return self.head(h.mean(1))


def weighted_ce(out, y, w):
    """Per-sample cross-entropy times a per-sample weight (to plant huge/NaN/inf grads)."""
    return w * F.cross_entropy(out, y, reduction="none")


def make(kind, batch=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if kind == "mlp":
        model, x = MLP(), torch.randn(batch, 6, generator=gen)
    elif kind == "seq":
        model, x = Sequence(), torch.randn(batch, 4, 5, generator=gen)
    elif kind == "seq1":  # T = 1
        model, x = Sequence(), torch.randn(batch, 1, 5, generator=gen)
    elif kind == "tokens":
        model = Tokens()
        x = torch.randint(0, 7, (batch, 5), generator=gen)
        x[:, 0] = x[:, 1]  # repeated ids within a sample
        x[0, 2] = 0  # padding
    elif kind == "norms":
        model = Normed()
        x = torch.randint(0, 7, (batch, 5), generator=gen)
    else:
        raise AssertionError(kind)
    model = model.to(dtype)
    if x.is_floating_point():
        x = x.to(dtype)
    y = torch.randint(0, 3, (batch,), generator=gen)
    w = 1.0 + torch.rand(batch, generator=gen, dtype=dtype)
    return model, x, y, w


def naive(model, x, y, w, max_norm, mode):
    """One backward per sample, gradlab's clip/ignore on it, then the sum."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        for p in params:
            p.grad = None
        weighted_ce(model(x[i : i + 1]), y[i : i + 1], w[i : i + 1]).sum().backward()
        if isinstance(max_norm, list):
            if mode == "clip":
                for p, c in zip(params, max_norm, strict=True):
                    gradlab.clip_grad_norm_(p, c)
            else:
                keep = all(
                    c / (torch.linalg.vector_norm(p.grad) + EPS) >= 1
                    for p, c in zip(params, max_norm, strict=True)
                )
                for p in params:
                    p.grad = torch.where(torch.tensor(keep), p.grad, 0)
        elif mode == "clip":
            gradlab.clip_grad_norm_(params, max_norm)
        else:
            gradlab.grad_ignore_norm_(params, max_norm)
        for t, p in zip(total, params, strict=True):
            if p.grad is not None:
                t += p.grad
    for p in params:
        p.grad = None
    return total


_NORMS_CACHE = {}


def sample_norms(model, x, y, w):
    """Per-sample, per-parameter norms by torch.func, cached by the inputs' contents."""
    tensors = [x, y, w, *model.parameters()]
    key = (
        type(model).__name__,
        *(t.dtype for t in tensors),
        *(tuple(t.detach().flatten().tolist()) for t in tensors),
    )
    if key not in _NORMS_CACHE:
        grads = per_sample_grads(model, weighted_ce, x, y, w)
        _NORMS_CACHE[key] = per_sample_norms(grads)
    return _NORMS_CACHE[key].clone()


def run_func(model, x, y, w, max_norm, mode, **kw):
    params = [p for p in model.parameters() if p.requires_grad]
    grads = per_sample_grads(model, weighted_ce, x, y, w)
    fn = clip_per_sample_ if mode == "clip" else ignore_per_sample_
    norms = fn(params, grads, max_norm, **kw)
    return [p.grad for p in params], norms


def run_ghost(model, x, y, w, max_norm, mode, **kw):
    ghost = GhostClipping(model)
    with ghost:
        losses = weighted_ce(model(x), y, w)
        step = ghost.clip_ if mode == "clip" else ghost.ignore_
        norms = step(losses, max_norm, **kw)
    return [p.grad for p in ghost.parameters], norms


def thresholds(model, x, y, w, per_layer):
    """Medians of the per-sample norms: about half the samples are over."""
    norms = sample_norms(model, x, y, w)
    if per_layer:
        return [float(v) for v in norms.median(0).values]
    return float(torch.linalg.vector_norm(norms, dim=1).median())


def assert_grads_close(got, want, **tol):
    assert len(got) == len(want)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, **tol)


RUNNERS = {"func": run_func, "ghost": run_ghost}


# ------------------------------------------------------------------ against the loop


@pytest.mark.parametrize("runner", ["func", "ghost"])
@pytest.mark.parametrize("mode", ["clip", "ignore"])
@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per_layer"])
@pytest.mark.parametrize("kind", ["mlp", "seq", "seq1", "tokens", "norms"])
def test_matches_naive_loop_float64(kind, per_layer, mode, runner):
    model, x, y, w = make(kind)
    c = thresholds(model, x, y, w, per_layer)
    want = naive(model, x, y, w, c, mode)
    got, norms = RUNNERS[runner](model, x, y, w, c, mode)
    assert_grads_close(got, want, **TOL64)
    ref_norms = sample_norms(model, x, y, w)
    if not per_layer:
        ref_norms = torch.linalg.vector_norm(ref_norms, dim=1)
    torch.testing.assert_close(norms, ref_norms, **TOL64)


@pytest.mark.parametrize("runner", ["func", "ghost"])
@pytest.mark.parametrize("mode", ["clip", "ignore"])
@pytest.mark.parametrize("kind", ["mlp", "seq", "tokens", "norms"])
def test_matches_naive_loop_float32(kind, mode, runner):
    model, x, y, w = make(kind, dtype=torch.float32)
    c = thresholds(model, x, y, w, per_layer=False)
    want = naive(model, x, y, w, c, mode)
    got, _ = RUNNERS[runner](model, x, y, w, c, mode)
    assert_grads_close(got, want, **TOL32)


def test_thresholds_really_split_the_batch():
    model, x, y, w = make("mlp")
    c = thresholds(model, x, y, w, per_layer=False)
    norms = torch.linalg.vector_norm(sample_norms(model, x, y, w), dim=1)
    assert 0 < int((norms > c).sum()) < x.shape[0]


@pytest.mark.parametrize("runner", ["func", "ghost"])
def test_ghost_equals_func_on_both_sides_of_the_decision(runner):
    model, x, y, w = make("seq")
    c = thresholds(model, x, y, w, per_layer=False)
    got, _ = RUNNERS[runner](model, x, y, w, c, "clip")
    other = "ghost" if runner == "func" else "func"
    model.zero_grad(set_to_none=True)
    ref, _ = RUNNERS[other](model, x, y, w, c, "clip")
    assert_grads_close(got, ref, **TOL64)


@given(
    batch=st.integers(1, 4),
    seq=st.integers(1, 6),
    d_in=st.integers(1, 5),
    d_out=st.integers(1, 5),
    bias=st.booleans(),
)
def test_linear_ghost_norm_any_shape(batch, seq, d_in, d_out, bias):
    torch.manual_seed(batch * 1000 + seq * 100 + d_in * 10 + d_out)
    layer = nn.Linear(d_in, d_out, bias=bias).double()
    x = torch.randn(batch, seq, d_in, dtype=torch.float64)
    t = torch.randn(batch, seq, d_out, dtype=torch.float64)

    def loss(out, t):
        return (out * t).sum(tuple(range(1, out.dim())))

    grads = per_sample_grads(layer, loss, x, t)
    want = torch.linalg.vector_norm(per_sample_norms(grads), dim=1)
    with GhostClipping(layer) as ghost:
        norms = ghost.clip_(loss(layer(x), t), math.inf)
    torch.testing.assert_close(norms, want, **TOL64)
    # max_norm=inf: the plain sum of the per-sample gradients, i.e. the batch gradient
    assert_grads_close([p.grad for p in layer.parameters()], [g.sum(0) for g in grads], **TOL64)


# --------------------------------------------------------------- non-finite samples


@pytest.mark.parametrize("runner", ["func", "ghost"])
@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per_layer"])
@pytest.mark.parametrize("kind", ["mlp", "seq", "tokens", "norms"])
def test_ignore_drops_nan_inf_and_huge_samples(kind, per_layer, runner):
    model, x, y, w = make(kind)
    c = thresholds(model, x, y, w, per_layer)
    clean = naive(model, x[3:], y[3:], w[3:], c, "ignore")
    w = w.clone()
    w[0], w[1], w[2] = math.nan, math.inf, 1e30
    got, norms = RUNNERS[runner](model, x, y, w, c, "ignore")
    for g in got:
        assert torch.isfinite(g).all()
    assert_grads_close(got, clean, **TOL64)
    flat = norms if norms.dim() == 1 else torch.linalg.vector_norm(norms, dim=1)
    assert not torch.isfinite(flat[:2]).any()


@pytest.mark.parametrize("runner", ["func", "ghost"])
def test_ignore_drops_a_nan_input(runner):
    model, x, y, w = make("mlp")
    c = thresholds(model, x, y, w, per_layer=False)
    clean = naive(model, x[1:], y[1:], w[1:], c, "ignore")
    x = x.clone()
    x[0, 2] = math.nan
    got, _ = RUNNERS[runner](model, x, y, w, c, "ignore")
    assert_grads_close(got, clean, **TOL64)


@pytest.mark.parametrize("runner", ["func", "ghost"])
def test_clip_lets_a_nan_sample_through_like_clip_grad_norm(runner):
    model, x, y, w = make("mlp")
    w = w.clone()
    w[0] = math.nan
    got, _ = RUNNERS[runner](model, x, y, w, 1.0, "clip")
    assert not all(torch.isfinite(g).all() for g in got)


# ------------------------------------------------------------------ edge thresholds


@pytest.mark.parametrize("runner", ["func", "ghost"])
@pytest.mark.parametrize("mode", ["clip", "ignore"])
@pytest.mark.parametrize("kind", ["mlp", "tokens"])
def test_batch_of_one_is_clip_grad_norm(kind, mode, runner):
    model, x, y, w = make(kind, batch=1)
    c = 0.5 * float(torch.linalg.vector_norm(sample_norms(model, x, y, w)))
    weighted_ce(model(x), y, w).sum().backward()
    params = list(model.parameters())
    (gradlab.clip_grad_norm_ if mode == "clip" else gradlab.grad_ignore_norm_)(params, c)
    want = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    got, _ = RUNNERS[runner](model, x, y, w, c, mode)
    assert_grads_close(got, want, **TOL64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ghost", [False, True])
def test_threshold_at_the_boundary(ghost, dtype):
    """A sample of norm 5: kept whole at C = 5 + eps, clipped/dropped just below."""
    layer = nn.Linear(2, 1, bias=False).to(dtype)
    x = torch.tensor([[3.0, 4.0], [0.6, 0.8]], dtype=dtype)  # norms 5 and 1

    def run(c, mode):
        layer.weight.grad = None
        if ghost:
            with GhostClipping(layer) as g:
                (g.clip_ if mode == "clip" else g.ignore_)(layer(x).sum(1), c)
        else:
            fn = clip_per_sample_ if mode == "clip" else ignore_per_sample_
            fn([layer.weight], [x.unsqueeze(1)], c)
        return layer.weight.grad

    whole = torch.tensor([[3.6, 4.8]], dtype=dtype)
    at = 5.0 + EPS
    torch.testing.assert_close(run(at, "clip"), whole, atol=0, rtol=0)
    torch.testing.assert_close(run(at, "ignore"), whole, atol=0, rtol=0)
    below = math.nextafter(at, 0.0) if dtype == torch.float64 else 5.0
    assert torch.equal(run(below, "ignore"), torch.tensor([[0.6, 0.8]], dtype=dtype))
    clipped = run(5.0, "clip")  # coefficient 5 / (5 + eps)
    assert (clipped < whole).all() and (clipped > whole - 1e-5).all()


@pytest.mark.parametrize("runner", ["func", "ghost"])
def test_zero_and_infinite_thresholds(runner):
    model, x, y, w = make("mlp")
    for mode in ("clip", "ignore"):
        model.zero_grad(set_to_none=True)
        got, _ = RUNNERS[runner](model, x, y, w, 0.0, mode)
        assert all(torch.equal(g, torch.zeros_like(g)) for g in got)
    weighted_ce(model(x), y, w).sum().backward()
    full = [p.grad.clone() for p in model.parameters()]
    for mode in ("clip", "ignore"):
        model.zero_grad(set_to_none=True)
        got, _ = RUNNERS[runner](model, x, y, w, math.inf, mode)
        assert_grads_close(got, full, **TOL64)


# ------------------------------------------------------- accumulation, noise, mean


@pytest.mark.parametrize("runner", ["func", "ghost"])
def test_adds_to_existing_grad_and_mean(runner):
    model, x, y, w = make("mlp")
    c = thresholds(model, x, y, w, per_layer=False)
    want = naive(model, x, y, w, c, "clip")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    got, _ = RUNNERS[runner](model, x, y, w, c, "clip", reduction="mean")
    assert_grads_close(got, [1 + r / x.shape[0] for r in want], **TOL64)


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per_layer"])
def test_noise_is_sigma_c_times_seeded_normal_and_same_on_both_paths(per_layer):
    model, x, y, w = make("mlp")
    c = thresholds(model, x, y, w, per_layer)
    sensitivity = math.hypot(*c) if per_layer else c
    want = naive(model, x, y, w, c, "clip")
    gen = torch.Generator().manual_seed(7)
    noise = [torch.randn(r.shape, generator=gen, dtype=r.dtype) for r in want]
    results = {}
    for runner in ("func", "ghost"):
        model.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(7)
        got, _ = RUNNERS[runner](
            model, x, y, w, c, "clip", noise_multiplier=0.5, generator=gen, reduction="mean"
        )
        results[runner] = [g.clone() for g in got]
        expect = [
            (r + 0.5 * sensitivity * n) / x.shape[0] for r, n in zip(want, noise, strict=True)
        ]
        assert_grads_close(got, expect, **TOL64)
    assert_grads_close(results["func"], results["ghost"], **TOL64)


# ------------------------------------------------------------------------ no sync


@pytest.mark.parametrize("mode", ["clip", "ignore"])
@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per_layer"])
@pytest.mark.parametrize("kind", ["seq", "tokens", "norms"])
def test_no_host_read(kind, mode, per_layer):
    model, x, y, w = make(kind)
    c = thresholds(model, x, y, w, per_layer)
    params = list(model.parameters())
    grads = per_sample_grads(model, weighted_ce, x, y, w)
    ghost = GhostClipping(model)
    gen = torch.Generator().manual_seed(0)
    with HostReadCounter() as reads:
        fn = clip_per_sample_ if mode == "clip" else ignore_per_sample_
        fn(params, grads, c, noise_multiplier=1.0, generator=gen, reduction="mean")
        with ghost:
            losses = weighted_ce(model(x), y, w)
            step = ghost.clip_ if mode == "clip" else ghost.ignore_
            step(losses, c, noise_multiplier=1.0, generator=gen, reduction="mean")
    assert reads.count == 0


# -------------------------------------------------------------- ghost bookkeeping


def test_forward_without_grad_is_not_recorded_and_records_are_dropped():
    model, x, y, w = make("mlp")
    with GhostClipping(model) as ghost:
        with torch.no_grad():
            model(x)
        with pytest.raises(RuntimeError, match="no forward pass"):
            ghost.clip_(torch.ones(8, requires_grad=True), 1.0)
        ghost.clip_(weighted_ce(model(x), y, w), 1.0)
        with pytest.raises(RuntimeError, match="no forward pass"):
            ghost.clip_(torch.ones(8, requires_grad=True), 1.0)


def test_unused_layer_keeps_no_grad_and_frozen_unsupported_layers_are_fine():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(4, 3)
            self.unused = nn.Linear(4, 3)
            self.norm = nn.GroupNorm(1, 3)
            self.norm.requires_grad_(False)

        def forward(self, x):
            return self.norm(self.used(x))

    model = Model().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    w = torch.ones(5, dtype=torch.float64)
    want = naive(model, x, y, w, 0.3, "clip")
    got, _ = run_ghost(model, x, y, w, 0.3, "clip")
    assert model.unused.weight.grad is None and model.unused.bias.grad is None
    assert_grads_close(got[:2], want[:2], **TOL64)


def test_in_place_change_of_a_layer_output_is_refused():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(inplace=True), nn.Linear(3, 2))
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    with GhostClipping(model) as ghost, pytest.raises(RuntimeError, match="in place"):
        ghost.clip_(F.cross_entropy(model(x), y, reduction="none"), 1.0)


def test_parameters_follow_model_order_and_one_token_embedding():
    model, x, y, w = make("tokens")
    ghost = GhostClipping(model)
    assert [id(p) for p in ghost.parameters] == [id(p) for p in model.parameters()]
    x = x[:, 1:2]  # T = 1
    c = thresholds(model, x, y, w, per_layer=True)
    want = naive(model, x, y, w, c, "clip")
    got, _ = run_ghost(model, x, y, w, c, "clip")
    assert_grads_close(got, want, **TOL64)


def test_noise_multiplier_zero_with_infinite_threshold_is_plain_sum():
    model, x, y, w = make("mlp")
    got, _ = run_ghost(model, x, y, w, [math.inf] * 6, "clip", noise_multiplier=0.0)
    model.zero_grad(set_to_none=True)
    weighted_ce(model(x), y, w).sum().backward()
    assert_grads_close(got, [p.grad for p in model.parameters()], **TOL64)


def test_autocast_bfloat16_matches_autograd_under_autocast():
    """Under autocast the layer input is float32 and its output gradient bfloat16."""
    model, x, y, w = make("mlp", dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    weighted_ce(out.float(), y, w).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with GhostClipping(model) as ghost:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        ghost.clip_(weighted_ce(out.float(), y, w), math.inf)
    for p, r in zip(model.parameters(), want, strict=True):
        assert p.grad.dtype == torch.float32
        assert torch.linalg.vector_norm(p.grad - r) < 1e-2 * torch.linalg.vector_norm(r)


def test_clip_outside_the_block_raises():
    model, x, y, w = make("mlp")
    ghost = GhostClipping(model)
    with pytest.raises(RuntimeError, match="inside"):
        ghost.clip_(weighted_ce(model(x), y, w), 1.0)
    with ghost, pytest.raises(RuntimeError, match="already active"):
        ghost.__enter__()
    assert not model.head._forward_hooks


# ---------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("module", "name"),
    [
        (nn.Sequential(nn.Linear(3, 3), nn.GroupNorm(1, 3)), "'1' (GroupNorm)"),
        (nn.Sequential(nn.Conv1d(2, 2, 1)), "'0' (Conv1d)"),
    ],
)
def test_unsupported_module_is_named(module, name):
    with pytest.raises(ValueError, match=name.replace("(", r"\(").replace(")", r"\)")):
        GhostClipping(module)


def test_shared_parameter_and_embedding_options_are_refused():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    with pytest.raises(ValueError, match="shared"):
        GhostClipping(nn.Sequential(a, b))
    with pytest.raises(ValueError, match="scale_grad_by_freq"):
        GhostClipping(nn.Embedding(4, 2, scale_grad_by_freq=True))
    with pytest.raises(ValueError, match="no trainable"):
        GhostClipping(nn.ReLU())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_norm": -1.0}, "max_norm"),
        ({"max_norm": math.nan}, "max_norm"),
        ({"max_norm": "1"}, "max_norm"),
        ({"max_norm": torch.tensor(1.0)}, "max_norm"),
        ({"max_norm": [1.0, 2.0]}, "max_norm"),
        ({"max_norm": [1.0] * 5 + [-1.0]}, r"max_norm\[5\]"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"noise_multiplier": math.inf}, "noise_multiplier"),
        ({"noise_multiplier": True}, "noise_multiplier"),
        ({"noise_multiplier": 1.0, "max_norm": math.inf}, "finite max_norm"),
        ({"generator": 3}, "generator"),
        ({"reduction": "none"}, "reduction"),
    ],
)
def test_argument_errors(kwargs, match):
    model, x, y, w = make("mlp")
    args = {"max_norm": 1.0, **kwargs}
    params = list(model.parameters())
    grads = per_sample_grads(model, weighted_ce, x, y, w)
    with pytest.raises(ValueError, match=match):
        clip_per_sample_(params, grads, **args)
    with pytest.raises(ValueError, match=match):
        ignore_per_sample_(params, grads, **args)
    with GhostClipping(model) as ghost, pytest.raises(ValueError, match=match):
        ghost.clip_(weighted_ce(model(x), y, w), **args)
    assert all(p.grad is None for p in params)


def test_shape_errors():
    model, x, y, w = make("mlp")
    params = list(model.parameters())
    grads = per_sample_grads(model, weighted_ce, x, y, w)
    with pytest.raises(ValueError, match="pair up"):
        clip_per_sample_(params[:-1], grads, 1.0)
    with pytest.raises(ValueError, match=r"grad_samples\[0\] must have shape"):
        clip_per_sample_(params, [grads[0][0], *grads[1:]], 1.0)
    with pytest.raises(ValueError, match="parameters must contain only tensors"):
        clip_per_sample_([1.0], grads[:1], 1.0)
    with pytest.raises(ValueError, match="batch size"):
        per_sample_grads(model, weighted_ce, x, y[:3], w)
    with GhostClipping(model) as ghost:
        loss = weighted_ce(model(x), y, w)
        with pytest.raises(ValueError, match="loss_per_sample must be a 1-D"):
            ghost.clip_(loss.mean(), 1.0)
        with pytest.raises(ValueError, match="batch dimension"):
            ghost.clip_(loss[:4], 1.0)


# ------------------------------------------------- norms whose Gram form rounds below 0


def nearly_cancelling(batch=12, dim=4, seed=0):
    """Rows t and t+1 of each sample cancel but for a relative ``delta`` (0 to 1e-3).

    The per-sample gradient is then ``delta`` times one row's, and the Gram form
    ``sum_{t,s} (a_t . a_s)(b_t . b_s)`` subtracts terms of size 1 to get ``delta^2``.
    """
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(batch, 1, dim, generator=gen)
    u = torch.randn(batch, 1, dim, generator=gen)
    delta = torch.logspace(-7, -3, batch).view(batch, 1, 1)
    delta[0] = 0.5  # one sample well above the threshold
    return torch.cat([v, v], 1), torch.cat([u, -(1 + delta) * u], 1)


def dot_loss(out, t):
    return (out * t).sum((1, 2))


def float64_loop(layer, inputs, t, max_norm, mode):
    """A float64 copy of the layer, one backward per sample, clip or keep, then the sum."""
    layer = copy.deepcopy(layer).double()
    inputs = inputs if not inputs.is_floating_point() else inputs.double()
    total, norms = torch.zeros_like(layer.weight), []
    for i in range(inputs.shape[0]):
        layer.weight.grad = None
        dot_loss(layer(inputs[i : i + 1]), t[i : i + 1].double()).sum().backward()
        norm = torch.linalg.vector_norm(layer.weight.grad)
        coef = torch.clamp(max_norm / (norm + EPS), max=1.0)
        keep = max_norm / (norm + EPS) >= 1
        total += layer.weight.grad * (coef if mode == "clip" else keep)
        norms.append(norm)
    return total, torch.stack(norms)


@pytest.mark.parametrize("mode", ["clip", "ignore"])
@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_nearly_cancelling_rows_give_a_finite_norm_not_nan(kind, mode):
    x, t = nearly_cancelling()
    if kind == "linear":  # T = 2, T^2 <= d_in * d_out: the Gram path
        torch.manual_seed(0)
        layer = nn.Linear(4, 4, bias=False)
        inputs, a = x, x
    else:  # the same id twice in a sample: its two rows of the weight gradient add up
        layer = nn.Embedding(3, 4)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(3, 4))
        inputs = torch.ones(x.shape[0], 2, dtype=torch.long)
        a = torch.ones(x.shape[0], 2, 1)  # the ids' Gram matrix: all the same
    # the Gram form sum_{t,s} (a_t . a_s)(b_t . b_s), as the ghost-norm papers write it
    raw = (a @ a.transpose(1, 2) * (t @ t.transpose(1, 2))).sum((1, 2))
    assert (raw < 0).any(), "the construction must round below zero in float32"
    want, want_norms = float64_loop(layer, inputs, t, 1.0, mode)
    with GhostClipping(layer) as ghost:
        step = ghost.clip_ if mode == "clip" else ghost.ignore_
        norms = step(dot_loss(layer(inputs), t), 1.0)
    assert torch.isfinite(norms).all() and (norms >= 0).all()
    # float32 rounding of the Gram sum (the larger error): eps32 times the terms' sizes
    bound = 16 * torch.finfo(torch.float32).eps * (a @ a.transpose(1, 2)).abs().double()
    bound = (bound * (t @ t.transpose(1, 2)).abs().double()).sum((1, 2))
    assert ((norms.double().square() - want_norms.square()).abs() <= bound).all()
    assert torch.isfinite(layer.weight.grad).all()
    # the tiny samples are kept (ignore) and whole (clip): their 1e-4-sized share counts
    torch.testing.assert_close(layer.weight.grad, want.float(), atol=3e-6, rtol=0)


# ------------------------------------------------------------------ module contract


def batch_of(d_in, batch=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d_in, generator=gen, dtype=dtype)
    y = torch.randint(0, 3, (batch,), generator=gen)
    return x, y, 1.0 + torch.rand(batch, generator=gen, dtype=dtype)


class DoubledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(2 * x)


class KeepsForward(nn.Linear):
    """A subclass that keeps nn.Linear's forward (as torch's own subclasses do)."""


def test_subclass_that_replaces_forward_is_refused_by_name():
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), DoubledLinear(4, 3))
    with pytest.raises(ValueError, match=r"'2' \(DoubledLinear\) replaces the forward"):
        GhostClipping(model)
    layer = nn.Linear(6, 3)
    layer.forward = lambda x: nn.Linear.forward(layer, 2 * x)
    with pytest.raises(ValueError, match=r"'<root>' \(Linear\) replaces the forward"):
        GhostClipping(layer)


@pytest.mark.parametrize("mode", ["clip", "ignore"])
def test_subclass_that_keeps_forward_matches_the_loop(mode):
    torch.manual_seed(0)
    model = nn.Sequential(KeepsForward(6, 8), nn.Tanh(), KeepsForward(8, 3)).double()
    x, y, w = batch_of(6)
    c = thresholds(model, x, y, w, per_layer=False)
    want = naive(model, x, y, w, c, mode)
    got, _ = run_ghost(model, x, y, w, c, mode)
    assert_grads_close(got, want, **TOL64)


class TiedHead(nn.Module):
    """The embedding's weight is also the output layer, by F.linear (GPT-2's tying)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, ids):
        return F.linear(torch.tanh(self.proj(self.emb(ids))).mean(1), self.emb.weight)[:, :3]


class Gate(nn.Module):
    """No parameter of its own: it reads another module's weight."""

    def __init__(self, source):
        super().__init__()
        self.source = [source]  # a list, so not a submodule

    def forward(self, h):
        return h * self.source[0].weight.sum(0)


class GatedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(4, 4)
        self.gate = Gate(self.b)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.gate(torch.tanh(self.b(self.a(x)))))


def outside_use_cases():
    """(name, model, batch, loss of a batch, the parameter the error must name)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 7, (8, 5), generator=torch.Generator().manual_seed(0))
    x, y, w = batch_of(6, dtype=torch.float32)
    tied = TiedHead()
    gated = GatedMLP()
    penalised = MLP()
    cast = MLP()

    def cast_twice(inputs):  # autocast casts head.weight once, for both uses
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = cast.net(inputs)
            out = cast.head(h) + F.linear(h, cast.head.weight)
        return weighted_ce(out.float(), y, w)

    return [
        ("tied", tied, lambda: weighted_ce(tied(ids), y, w), "emb.weight"),
        ("read", gated, lambda: weighted_ce(gated(x), y, w), "b.weight"),
        (
            "penalty",
            penalised,
            lambda: weighted_ce(penalised(x), y, w) + penalised.head.weight.square().sum(),
            "head.weight",
        ),
        ("autocast", cast, lambda: cast_twice(x), "'head'"),
    ]


@pytest.mark.parametrize("case", range(4), ids=["tied", "read", "penalty", "autocast"])
def test_parameter_used_outside_its_module_is_refused_before_any_change(case):
    _, model, loss, name = outside_use_cases()[case]
    refused = pytest.raises(ValueError, match=f"{name}.*outside that module's forward")
    with GhostClipping(model) as ghost, refused:
        ghost.clip_(loss(), 1.0)
    assert all(p.grad is None for p in model.parameters())


def test_layer_called_twice_under_autocast_is_not_an_outside_use():
    """Autocast casts a weight once for all of a layer's calls: that is one module's."""
    model, x, y, w = make("seq", dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    weighted_ce(out.float(), y, w).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with GhostClipping(model) as ghost:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        ghost.clip_(weighted_ce(out.float(), y, w), math.inf)
    for p, r in zip(model.parameters(), want, strict=True):
        assert torch.linalg.vector_norm(p.grad - r) < 1e-2 * torch.linalg.vector_norm(r)


class Checkpointed(nn.Module):
    """Embedding -> checkpoint(Linear, tanh, LayerNorm) -> RMSNorm (keyword call) -> head.

    ``use_reentrant=None`` runs the block without checkpointing (torch.func, the norms'
    reference, cannot trace a checkpoint).
    """

    def __init__(self, use_reentrant):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.LayerNorm(4))
        self.rms = nn.RMSNorm(4)
        self.head = nn.Linear(4, 3)
        self.use_reentrant = use_reentrant

    def forward(self, ids):
        h = self.emb(ids)
        if self.use_reentrant is None:
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.use_reentrant)
        return self.head(self.rms(x=h).mean(1))


@pytest.mark.parametrize("mode", ["clip", "ignore"])
def test_non_reentrant_checkpoint_matches_the_loop(mode):
    torch.manual_seed(0)
    model = Checkpointed(use_reentrant=None).double()
    _, ids, y, w = make("norms")
    c = thresholds(model, ids, y, w, per_layer=False)
    ref = torch.linalg.vector_norm(sample_norms(model, ids, y, w), dim=1)
    model.use_reentrant = False
    want = naive(model, ids, y, w, c, mode)  # its backward recomputes the block too
    got, norms = run_ghost(model, ids, y, w, c, mode)
    assert_grads_close(got, want, **TOL64)
    torch.testing.assert_close(norms, ref, **TOL64)


def test_reentrant_checkpoint_is_refused_before_any_change():
    torch.manual_seed(0)
    model = Checkpointed(use_reentrant=True).double()
    _, ids, y, w = make("norms")
    with GhostClipping(model) as ghost, pytest.raises(ValueError, match="use_reentrant=False"):
        ghost.clip_(weighted_ce(model(ids), y, w), 1.0)
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------ the rule registry


class Scale(nn.Module):
    """``x * weight``, elementwise: a layer type GhostClipping has no rule for."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        return x * self.weight


def test_a_new_layer_type_is_one_registered_function(monkeypatch):
    monkeypatch.setattr(per_sample, "_RULES", dict(per_sample._RULES))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), Scale(4), nn.Tanh(), nn.Linear(4, 3)).double()
    with pytest.raises(ValueError, match=r"'1' \(Scale\) has trainable parameters"):
        GhostClipping(model)

    @per_sample._register(Scale, params=("weight",), min_dims=lambda m: 2)
    def scale_rule(module, calls, names, batch):
        d = module.weight.shape[0]
        grads = sum((x * b).reshape(batch, -1, d).sum(1) for x, b in calls)
        return per_sample._formed([grads])

    x, y, w = batch_of(6)
    c = thresholds(model, x, y, w, per_layer=True)
    want = naive(model, x, y, w, c, "clip")
    got, _ = run_ghost(model, x, y, w, c, "clip")
    assert_grads_close(got, want, **TOL64)


# ------------------------------------------------------------------------ docstrings


PUBLIC = [
    per_sample_norms,
    clip_per_sample_,
    ignore_per_sample_,
    per_sample_grads,
    GhostClipping,
    GhostClipping.clip_,
    GhostClipping.ignore_,
]


def test_source_has_no_control_characters_or_broken_math():
    source = inspect.getsource(per_sample)
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", source)
    assert not re.search(r":math:`\s*\n", source)  # where "\nabla" had become a newline


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda o: o.__qualname__)
def test_public_docstrings_are_torch_style(obj):
    doc = inspect.getdoc(obj)
    assert "Args:" in doc and ".. note::" in doc and "host read" in doc
    if obj is not GhostClipping:
        assert "Returns:" in doc
    block = doc.split("Args:\n", 1)[1].split("\n\n", 1)[0]
    entries = re.split(r"\n(?=    \S)", block)  # an entry and its indented continuation
    names = [re.match(r"    (\w+) \((.+?)\): ", e) for e in entries]
    assert all(names), entries  # every entry is "name (type): text"
    target = obj.__init__ if isinstance(obj, type) else obj
    signature = inspect.signature(target).parameters
    assert [m.group(1) for m in names] == [n for n in signature if n != "self"]
    for m, entry in zip(names, entries, strict=True):
        if signature[m.group(1)].default is not inspect.Parameter.empty:
            assert "Default:" in entry, entry
