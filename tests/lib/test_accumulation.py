"""Gradient accumulation, both meanings, against float64 references.

(a) Clip or ignore the accumulated gradient once per step: with micro-batch losses
    scaled by 1/k it is the full batch's gradient, clipped.
(b) Drop a bad micro-batch (:class:`gradlab.MicroBatchAccumulator`): the result is the
    mean gradient of the kept micro-batches alone, computed here one micro-batch at a
    time in float64, and, in each dtype, the correctly rounded mean of torch's own
    micro-batch gradients.
(c) With a GradScaler: the scale moves exactly as torch's GradScaler moves it without
    the accumulator, max_norm meets unscaled gradients, nothing is unscaled twice, and
    an fp16 run started at a scale of 2^40 (CPU autocast, real float16 overflow) backs
    off and learns.
(d) None kept: ``step_if_(optimizer, kept > 0, sync=False)`` leaves the parameters and
    the optimizer state as a run that never saw the step.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import textwrap

import pytest
import torch
from torch import nn

import gradlab
from gradlab.sync import HostReadCounter

K = 4


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


def _micro_batches(bad: dict[int, str] | None = None):
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(K):
        x = torch.randn(3, 5, generator=gen)
        y = torch.randn(3, 2, generator=gen)
        kind = (bad or {}).get(i)
        if kind == "nan":
            x[0, 0] = math.nan
        elif kind == "inf":
            y[1, 1] = math.inf
        elif kind == "spike":
            y = y * 1e4
        out.append((x, y))
    return out


def _grads_of(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _reference_grad(batches, keep):
    """float64: the mean over the kept micro-batches of each one's own gradient."""
    model = _model(torch.float64)
    total = None
    for (x, y), k in zip(batches, keep, strict=True):
        if not k:
            continue
        model.zero_grad()
        nn.functional.mse_loss(model(x.double()), y.double()).backward()
        g = _grads_of(model)
        total = g if total is None else [a + b for a, b in zip(total, g, strict=True)]
    if total is None:
        return [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    return [t / sum(keep) for t in total]


def _micro_norms(batches):
    norms = []
    for x, y in batches:
        model = _model(torch.float64)
        (nn.functional.mse_loss(model(x.double()), y.double()) / K).backward()
        norms.append(float(gradlab.get_total_norm([p.grad for p in model.parameters()])))
    return norms


# --------------------------------------------------- (a) once per optimizer step


@pytest.mark.parametrize("how", ["clip", "ignore_keep", "ignore_drop"])
def test_accumulated_gradient_is_the_full_batch_gradient(how):
    batches = _micro_batches()
    model = _model()
    for x, y in batches:
        (nn.functional.mse_loss(model(x), y) / K).backward()
    # The full batch at once, float64.
    full = _model(torch.float64)
    x = torch.cat([b[0] for b in batches]).double()
    y = torch.cat([b[1] for b in batches]).double()
    nn.functional.mse_loss(full(x), y).backward()
    ref = [p.grad for p in full.parameters()]
    ref_norm = float(gradlab.get_total_norm(ref))
    if how == "clip":
        norm = gradlab.clip_grad_norm_(model.parameters(), 0.5 * ref_norm)
        ref = [g * (0.5 * ref_norm / (ref_norm + 1e-6)) for g in ref]
    else:
        factor = 1.1 if how == "ignore_keep" else 0.9
        norm = gradlab.grad_ignore_norm_(model.parameters(), factor * ref_norm)
        if how == "ignore_drop":
            ref = [torch.zeros_like(g) for g in ref]
    assert float(norm) == pytest.approx(ref_norm, rel=1e-5)
    for p, r in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad.double(), r, rtol=1e-5, atol=1e-7)


def test_one_bad_micro_batch_loses_the_whole_accumulated_step():
    model = _model()
    for x, y in _micro_batches({2: "nan"}):
        (nn.functional.mse_loss(model(x), y) / K).backward()
    norm = gradlab.grad_ignore_norm_(model.parameters(), 1e6)
    assert math.isnan(norm)
    assert all(bool((p.grad == 0).all()) for p in model.parameters())


# ------------------------------------------------------ (b) per micro-batch ignore


def _accumulate(batches, max_norm, norm_type=2.0):
    model = _model()
    acc = gradlab.MicroBatchAccumulator(model.parameters(), max_norm, norm_type)
    norms = []
    for x, y in batches:
        (nn.functional.mse_loss(model(x), y) / K).backward()
        norms.append(acc.add_())
        assert all(p.grad is None for p in model.parameters())
    kept = acc.finish_()
    return model, kept, norms


