"""The AGC chapter's check accepts correct answers and rejects the typical wrong ones.

Correct answers are written here independently (with torch.where, with a loop over the
rows, in float64); gradlab's own ``agc_``, wrapped to the exercise's signature, must pass
as well, since the check restates its documented rule. The check's float64 reference is
itself compared with numbers worked out by hand. Wrong answers must be rejected with a
verdict that names the mistake.
"""

from __future__ import annotations

import math

import pytest
import torch
from verdicts import assert_fails, assert_passes, run

from gradlab.adaptive import agc_
from gradlab_book import exercises_agc as ex
from gradlab_book.exercise_kit import identical
from gradlab_book.exercises_agc import check_agc

N = len(ex._cases())


def _dims(t):
    return tuple(range(1, t.dim())) if t.dim() > 1 else None


def _norm(t, dims=None):
    return torch.linalg.vector_norm(t, dim=dims, keepdim=True)


# ------------------------------------------------------------- correct answers


def reference(weight, grad, clip_factor=0.01, eps=1e-3):
    dims = _dims(grad)
    bound = clip_factor * torch.clamp(_norm(weight, dims), min=eps)
    g_norm = _norm(grad, dims)
    over = torch.isfinite(g_norm) & (g_norm > bound)
    return grad * torch.where(over, bound / g_norm, 1.0)


def by_rows(weight, grad, clip_factor=0.01, eps=1e-3):
    """A loop over the units, in float64, with no value read on the host."""
    w = weight.detach().double().reshape(grad.shape[0] if grad.dim() > 1 else 1, -1)
    g = grad.double().reshape(w.shape)
    out = []
    for wi, gi in zip(w, g, strict=True):
        bound = clip_factor * torch.maximum(wi.norm(), torch.tensor(eps, dtype=wi.dtype))
        gn = gi.norm()
        scale = torch.where((gn < math.inf) & (gn > bound), bound / gn, 1.0)
        out.append(gi * scale)
    return torch.stack(out).reshape(grad.shape).to(grad.dtype)


def gradlab_agc(weight, grad, clip_factor=0.01, eps=1e-3):
    p = weight.detach().clone()
    p.grad = grad.clone()
    agc_(p, clip_factor=clip_factor, eps=eps)
    return p.grad


@pytest.mark.parametrize("fn", [reference, by_rows, gradlab_agc])
def test_correct_answers_pass(fn, capsys):
    assert_passes(check_agc, fn, capsys)
    assert N >= 13


def test_the_verdict_is_deterministic(capsys):
    first = run(check_agc, no_floor, capsys)
    assert run(check_agc, no_floor, capsys) == first


def test_reference_matches_hand_computed_values():
    """Case 1: rho = 0.1, row norms W (3, 5, 3), G (0.1, 1, 2): bounds (0.3, 0.5, 0.3)."""
    case = ex._cases()[0]
    got = ex._agc64(case.weight, case.grad, 0.1, 1e-3)
    g = case.grad.double()
    want = torch.stack([g[0], g[1] * 0.5, g[2] * 0.15])
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    # the zero bias: bound rho * eps = 1e-5, the gradient of norm 1 scaled to it
    bias = ex._cases()[3]
    got = ex._agc64(bias.weight, bias.grad, 0.01, 1e-3)
    assert math.isclose(float(got.norm()), 1e-5, rel_tol=1e-7)
    # a NaN and an inf gradient unit are left exactly as they are
    for k in (9, 10):
        case = ex._cases()[k]
        got = ex._agc64(case.weight, case.grad, 0.1, 1e-3)
        assert identical(got[0].float(), case.grad[0])
        assert torch.allclose(got[1], torch.tensor([0.06, 0.08], dtype=torch.float64))


def test_cases_cover_the_brief():
    cases = ex._cases()
    dims = {c.grad.dim() for c in cases}
    assert {1, 2, 4} <= dims
    assert {c.grad.dtype for c in cases} == {torch.float32, torch.float64}
    assert any(c.clip_factor is None for c in cases)
    assert any(torch.isnan(c.grad).any() for c in cases)
    assert any(torch.isinf(c.grad).any() for c in cases)
    assert any((c.weight.reshape(c.weight.shape[0], -1) == 0).all(1).any() for c in cases)


# --------------------------------------------------------------- wrong answers


