"""Gradient accumulation, both meanings, against float64 references.

(a) Clip or ignore the accumulated gradient once per step: with micro-batch losses
    scaled by 1/k it is the full batch's gradient, clipped.
(b) Drop a bad micro-batch (:class:`gradlab.MicroBatchAccumulator`): the result is the
    mean gradient of the kept micro-batches alone, computed here one micro-batch at a
    time in float64.
"""

from __future__ import annotations

import math

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


def test_accumulator_checks_its_arguments():
    model = _model()
    with pytest.raises(ValueError, match="max_norm"):
        gradlab.MicroBatchAccumulator(model.parameters(), -1.0)
    with pytest.raises(ValueError, match="norm_type"):
        gradlab.MicroBatchAccumulator(model.parameters(), 1.0, norm_type=0)