@pytest.mark.parametrize(
    "bad",
    [{}, {1: "spike"}, {0: "nan"}, {3: "inf"}, {0: "nan", 2: "spike"}],
    ids=["none", "spike", "nan-first", "inf-last", "nan-and-spike"],
)
def test_dropping_bad_micro_batches_averages_the_kept_ones(bad):
    batches = _micro_batches(bad)
    model, kept, norms = _accumulate(batches, max_norm=5.0)
    keep = [i not in bad for i in range(K)]
    assert int(kept) == sum(keep)
    micro = _micro_norms(batches)
    for i in range(K):
        if keep[i]:
            assert micro[i] < 5.0
            assert float(norms[i]) == pytest.approx(micro[i], rel=1e-5)
        else:
            assert not micro[i] < 5.0
    ref = _reference_grad(batches, keep)
    for p, r in zip(model.parameters(), ref, strict=True):
        assert bool(torch.isfinite(p.grad).all())
        torch.testing.assert_close(p.grad.double(), r, rtol=1e-5, atol=1e-7)


def test_all_micro_batches_dropped_gives_zero_not_nan():
    model, kept, _ = _accumulate(_micro_batches({0: "nan", 1: "inf", 2: "spike", 3: "nan"}), 5.0)
    assert int(kept) == 0
    for p in model.parameters():
        assert bool((p.grad == 0).all()) and not bool(torch.signbit(p.grad).any())


def test_without_rescaling_the_step_would_shrink():
    """The k/kept factor matters: the plain sum of the kept 1/k-scaled gradients is short."""
    batches = _micro_batches({1: "spike"})
    model, _, _ = _accumulate(batches, 5.0)
    ref = _reference_grad(batches, [True, False, True, True])
    plain = [r * 3 / K for r in ref]  # what accumulating without the rescale gives
    got = torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])
    assert not torch.allclose(got, torch.cat([g.reshape(-1) for g in plain]), rtol=1e-3)
    torch.testing.assert_close(got, torch.cat([g.reshape(-1) for g in ref]), rtol=1e-5, atol=1e-7)


def test_accumulator_reuses_itself_across_steps_and_never_reads_the_host():
    model = _model()
    acc = gradlab.MicroBatchAccumulator(model.parameters(), 5.0)
    for step_bad in ({}, {2: "nan"}):
        batches = _micro_batches(step_bad)
        with HostReadCounter() as reads:
            for x, y in batches:
                (nn.functional.mse_loss(model(x), y) / K).backward()
                acc.add_()
            kept = acc.finish_()
        assert reads.operations == []
        assert int(kept) == K - len(step_bad)
        ref = _reference_grad(batches, [i not in step_bad for i in range(K)])
        for p, r in zip(model.parameters(), ref, strict=True):
            torch.testing.assert_close(p.grad.double(), r, rtol=1e-5, atol=1e-7)
        model.zero_grad(set_to_none=True)


def _loss(model, x, y):
    return nn.functional.mse_loss(model(x), y) / K


def _grads_each(batches, dtype):
    """Each micro-batch's own gradient of its loss / K in ``dtype``, by torch's autograd."""
    out = []
    for x, y in batches:
        model = _model(dtype)
        _loss(model, x.to(dtype), y.to(dtype)).backward()
        out.append(_grads_of(model))
    return out


ALL_BAD = {0: "nan", 1: "inf", 2: "spike", 3: "nan"}


