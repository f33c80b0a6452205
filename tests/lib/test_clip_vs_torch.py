"""clip_grad_norm_, clip_grad_value_ and get_total_norm against torch.nn.utils and the math."""

import math

import pytest
import torch
from clip_helpers import (
    NORM_TYPES,
    as_p,
    assert_same_bits,
    copy_params,
    factor_st,
    foreach_st,
    grads,
    make_params,
    math_max_abs,
    math_norm,
    same_bits,
    scale_st,
    seed_st,
    shapes_st,
)
from hypothesis import given
from hypothesis import strategies as st

import gradlab

EXACT_DTYPES = (torch.float32, torch.float64)
dtype_st = st.sampled_from(EXACT_DTYPES)
# The result is documented as torch's bits for p up to 4: test 4, and a p below 1.
norm_st = st.sampled_from((*NORM_TYPES, 0.5, 4.0))


def _has_empty(params) -> bool:
    return any(g.numel() == 0 for g in grads(params))


def _torch_total(params, p, foreach):
    """torch's total norm, or None where torch refuses (inf-norm of an empty tensor)."""
    try:
        return torch.nn.utils.get_total_norm(grads(params), p, foreach=foreach)
    except RuntimeError as err:
        assert p == math.inf and _has_empty(params), err
        return None


# -------------------------------------------------------------------- get_total_norm


@given(shapes_st, dtype_st, norm_st, seed_st, scale_st, foreach_st)
def test_get_total_norm_matches_torch_and_math(shapes, dtype, norm_type, seed, scale, foreach):
    params = make_params(shapes, dtype=dtype, seed=seed, scale=scale)
    p = as_p(norm_type)
    ours = gradlab.get_total_norm(grads(params), norm_type, foreach=foreach)
    assert ours.dim() == 0 and ours.dtype == dtype
    theirs = _torch_total(params, p, foreach)
    if theirs is not None:
        assert_same_bits(ours, theirs)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    assert math.isclose(float(ours), math_norm(grads(params), p), rel_tol=rtol, abs_tol=1e-30)


