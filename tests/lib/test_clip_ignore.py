"""grad_ignore_norm_ and grad_ignore_value_: all or nothing, decided by exact math."""

import math

import pytest
import torch
from clip_helpers import (
    FLOAT_DTYPES,
    NORM_TYPES,
    as_p,
    assert_all_plus_zero,
    assert_grads_unchanged,
    assert_same_bits,
    copy_params,
    factor_st,
    foreach_st,
    grads,
    make_params,
    math_max_abs,
    math_norm,
    scale_st,
    seed_st,
    shapes_st,
    snapshot,
)
from hypothesis import given
from hypothesis import strategies as st

import gradlab

NONFINITE = [math.nan, math.inf, -math.inf]
#: Small, 0-d, empty and large (over a thousand entries: other kernels on the CPU).
MIXED_SIZES = [(4, 3), (5,), (), (0,), (40, 40)]


def _plant(params, value, seed):
    """Put ``value`` into one entry of one non-empty gradient, chosen by ``seed``."""
    targets = [g for g in grads(params) if g.numel() > 0]
    target = targets[seed % len(targets)]
    target.view(-1)[(seed // 7) % target.numel()] = value


# ----------------------------------------------------------------- grad_ignore_norm_


@given(
    shapes_st,
    st.sampled_from([torch.float32, torch.float64]),
    st.sampled_from(NORM_TYPES),
    seed_st,
    scale_st,
    factor_st,
    foreach_st,
)
def test_ignore_norm_ignores_exactly_when_torch_would_rescale(
    shapes, dtype, norm_type, seed, scale, factor, foreach
):
    ours = make_params(shapes, dtype=dtype, seed=seed, scale=scale)
    theirs = copy_params(ours)
    before = snapshot(ours)
    p = as_p(norm_type)
    norm = math_norm(grads(ours), p)
    max_norm = 0.0 if norm == 0.0 else factor * norm
    total = gradlab.grad_ignore_norm_(ours, max_norm, norm_type, foreach=foreach)

    if p == math.inf and any(g.numel() == 0 for g in grads(theirs)):
        # torch refuses this set; fall back to the formula in float64.
        rescaled = max_norm / (norm + 1e-6) < 1
    else:
        torch_total = torch.nn.utils.clip_grad_norm_(theirs, max_norm, p, foreach=foreach)
        assert_same_bits(total, torch_total)
        coef = torch.clamp(max_norm / (torch_total + 1e-6), max=1.0)
        rescaled = bool(coef < 1)
    assert math.isclose(float(total), norm, rel_tol=1e-5, abs_tol=1e-30)
    if rescaled:
        assert_all_plus_zero(ours)
    else:
        assert_grads_unchanged(ours, before)


@pytest.mark.parametrize("bad", NONFINITE)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("where", [0, 1, 2, 3, 7, 31])
def test_ignore_norm_zeroes_everything_on_nonfinite(bad, norm_type, foreach, where):
    params = make_params(MIXED_SIZES, seed=where)
    _plant(params, bad, where)
    total = gradlab.grad_ignore_norm_(params, math.inf, norm_type, foreach=foreach)
    assert not torch.isfinite(total)
    assert torch.isnan(total) == math.isnan(bad)
    assert_all_plus_zero(params)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bad", NONFINITE)
def test_ignore_norm_nonfinite_any_dtype(dtype, bad):
    params = make_params([(3, 3), (2,)], dtype=dtype, seed=2)
    params[1].grad[1] = bad
    gradlab.grad_ignore_norm_(params, 1e30)
    assert_all_plus_zero(params)


@pytest.mark.parametrize("bad", NONFINITE)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_ignore_norm_error_if_nonfinite_raises_before_changing(bad, norm_type):
    params = make_params([(4, 3), (5,)], seed=4)
    params[0].grad[2, 1] = bad
    before = snapshot(params)
    with pytest.raises(RuntimeError, match="non-finite"):
        gradlab.grad_ignore_norm_(params, 1.0, norm_type, error_if_nonfinite=True)
    assert_grads_unchanged(params, before)


def test_ignore_norm_error_if_nonfinite_with_finite_gradients_acts_normally():
    kept = make_params([(3,)], seed=8)
    before = snapshot(kept)
    gradlab.grad_ignore_norm_(kept, 1e6, error_if_nonfinite=True)
    assert_grads_unchanged(kept, before)
    ignored = make_params([(3,)], seed=8)
    gradlab.grad_ignore_norm_(ignored, 1e-6, error_if_nonfinite=True)
    assert_all_plus_zero(ignored)


def test_ignore_norm_threshold_rule():
    # keep iff max_norm / (norm + 1e-6) >= 1: a 3-4-5 gradient has norm 5 exactly.
    def run(max_norm):
        param = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        param.grad = torch.tensor([3.0, -4.0], dtype=torch.float64)
        total = gradlab.grad_ignore_norm_(param, max_norm)
        assert float(total) == 5.0
        return bool(param.grad.any())

    assert run(5.0 + 2e-6)  # 5.000002 / 5.000001 > 1: kept
    assert not run(5.0)  # 5 / 5.000001 < 1: ignored, as clip_grad_norm_ would rescale
    assert not run(0.0)
    assert run(math.inf)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_ignore_norm_coefficient_exactly_one_is_kept(norm_type):
    # In float32, 1024 + 1e-6 rounds to 1024, so max_norm=1024 gives a coefficient of
    # exactly 1.0: clip_grad_norm_ would multiply by 1 (no rescale), so nothing is
    # ignored. At the float32 just below 1024, it is.
    def run(max_norm):
        param = torch.nn.Parameter(torch.zeros(1))
        param.grad = torch.tensor([-1024.0])
        twin = copy_params([param])
        torch_total = torch.nn.utils.clip_grad_norm_(twin, max_norm, as_p(norm_type))
        rescaled = bool(max_norm / (torch_total + 1e-6) < 1)
        gradlab.grad_ignore_norm_(param, max_norm, norm_type)
        assert bool(param.grad.any()) != rescaled
        return not rescaled

    assert run(1024.0)
    below = torch.nextafter(torch.tensor(1024.0), torch.tensor(0.0))  # float32 below
    assert not run(float(below))


def test_ignore_norm_keeps_negative_zero_and_subnormals_bit_for_bit():
    tiny = torch.finfo(torch.float32).tiny / 8  # a subnormal
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.tensor([-0.0, tiny, -tiny, 1.0])
    before = snapshot([param])
    gradlab.grad_ignore_norm_(param, 10.0)
    assert_grads_unchanged([param], before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ignore_norm_low_precision_decides_on_the_true_norm(dtype):
    # Norm 240000 (not inf, as a float16 norm would be): kept under 1e6, ignored under 1e5.
    kept = [torch.nn.Parameter(torch.zeros(16, dtype=dtype))]
    kept[0].grad = torch.full((16,), 60000.0, dtype=dtype)
    before = snapshot(kept)
    total = gradlab.grad_ignore_norm_(kept, 1e6)
    assert total.dtype == torch.float32
    assert math.isclose(float(total), math_norm(grads(kept), 2.0), rel_tol=1e-6)
    assert_grads_unchanged(kept, before)
    gradlab.grad_ignore_norm_(kept, 1e5)
    assert_all_plus_zero(kept)


# ---------------------------------------------------------------- grad_ignore_value_


@given(
    shapes_st,
    st.sampled_from(FLOAT_DTYPES),
    seed_st,
    scale_st,
    factor_st,
    foreach_st,
)
def test_ignore_value_rule(shapes, dtype, seed, scale, factor, foreach):
    params = make_params(shapes, dtype=dtype, seed=seed, scale=scale)
    before = snapshot(params)
    largest = math_max_abs(grads(params))
    clip_value = 0.0 if largest == 0.0 else factor * largest
    result = gradlab.grad_ignore_value_(params, clip_value, foreach=foreach)
    assert result.dim() == 0
    assert float(result) == largest  # a max is exact
    if largest >= clip_value:  # the rule, in exact (float64) arithmetic
        assert_all_plus_zero(params)
    else:
        assert_grads_unchanged(params, before)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("foreach", [None, False])
def test_ignore_value_boundary_is_inclusive(dtype, sign, foreach):
    # 0.5 is exact in every format: an entry equal to clip_value triggers the ignore,
    # the next representable value below it does not.
    at = torch.tensor(0.5, dtype=dtype)
    below = torch.nextafter(at, torch.tensor(0.0, dtype=dtype))
    for entry, ignored in [(at, True), (below, False)]:
        param = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
        param.grad = torch.tensor([0.1, 0.0, 0.0], dtype=dtype)
        param.grad[2] = sign * entry
        before = snapshot([param])
        result = gradlab.grad_ignore_value_(param, 0.5, foreach=foreach)
        assert float(result) == float(entry)
        if ignored:
            assert_all_plus_zero([param])
        else:
            assert_grads_unchanged([param], before)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_ignore_value_threshold_not_representable_is_decided_exactly(dtype):
    # clip_value=0.7 is a float64 number; the entry is 0.7 rounded to the gradient's
    # dtype, which may lie above or below 0.7. Rounding clip_value to that dtype first
    # would make them equal and always ignore; exact math decides either way.
    entry = torch.tensor(0.7, dtype=dtype)
    e = float(entry)  # exact
    cases = [
        (0.7, e >= 0.7),
        (e, True),  # exactly equal
        (math.nextafter(e, math.inf), False),  # a float64 just above the entry
        (math.nextafter(e, 0.0), True),  # a float64 just below the entry
    ]
    for clip_value, ignored in cases:
        param = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
        param.grad = torch.stack([entry, torch.tensor(-0.1, dtype=dtype)])
        before = snapshot([param])
        gradlab.grad_ignore_value_(param, clip_value)
        if ignored:
            assert_all_plus_zero([param])
        else:
            assert_grads_unchanged([param], before)
    # float32(0.7) = 0.699999988... < 0.7: kept.
    if dtype == torch.float32:
        assert e < 0.7


@pytest.mark.parametrize("bad", NONFINITE)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("where", [0, 1, 2, 3, 7, 31])
def test_ignore_value_zeroes_everything_on_nonfinite(bad, dtype, foreach, where):
    params = make_params(MIXED_SIZES, dtype=dtype, seed=where)
    _plant(params, bad, where)
    result = gradlab.grad_ignore_value_(params, math.inf, foreach=foreach)
    assert torch.isnan(result) if math.isnan(bad) else float(result) == math.inf
    assert_all_plus_zero(params)


def test_ignore_value_with_empty_tensors():
    # torch's max refuses empty tensors; they hold no entry, so they change nothing.
    params = make_params([(0,), (3, 0), (2,)], seed=1)
    before = snapshot(params)
    assert float(gradlab.grad_ignore_value_(params, 100.0)) == math_max_abs(grads(params))
    assert_grads_unchanged(params, before)
    only_empty = make_params([(0,), (3, 0)])
    assert float(gradlab.grad_ignore_value_(only_empty, 0.5)) == 0.0


def test_ignore_value_zero_threshold_ignores_everything():
    params = make_params([(3,)], seed=2)
    gradlab.grad_ignore_value_(params, 0.0)  # |g| >= 0 always holds
    assert_all_plus_zero(params)


def test_ignore_value_mixed_dtypes_returns_the_true_max():
    params = [
        torch.nn.Parameter(torch.zeros(2, dtype=dtype))
        for dtype in (torch.float16, torch.bfloat16, torch.float32)
    ]
    params[0].grad = torch.tensor([60000.0, 1.0], dtype=torch.float16)
    params[1].grad = torch.tensor([-3.0e5, 1.0], dtype=torch.bfloat16)
    params[2].grad = torch.tensor([2.0, 1.0])
    before = snapshot(params)
    result = gradlab.grad_ignore_value_(params, 3.1e5)
    assert result.dtype == torch.float32
    assert float(result) == float(torch.tensor(-3.0e5, dtype=torch.bfloat16).abs())
    assert_grads_unchanged(params, before)


# ------------------------------------------------------------------- both, in place


@pytest.mark.parametrize(
    "call",
    [
        lambda ps: gradlab.grad_ignore_norm_(ps, 1e-3),
        lambda ps: gradlab.grad_ignore_value_(ps, 1e-3),
    ],
    ids=["norm", "value"],
)
def test_ignore_works_in_place(call):
    params = make_params([(3, 2), (4,)], seed=9)
    originals = [(p.grad, p.grad.data_ptr()) for p in params]
    call(params)
    for p, (g, ptr) in zip(params, originals, strict=True):
        assert p.grad is g and p.grad.data_ptr() == ptr
    assert_all_plus_zero(params)


def test_ignore_noncontiguous_gradients():
    param = torch.nn.Parameter(torch.zeros(3, 4))
    param.grad = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)).t()
    assert not param.grad.is_contiguous()
    before = snapshot([param])
    gradlab.grad_ignore_norm_(param, 1e6)
    assert_grads_unchanged([param], before)
    gradlab.grad_ignore_value_(param, 1e-6)
    assert_all_plus_zero([param])


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_ignore_complex_gradients(dtype):
    # Complex gradients take the per-tensor select; the rules are the same.
    def fresh():
        param = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
        param.grad = torch.tensor([1 + 1j, -2.0, 0.5j], dtype=dtype)
        return param

    kept = fresh()
    before = snapshot([kept])
    assert math.isclose(float(gradlab.grad_ignore_norm_(kept, 10.0)), math.sqrt(6.25), rel_tol=1e-6)
    assert_grads_unchanged([kept], before)
    ignored = fresh()
    gradlab.grad_ignore_norm_(ignored, 1.0)
    assert torch.equal(ignored.grad, torch.zeros(3, dtype=dtype))
    broken = fresh()
    broken.grad[1] = complex(math.nan, 0.0)
    gradlab.grad_ignore_norm_(broken, math.inf)
    assert torch.equal(broken.grad, torch.zeros(3, dtype=dtype))