# ------------------------------------------------------------------- (b) precision


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_finish_rescales_in_the_gradients_own_precision(dtype):
    """The buffer sums in the gradients' dtype, as autograd accumulates .grad; the
    result is that sum times K / kept, correctly rounded to the dtype: for float64 it
    is float64 maths (never a float32 factor), and a NaN first micro-batch is gone."""
    bad = {0: "nan"}
    batches = _micro_batches(bad)
    keep = [i not in bad for i in range(K)]
    model = _model(dtype)
    acc = gradlab.MicroBatchAccumulator(model.parameters(), 5.0)
    for x, y in batches:
        _loss(model, x.to(dtype), y.to(dtype)).backward()
        acc.add_()
    kept = acc.finish_()
    assert int(kept) == sum(keep) == 3
    each = [g for g, k in zip(_grads_each(batches, dtype), keep, strict=True) if k]
    sums = [functools.reduce(torch.add, parts) for parts in zip(*each, strict=True)]
    # float64 holds s * K exactly (K = 4), so one rounding to float64 and one to the
    # dtype: the correctly rounded K / kept * s for every dtype (53 >= 2 * 24 + 2),
    # with kept = 3 so that K / kept is not a power of two.
    exact = [(s.double() * K / 3).to(dtype) for s in sums]
    tol = {
        torch.float64: {"rtol": 1e-12, "atol": 1e-14},
        torch.float32: {"rtol": 1e-5, "atol": 1e-7},
        torch.float16: {"rtol": 2e-2, "atol": 2e-3},
        torch.bfloat16: {"rtol": 5e-2, "atol": 2e-2},
    }[dtype]
    for p, e, r in zip(model.parameters(), exact, _reference_grad(batches, keep), strict=True):
        assert p.grad.dtype == dtype and bool(torch.isfinite(p.grad).all())
        assert torch.equal(p.grad, e), (p.grad - e).abs().max()
        torch.testing.assert_close(p.grad.double(), r, **tol)


# ------------------------------------------------------------ (c) GradScaler


def _scaled_accumulation(model, batches, scaler, max_norm, autocast=True):
    acc = gradlab.MicroBatchAccumulator(model.parameters(), max_norm, scaler=scaler)
    norms = []
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            loss = _loss(model, x, y)
        scaler.scale(loss).backward()
        norms.append(acc.add_())
    return acc, norms


def test_scaler_max_norm_meets_the_unscaled_gradient():
    """At a scale of 2^10 the scaled norms are 1024 times the unscaled ones: a max_norm
    between the two keeps the good micro-batches (today's code kept none)."""
    batches = _micro_batches({1: "spike"})
    micro = _micro_norms(batches)
    max_norm = 2 * max(micro[i] for i in (0, 2, 3))
    assert max_norm < min(micro[i] for i in (0, 2, 3)) * 2**10 and micro[1] > max_norm
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc, norms = _scaled_accumulation(model, batches, scaler, max_norm, autocast=False)
    kept = acc.finish_(torch.optim.SGD(model.parameters(), lr=0.1))
    assert int(kept) == 3
    for n, m in zip(norms, micro, strict=True):
        assert float(n) == pytest.approx(m, rel=1e-5)
    ref = _reference_grad(batches, [True, False, True, True])
    for p, r in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad.double(), r, rtol=1e-5, atol=1e-7)


def test_scaler_moves_exactly_as_gradscaler_alone():
    """lr 0, so both runs see the same gradients: from 2^40 under fp16 autocast the
    scale backs off, grows every 3 clean steps, backs off on a NaN or inf micro-batch,
    and the accumulator's scaler follows torch's, state for state."""
    plain_model, model = _model(), _model()
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    plain = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=3)
    acc = gradlab.MicroBatchAccumulator(model.parameters(), 5.0, scaler=scaler)
    bad_at = {30: {2: "nan"}, 31: {0: "inf"}, 36: {1: "spike"}, 40: ALL_BAD}
    plain_trace, trace = [], []
    for step in range(45):
        for x, y in _micro_batches(bad_at.get(step)):
            with torch.autocast("cpu", dtype=torch.float16):
                plain_loss, loss = _loss(plain_model, x, y), _loss(model, x, y)
            plain.scale(plain_loss).backward()
            scaler.scale(loss).backward()
            acc.add_()
        plain.step(plain_opt)
        plain.update()
        plain_opt.zero_grad()
        kept = acc.finish_(opt)
        gradlab.step_if_(opt, kept > 0, sync=False)
        scaler.update()
        opt.zero_grad()
        plain_trace.append(plain.state_dict())
        trace.append(scaler.state_dict())
    assert trace == plain_trace
    scales = [s["scale"] for s in plain_trace]
    pairs = list(itertools.pairwise(scales))
    assert any(b > a for a, b in pairs) and any(b < a for a, b in pairs[25:])
    assert scales[30] == scales[29] / 2 and scales[31] == scales[30] / 2