def no_floor(weight, grad, clip_factor=0.01, eps=1e-3):
    dims = _dims(grad)
    bound = clip_factor * _norm(weight, dims)
    g_norm = _norm(grad, dims)
    over = torch.isfinite(g_norm) & (g_norm > bound)
    return grad * torch.where(over, bound / g_norm, 1.0)


def add_eps(weight, grad, clip_factor=0.01, eps=1e-3):
    dims = _dims(grad)
    bound = clip_factor * (_norm(weight, dims) + eps)
    g_norm = _norm(grad, dims)
    over = torch.isfinite(g_norm) & (g_norm > bound)
    return grad * torch.where(over, bound / g_norm, 1.0)


def whole_tensor(weight, grad, clip_factor=0.01, eps=1e-3):
    bound = clip_factor * torch.clamp(weight.norm(), min=eps)
    g_norm = grad.norm()
    over = torch.isfinite(g_norm) & (g_norm > bound)
    return grad * torch.where(over, bound / g_norm, 1.0)


def columns(weight, grad, clip_factor=0.01, eps=1e-3):
    dims = 0 if grad.dim() > 1 else None
    bound = clip_factor * torch.clamp(_norm(weight, dims), min=eps)
    g_norm = _norm(grad, dims)
    over = torch.isfinite(g_norm) & (g_norm > bound)
    return grad * torch.where(over, bound / g_norm, 1.0)


def last_dim_only(weight, grad, clip_factor=0.01, eps=1e-3):
    dims = -1 if grad.dim() > 1 else None
    bound = clip_factor * torch.clamp(_norm(weight, dims), min=eps)
    g_norm = _norm(grad, dims)
    over = torch.isfinite(g_norm) & (g_norm > bound)
    return grad * torch.where(over, bound / g_norm, 1.0)


def bias_by_entry(weight, grad, clip_factor=0.01, eps=1e-3):
    w = weight.reshape(weight.shape[0], -1)  # a vector becomes one unit per entry
    g = grad.reshape(w.shape)
    bound = clip_factor * torch.clamp(_norm(w, 1), min=eps)
    g_norm = _norm(g, 1)
    over = torch.isfinite(g_norm) & (g_norm > bound)
    return (g * torch.where(over, bound / g_norm, 1.0)).reshape(grad.shape)


def squared_norms(weight, grad, clip_factor=0.01, eps=1e-3):
    dims = _dims(grad)
    bound = clip_factor * torch.clamp(_norm(weight, dims) ** 2, min=eps)
    g_norm = _norm(grad, dims) ** 2
    over = torch.isfinite(g_norm) & (g_norm > bound)
    return grad * torch.where(over, bound / g_norm, 1.0)


def scale_by_rho(weight, grad, clip_factor=0.01, eps=1e-3):
    dims = _dims(grad)
    bound = clip_factor * torch.clamp(_norm(weight, dims), min=eps)
    g_norm = _norm(grad, dims)
    over = torch.isfinite(g_norm) & (g_norm > bound)
    return grad * torch.where(over, clip_factor, 1.0)


def clips_every_unit(weight, grad, clip_factor=0.01, eps=1e-3):
    dims = _dims(grad)
    bound = clip_factor * torch.clamp(_norm(weight, dims), min=eps)
    g_norm = _norm(grad, dims)
    return grad * torch.where(torch.isfinite(g_norm), bound / g_norm, 1.0)


def min_with_nan(weight, grad, clip_factor=0.01, eps=1e-3):
    dims = _dims(grad)
    bound = clip_factor * torch.clamp(_norm(weight, dims), min=eps)
    return grad * torch.clamp(bound / _norm(grad, dims), max=1.0)


def no_isfinite(weight, grad, clip_factor=0.01, eps=1e-3):
    dims = _dims(grad)
    bound = clip_factor * torch.clamp(_norm(weight, dims), min=eps)
    g_norm = _norm(grad, dims)
    return grad * torch.where(g_norm > bound, bound / g_norm, 1.0)  # inf: scaled by 0


def modifies_weight(weight, grad, clip_factor=0.01, eps=1e-3):
    dims = _dims(grad)
    w_norm = weight.detach().pow_(2).sum(dim=dims, keepdim=True).sqrt()  # squares it
    bound = clip_factor * torch.clamp(w_norm, min=eps)
    g_norm = _norm(grad, dims)
    over = torch.isfinite(g_norm) & (g_norm > bound)
    return grad * torch.where(over, bound / g_norm, 1.0)