@pytest.mark.parametrize("dtype", EXACT_DTYPES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("foreach", [None, True, False])
def test_get_total_norm_large_tensors_match_torch(dtype, norm_type, foreach):
    # Sizes on both sides of 1024 entries, and the largest entry in a large tensor.
    params = make_params([(1023,), (1024,), (70, 90), (3,), ()], dtype=dtype, seed=7)
    params[2].grad[33, 44] = -25.0
    ours = gradlab.get_total_norm(grads(params), norm_type, foreach=foreach)
    theirs = torch.nn.utils.get_total_norm(grads(params), as_p(norm_type), foreach=foreach)
    assert_same_bits(ours, theirs)
    if as_p(norm_type) == math.inf:
        assert float(ours) == 25.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("foreach", [None, False])
def test_inf_norm_low_precision_large_and_small(dtype, foreach):
    tensors = [
        torch.full((2000,), -3.0, dtype=dtype),
        torch.tensor([60000.0, 1.0], dtype=dtype),
    ]
    for order in (tensors, tensors[::-1]):
        total = gradlab.get_total_norm(order, "inf", foreach=foreach)
        assert total.dtype == torch.float32
        assert float(total) == float(tensors[1][0])


def test_get_total_norm_inf_of_empty_tensors_is_zero():
    # torch refuses the inf-norm of an empty tensor; the max over no entries is 0.
    empty = [torch.zeros(0), torch.zeros(2, 0)]
    assert float(gradlab.get_total_norm(empty, math.inf)) == 0.0
    assert float(gradlab.get_total_norm([*empty, torch.tensor([-3.0, 2.0])], "inf")) == 3.0
    assert float(gradlab.get_total_norm(empty, 2.0)) == 0.0


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("foreach", [None, False])
def test_get_total_norm_mixed_dtypes_is_the_true_norm(norm_type, foreach):
    gen = torch.Generator().manual_seed(1)
    tensors = [
        (torch.randn(7, 5, generator=gen) * 50).to(dtype)
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    ]
    total = gradlab.get_total_norm(tensors, norm_type, foreach=foreach)
    assert total.dtype == torch.float64  # float64 present: accumulate in float64
    expected = math_norm(tensors, as_p(norm_type))
    assert math.isclose(float(total), expected, rel_tol=1e-5)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_norm_does_not_overflow(norm_type, foreach, dtype):
    # 64 entries of 60000: a float16 norm would be 480000 > 65504, i.e. inf.
    big = torch.full((8, 8), 60000.0, dtype=dtype)
    small = torch.tensor([0.5, -0.25], dtype=dtype)
    total = gradlab.get_total_norm([big, small], norm_type, foreach=foreach)
    assert total.dtype == torch.float32
    assert torch.isfinite(total)
    expected = math_norm([big, small], as_p(norm_type))
    assert math.isclose(float(total), expected, rel_tol=1e-5)
    # Mixed with float32 it is the same true norm.
    mixed = gradlab.get_total_norm([big, small.float()], norm_type, foreach=foreach)
    assert math.isclose(float(mixed), expected, rel_tol=1e-5)


# ------------------------------------------------------------------- clip_grad_norm_


@given(shapes_st, dtype_st, norm_st, seed_st, scale_st, factor_st, foreach_st)
def test_clip_grad_norm_matches_torch(shapes, dtype, norm_type, seed, scale, factor, foreach):
    ours = make_params(shapes, dtype=dtype, seed=seed, scale=scale)
    theirs = copy_params(ours)
    p = as_p(norm_type)
    reference = _torch_total(theirs, p, foreach)
    if reference is None:  # torch cannot clip this set at all
        return
    max_norm = factor * float(reference)
    if math.isnan(max_norm):  # 0 * inf
        max_norm = 0.0
    total_ours = gradlab.clip_grad_norm_(ours, max_norm, norm_type, foreach=foreach)
    total_theirs = torch.nn.utils.clip_grad_norm_(theirs, max_norm, p, foreach=foreach)
    assert_same_bits(total_ours, total_theirs)
    for a, b in zip(grads(ours), grads(theirs), strict=True):
        assert_same_bits(a, b)


@given(shapes_st, norm_st, seed_st, factor_st)
def test_clip_grad_norm_is_the_formula(shapes, norm_type, seed, factor):
    # g <- g * min(1, max_norm / (||g|| + 1e-6)), computed in float64 from scratch.
    params = make_params(shapes, dtype=torch.float64, seed=seed)
    before = [g.clone() for g in grads(params)]
    p = as_p(norm_type)
    norm = math_norm(before, p)
    max_norm = 0.0 if norm == 0.0 else factor * norm  # not 0 * inf
    gradlab.clip_grad_norm_(params, max_norm, norm_type)
    coef = min(1.0, max_norm / (norm + 1e-6))
    for g, old in zip(grads(params), before, strict=True):
        torch.testing.assert_close(g, old * coef, rtol=1e-12, atol=1e-300)
    after = math_norm(grads(params), p)
    assert after <= max(max_norm, 0.0) * (1 + 1e-12) or after <= norm * (1 + 1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("factor", [0.1, 0.5, 2.0])
def test_clip_grad_norm_low_precision_against_float64_math(dtype, norm_type, factor):
    params = make_params([(6, 5), (3,), ()], dtype=dtype, seed=3, scale=4.0)
    before = [g.to(torch.float64) for g in grads(params)]
    p = as_p(norm_type)
    norm = math_norm(before, p)
    max_norm = factor * norm
    total = gradlab.clip_grad_norm_(params, max_norm, norm_type)
    assert total.dtype == torch.float32
    assert math.isclose(float(total), norm, rel_tol=1e-6)
    coef = min(1.0, max_norm / (norm + 1e-6))
    eps = torch.finfo(dtype).eps
    for g, old in zip(grads(params), before, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g.to(torch.float64), old * coef, rtol=2 * eps, atol=1e-6)


def test_clip_grad_norm_of_float16_with_large_entries_stays_finite():
    # torch's own kernel takes the norm in float16, gets inf and zeroes (or NaNs) the
    # gradient; gradlab's float32 norm clips to the true direction.
    g = torch.full((16,), 30000.0, dtype=torch.float16)
    param = torch.nn.Parameter(torch.zeros(16, dtype=torch.float16))
    param.grad = g.clone()
    total = gradlab.clip_grad_norm_(param, 1.0)
    assert math.isclose(float(total), 120000.0, rel_tol=1e-6)
    torch.testing.assert_close(
        param.grad.double(), torch.full((16,), 0.25, dtype=torch.float64), rtol=1e-3, atol=0
    )


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_clip_grad_norm_nonfinite_is_like_torch(bad, norm_type):
    # Documented behaviour, as in torch: a NaN norm makes every entry NaN; an infinite
    # norm gives the coefficient 0, so finite entries become 0 and the inf one NaN.
    ours = make_params([(3,), (2, 2)], seed=5)
    ours[1].grad[0, 1] = bad
    theirs = copy_params(ours)
    total_ours = gradlab.clip_grad_norm_(ours, 1.0, norm_type)
    total_theirs = torch.nn.utils.clip_grad_norm_(theirs, 1.0, as_p(norm_type))
    assert_same_bits(total_ours, total_theirs)
    for a, b in zip(grads(ours), grads(theirs), strict=True):
        assert_same_bits(a, b)
    if math.isnan(bad):
        assert all(torch.isnan(g).all() for g in grads(ours))
    else:
        assert torch.isinf(total_ours)
        assert torch.isnan(ours[1].grad[0, 1])
        assert int(torch.isnan(torch.cat([g.reshape(-1) for g in grads(ours)])).sum()) == 1


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_clip_grad_norm_error_if_nonfinite(bad):
    params = make_params([(3,), (2, 2)], seed=6)
    params[0].grad[1] = bad
    before = [g.clone() for g in grads(params)]
    with pytest.raises(RuntimeError, match="non-finite"):
        gradlab.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    for g, old in zip(grads(params), before, strict=True):
        assert_same_bits(g, old)


# ------------------------------------------------------------------ clip_grad_value_


@given(shapes_st, dtype_st, seed_st, scale_st, factor_st, foreach_st)
def test_clip_grad_value_matches_torch(shapes, dtype, seed, scale, factor, foreach):
    ours = make_params(shapes, dtype=dtype, seed=seed, scale=scale)
    theirs = copy_params(ours)
    clip_value = factor * math_max_abs(grads(ours))
    if math.isnan(clip_value):
        clip_value = 0.0
    assert gradlab.clip_grad_value_(ours, clip_value, foreach=foreach) is None
    assert torch.nn.utils.clip_grad_value_(theirs, clip_value, foreach=foreach) is None
    for a, b in zip(grads(ours), grads(theirs), strict=True):
        assert_same_bits(a, b)
        assert math_max_abs([a]) <= clip_value


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("foreach", [None, False])
def test_clip_grad_value_with_nonfinite_matches_torch(dtype, foreach):
    ours = [torch.nn.Parameter(torch.zeros(5, dtype=dtype))]
    ours[0].grad = torch.tensor([math.nan, math.inf, -math.inf, 0.3, -2.0], dtype=dtype)
    theirs = copy_params(ours)
    gradlab.clip_grad_value_(ours, 1.0, foreach=foreach)
    torch.nn.utils.clip_grad_value_(theirs, 1.0, foreach=foreach)
    assert same_bits(ours[0].grad, theirs[0].grad)
    assert torch.isnan(ours[0].grad[0])  # a NaN entry stays NaN, as documented