def test_scaler_fp16_run_from_2_pow_40_recovers_and_learns():
    """The N14 run: every micro-batch overflows at 2^40. Each of those steps is skipped
    exactly (weight decay, momentum: nothing moves), the scale backs off, and then the
    run learns. Today's code kept 0 of 4 at every step and stayed at 2^40."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    start = copy.deepcopy(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(K, 3, 5, generator=gen)
    y_all = x_all @ torch.randn(5, 2, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)

    def full_loss():
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(x_all.flatten(0, 1)), y_all.flatten(0, 1)))

    first = full_loss()
    kepts = []
    for _ in range(60):
        acc, _ = _scaled_accumulation(model, zip(x_all, y_all, strict=True), scaler, 100.0)
        kept = acc.finish_(opt)
        gradlab.step_if_(opt, kept > 0, sync=False)
        scaler.update()
        opt.zero_grad()
        kepts.append(int(kept))
        if kepts[-1] == 0:
            assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())
            assert opt.state_dict()["state"] == {}
    assert kepts[0] == 0 and kepts[-10:] == [K] * 10
    assert scaler.get_scale() < 2.0**20
    assert full_loss() < 0.1 * first


@pytest.mark.parametrize("how", ["step_if_", "scaler.step"])
def test_scaler_overflow_is_the_optimizers_found_inf(how):
    """One micro-batch NaN (the first, which becomes the buffer): GradScaler's found_inf
    for the optimizer says so, so update() backs off as plain GradScaler does;
    scaler.step skips the step as GradScaler always does, step_if_ steps on the rest."""
    batches = _micro_batches({0: "nan"})
    plain_model, model = _model(), _model()
    plain = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for x, y in batches:
        plain.scale(_loss(plain_model, x, y)).backward()
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    plain.step(plain_opt)
    plain.update()

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc, _ = _scaled_accumulation(model, batches, scaler, 5.0, autocast=False)
    kept = acc.finish_(opt)
    assert int(kept) == 3
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    assert float(sum(found.values())) == 1.0
    for p in model.parameters():
        assert bool(torch.isfinite(p.grad).all())
    before = [p.detach().clone() for p in model.parameters()]
    if how == "step_if_":
        gradlab.step_if_(opt, kept > 0, sync=False)
        ref = _reference_grad(batches, [False, True, True, True])
        for p, b, r in zip(model.parameters(), before, ref, strict=True):
            torch.testing.assert_close(p.double(), b.double() - 0.1 * r, rtol=1e-5, atol=1e-7)
    else:
        scaler.step(opt)
        for p, b, q in zip(model.parameters(), before, plain_model.parameters(), strict=True):
            assert torch.equal(p, b) and torch.equal(p, q)
    scaler.update()
    assert scaler.state_dict() == plain.state_dict()
    assert scaler.get_scale() == 2.0**9


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, fused=kind == "adamw-fused")


@pytest.mark.parametrize("kind", ["sgd", "adamw", "adamw-fused"])
@pytest.mark.parametrize("how", ["step_if_", "scaler.step", "guard"])
def test_scaler_gradients_are_unscaled_once(kind, how):
    """After finish_(optimizer), scaler.step and StepGuard(scaler=) see the gradients as
    unscaled: the step is bit for bit torch's own float32 accumulation and step without
    any scaler (a second unscale would divide by 2^10), and unscale_ refuses."""
    batches = _micro_batches()
    plain_model = _model()
    plain_opt = _optimizer(kind, plain_model.parameters())
    for x, y in batches:
        _loss(plain_model, x, y).backward()
    plain_opt.step()

    model = _model()
    opt = _optimizer(kind, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc, _ = _scaled_accumulation(model, batches, scaler, 5.0, autocast=False)
    kept = acc.finish_(opt)
    for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    if how == "step_if_":
        gradlab.step_if_(opt, kept > 0, sync=False)
    elif how == "scaler.step":
        scaler.step(opt)
    else:
        gradlab.StepGuard(opt, threshold=math.inf, scaler=scaler).step()
    scaler.update()
    assert scaler.get_scale() == 2.0**10
    for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_disabled_scaler_is_no_scaler():
    batches = _micro_batches({2: "spike"})
    model = _model()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    acc, _ = _scaled_accumulation(model, batches, scaler, 5.0, autocast=False)
    assert int(acc.finish_()) == 3
    for p, r in zip(model.parameters(), _reference_grad(batches, [1, 1, 0, 1]), strict=True):
        torch.testing.assert_close(p.grad.double(), r, rtol=1e-5, atol=1e-7)


def test_scaler_misuse_is_refused_before_anything_changes():
    batches = _micro_batches({1: "spike"})
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc = gradlab.MicroBatchAccumulator(model.parameters(), 5.0, scaler=scaler)
    _loss(model, *batches[0]).backward()  # scaler.scale(loss) forgotten
    grads = _grads_of(model)
    with pytest.raises(RuntimeError, match="no scale yet"):
        acc.add_()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    model.zero_grad(set_to_none=True)
    acc, _ = _scaled_accumulation(model, batches, scaler, 5.0, autocast=False)
    extra = nn.Parameter(torch.ones(3))
    extra.grad = torch.ones(3)
    part = torch.optim.SGD(list(model.parameters())[:2], lr=0.1)
    more = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizer"):
        acc.finish_()
    with pytest.raises(TypeError, match="optimizer"):
        acc.finish_("sgd")
    with pytest.raises(ValueError, match="not a parameter of optimizer"):
        acc.finish_(part)
    with pytest.raises(ValueError, match="still scaled"):
        acc.finish_(more)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_"):
        acc.finish_(opt)
    stray = next(model.parameters())
    stray.grad = torch.ones_like(stray)
    with pytest.raises(ValueError, match="add_"):
        acc.finish_(torch.optim.SGD(model.parameters(), lr=0.1))
    stray.grad = None
    assert acc.count == K and int(acc.kept) == 3
    assert int(acc.finish_(torch.optim.SGD(model.parameters(), lr=0.1))) == 3
    for p, r in zip(model.parameters(), _reference_grad(batches, [1, 0, 1, 1]), strict=True):
        torch.testing.assert_close(p.grad.double(), r, rtol=1e-5, atol=1e-7)


def test_scaler_finish_before_update_is_refused():
    """A second accumulation finished before scaler.update(): GradScaler's stage is
    still "stepped", and unscaling into it would mix two steps' found_inf."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc, _ = _scaled_accumulation(model, _micro_batches(), scaler, 5.0, autocast=False)
    acc.finish_(opt)
    scaler.step(opt)
    opt.zero_grad()
    for x, y in _micro_batches():
        scaler.scale(_loss(model, x, y)).backward()
        acc.add_()
    with pytest.raises(RuntimeError, match=r"scaler\.update\(\)"):
        acc.finish_(opt)
    assert acc.count == K