def in_place(weight, grad, clip_factor=0.01, eps=1e-3):
    return grad.copy_(reference(weight, grad, clip_factor, eps))


def returns_nothing(weight, grad, clip_factor=0.01, eps=1e-3):
    reference(weight, grad, clip_factor, eps)


def returns_float64(weight, grad, clip_factor=0.01, eps=1e-3):
    return reference(weight.double(), grad.double(), clip_factor, eps)


def flat_coefficient(weight, grad, clip_factor=0.01, eps=1e-3):
    dims = _dims(grad)
    bound = clip_factor * torch.clamp(_norm(weight, dims), min=eps)
    g_norm = _norm(grad, dims)
    over = torch.isfinite(g_norm) & (g_norm > bound)
    return torch.where(over, bound / g_norm, 1.0).reshape(-1) * grad.reshape(-1, 1)


def wrong_default(weight, grad, clip_factor=0.1, eps=1e-3):
    return reference(weight, grad, clip_factor, eps)


def wrong_eps_default(weight, grad, clip_factor=0.01, eps=1e-6):
    return reference(weight, grad, clip_factor, eps)


def reads_on_host(weight, grad, clip_factor=0.01, eps=1e-3):
    dims = _dims(grad)
    bound = clip_factor * torch.clamp(_norm(weight, dims), min=eps)
    g_norm = _norm(grad, dims)
    if not bool((g_norm > bound).any()):  # a host read
        return grad.clone()
    return reference(weight, grad, clip_factor, eps)


def stub(weight, grad, clip_factor=0.01, eps=1e-3):
    raise NotImplementedError


def raises(weight, grad, clip_factor=0.01, eps=1e-3):
    dims = _dims(grad)
    return grad * _norm(weight, dims).squeeze(-1)  # loses the broadcasting dim


WRONG = [
    (no_floor, "Case 2 of", "max(||W_i||, eps)", "row 1"),
    (add_eps, "Case 1 of", "not ||W_i|| + eps"),
    (whole_tensor, "Case 1 of", "over the whole tensor"),
    (columns, "Case 1 of", "Your units are columns"),
    (last_dim_only, "Case 5 of", "over dims 1, 2 and 3", "output channel"),
    (bias_by_entry, "Case 3 of", "a single unit"),
    (squared_norms, "Case 1 of", "not the sum of squares"),
    (scale_by_rho, "Case 1 of", "not by clip_factor itself"),
    (clips_every_unit, "Case 1 of", "only units with ||G_i|| > bound", "row 0"),
    (min_with_nan, "Case 10 of", "must come back exactly as it was"),
    (no_isfinite, "Case 11 of", "must come back exactly as it was", "inf * 0"),
    (modifies_weight, "Case 1 of", "changed `weight`"),
    (in_place, "Case 1 of", "changed `grad` in place"),
    (returns_nothing, "Case 1 of", "yours:       None", "Return the clipped gradient"),
    (returns_float64, "Case 1 of", "Your gradient is float64", "float32 here"),
    (flat_coefficient, "Case 1 of", "a tensor of shape (3, 4)", "keepdim=True"),
    (wrong_default, f"Case {N} of", "clip_factor=0.01 and eps=1e-3", "clip_factor=0.1"),
    (wrong_eps_default, f"Case {N} of", "clip_factor=0.01 and eps=1e-3", "eps=1e-06"),
    (reads_on_host, "Case 1 of", "reads a tensor value on the host"),
    (raises, "Case 1 of", "Your function raised RuntimeError", "Hint: Reduce over dims 1..n"),
]


@pytest.mark.parametrize("wrong", WRONG, ids=[w[0].__name__ for w in WRONG])
def test_wrong_answers_fail_naming_the_mistake(wrong, capsys):
    fn, *fragments = wrong
    out = assert_fails(check_agc, fn, capsys, *fragments)
    assert out.count("fails:") == 1, out


def test_stub_says_not_implemented(capsys):
    out = assert_fails(check_agc, stub, capsys, "Not implemented yet")
    assert "Case" not in out


def test_not_a_function(capsys):
    assert_fails(check_agc, 3, capsys, "Expected a function")