def test_scaler_refuses_float16_gradients_as_gradscaler_does():
    model = _model(torch.float16)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    x, y = _micro_batches()[0]
    scaler.scale(_loss(model, x.half(), y.half())).backward()
    grads = _grads_of(model)
    acc = gradlab.MicroBatchAccumulator(model.parameters(), 5.0, scaler=scaler)
    with pytest.raises(ValueError, match="float16"):
        acc.add_()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    with pytest.raises(ValueError, match="FP16"):  # torch's own refusal
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))


# ---------------------------------------------------------- (d) none kept: skip


def _same_state(a, b):
    """Whether two optimizer state_dicts hold the same state, tensor for tensor."""
    sa, sb = a["state"], b["state"]
    return sa.keys() == sb.keys() and all(
        sa[i].keys() == sb[i].keys()
        and all(torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])) for k in sa[i])
        for i in sa
    )


@pytest.mark.parametrize("kind", ["sgd", "adamw", "adamw-fused"])
def test_none_kept_step_if_skips_exactly(kind):
    """Steps good, none kept, good, through step_if_(optimizer, kept > 0, sync=False):
    the parameters and the whole optimizer state equal, bit for bit, a run of the two
    good steps only."""

    def run(plan):
        model = _model()
        opt = _optimizer(kind, model.parameters())
        acc = gradlab.MicroBatchAccumulator(model.parameters(), 5.0)
        for bad in plan:
            for x, y in _micro_batches(bad):
                _loss(model, x, y).backward()
                acc.add_()
            kept = acc.finish_()
            assert int(kept) == K - len(bad)
            gradlab.step_if_(opt, kept > 0, sync=False)
            opt.zero_grad()
        return model, opt

    model, opt = run([{}, ALL_BAD, {}])
    ref_model, ref_opt = run([{}, {}])
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert _same_state(opt.state_dict(), ref_opt.state_dict())


def test_none_kept_optimizer_step_is_not_a_skip():
    """Why the recipe uses step_if_: optimizer.step() on the zero gradient of a step
    with none kept still moves the parameters through momentum and weight decay."""
    model, ref = _model(), _model()
    opt = _optimizer("sgd", model.parameters())
    ref_opt = _optimizer("sgd", ref.parameters())
    for m, o in ((model, opt), (ref, ref_opt)):
        for x, y in _micro_batches():
            _loss(m, x, y).backward()
        o.step()
        o.zero_grad()
    acc = gradlab.MicroBatchAccumulator(model.parameters(), 5.0)
    for x, y in _micro_batches(ALL_BAD):
        _loss(model, x, y).backward()
        acc.add_()
    assert int(acc.finish_()) == 0
    opt.step()
    assert not all(
        torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )


def _docstring_recipe():
    """The code block of the class docstring's recipe (``The recipe ...::``), dedented."""
    lines = gradlab.MicroBatchAccumulator.__doc__.splitlines()
    start = next(
        i for i, line in enumerate(lines) if "recipe" in line and line.rstrip().endswith("::")
    )
    indent = len(lines[start]) - len(lines[start].lstrip())
    block = []
    for line in lines[start + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        block.append(line)
    return textwrap.dedent("\n".join(block))


def test_the_documented_recipe_steps_on_the_kept_and_skips_exactly():
    """The class docstring's recipe, run as written on the CPU (fp16 autocast and a
    GradScaler): a step with a kept micro-batch is the mean of the kept ones; a step
    with none kept leaves the parameters and the optimizer state untouched."""
    code = compile(_docstring_recipe(), "MicroBatchAccumulator recipe", "exec")
    model = _model()
    optimizer = _optimizer("sgd", model.parameters())

    def run(bad):
        namespace = {
            "torch": torch,
            "gradlab": gradlab,
            "device": torch.device("cpu"),
            "model": model,
            "optimizer": optimizer,
            "loss_fn": nn.functional.mse_loss,
            "micro_batches": _micro_batches(bad),
            "k": K,
        }
        exec(code, namespace)
        return int(namespace["kept"])

    before = [p.detach().clone() for p in model.parameters()]
    assert run({1: "spike"}) == 3
    ref = _reference_grad(_micro_batches({1: "spike"}), [1, 0, 1, 1])
    for p, b, r in zip(model.parameters(), before, ref, strict=True):
        # the first momentum step: b - lr * (g + weight_decay * b); fp16 autocast
        torch.testing.assert_close(
            p.double(), b.double() - 0.1 * (r + 0.01 * b.double()), rtol=1e-2, atol=1e-3
        )
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(optimizer.state_dict())
    assert run({0: "spike", 1: "spike", 2: "spike", 3: "spike"}) == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    assert state["state"] and _same_state(optimizer.state_dict(), state)


# ------------------------------------------------------------------ host reads, checks


def test_accumulator_with_a_scaler_never_reads_the_host():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc = gradlab.MicroBatchAccumulator(model.parameters(), 5.0, scaler=scaler)
    scaler.scale(torch.ones(()))  # the scale tensor exists before the count starts
    with HostReadCounter() as reads:
        for x, y in _micro_batches({2: "nan"}):
            scaler.scale(_loss(model, x, y)).backward()
            acc.add_()
        kept = acc.finish_(opt)
    assert reads.operations == []
    assert int(kept) == K - 1


def test_accumulator_checks_its_arguments():
    model = _model()
    bad = [
        ({"max_norm": -1.0}, "max_norm"),
        ({"max_norm": math.nan}, "max_norm"),
        ({"max_norm": "1"}, "max_norm"),
        ({"max_norm": torch.ones(2)}, "max_norm"),
        ({"norm_type": 0}, "norm_type"),
        ({"norm_type": "l2"}, "norm_type"),
        ({"norm_type": 10**400}, "norm_type"),
        ({"foreach": "yes"}, "foreach"),
        ({"scaler": object()}, "scaler"),
    ]
    if torch.distributed.is_available():
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        bad.append(({"scaler": ShardedGradScaler("cpu")}, "scaler"))
    for change, name in bad:
        kwargs = {"max_norm": 1.0, **change}
        params = model.parameters()
        with pytest.raises(ValueError, match=name):
            gradlab.MicroBatchAccumulator(params, **kwargs)
        assert next(params) is model[0].weight  # the generator was not read
    with pytest.raises(ValueError, match="parameters"):
        gradlab.MicroBatchAccumulator([model[0].weight, 1.0], 1.0)
    with pytest.raises(ValueError, match="more than once"):
        gradlab.MicroBatchAccumulator([model[0].weight, model[0].weight], 1.0)
    emb = nn.Embedding(4, 2, sparse=True)
    emb(torch.tensor([1])).sum().backward()
    acc = gradlab.MicroBatchAccumulator(emb.parameters(), 1.0)
    with pytest.raises(ValueError, match="sparse"):
        acc.add_()
    assert emb.weight.grad is not None and acc.count == 0
