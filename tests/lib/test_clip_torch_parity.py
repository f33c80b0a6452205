"""torch's own tests of clip_grad_norm_ / clip_grad_value_, run against gradlab.

``test_clip_grad_norm``, ``test_clip_grad_value`` and
``test_clip_grad_norm_error_if_nonfinite`` are ports of the tests of the same names in
PyTorch's ``test/test_nn.py`` (TestNNDeviceType, CPU, both ``foreach`` settings), with
``torch.nn.utils`` replaced by gradlab and ``self.assertEqual`` by
``torch.testing.assert_close``. The one departure is marked ``REFUSED``: torch
computes a "norm" for ``norm_type <= 0``, which gradlab documents as a ValueError.

The tests after them pin down the rest of torch's observable behaviour: the warning
for an empty generator, the wording of the non-finite error, a tensor ``max_norm``,
complex gradients, the two-phase functions and the 16-bit overflow case.
"""

import math
import warnings
from itertools import product

import pytest
import torch
from clip_helpers import assert_same_bits, copy_params, grads, make_params, same_bits
from torch import inf, nan, nn

import gradlab

FOREACH = pytest.mark.parametrize("foreach", [False, True])


def _assert_equal(a, b):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    # torch's TestCase.assertEqual tolerances for float32.
    torch.testing.assert_close(a, b, rtol=1.3e-6, atol=1e-5)


# ------------------------------------------------------------- ports of test_nn.py


@FOREACH
@pytest.mark.parametrize("norm_type", [0.5, 1.5, 2, 4, "inf"])
def test_clip_grad_norm(foreach, norm_type):
    lin = nn.Linear(10, 10)
    max_norm = 2

    def compute_norm(norm_type):
        norm_type = float(norm_type)
        if norm_type != inf:
            total_norm = 0
            for p in lin.parameters():
                total_norm += p.grad.data.abs().pow(norm_type).sum()
            return pow(total_norm, 1.0 / norm_type)
        return max(p.grad.data.abs().max() for p in lin.parameters())

    def compare_scaling(grads):
        p_scale = [
            p.grad.data.div(g).view(-1) for p, g in zip(lin.parameters(), grads, strict=True)
        ]
        scale = torch.cat(p_scale)
        _assert_equal(scale.std(), 0)
        return scale[0]

    grads = torch.arange(1.0, 101).view(10, 10), torch.ones(10).div(1000)
    for p, g in zip(lin.parameters(), grads, strict=True):
        p._grad = g.clone().view_as(p.data)
    norm_before = compute_norm(norm_type)
    norm = gradlab.clip_grad_norm_(lin.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    norm_after = compute_norm(norm_type)
    _assert_equal(norm, norm_before)
    _assert_equal(norm_after, max_norm)
    assert norm_after <= norm_before
    compare_scaling(grads)

    # The decomposed API: get_total_norm, then clip_grads_with_norm_.
    for p, g in zip(lin.parameters(), grads, strict=True):
        p._grad = g.clone().view_as(p.data)
    norm_before = compute_norm(norm_type)
    total_norm = gradlab.get_total_norm(
        [p.grad for p in lin.parameters()], norm_type=norm_type, foreach=foreach
    )
    gradlab.clip_grads_with_norm_(lin.parameters(), max_norm, total_norm, foreach=foreach)
    norm_after = compute_norm(norm_type)
    _assert_equal(total_norm, norm_before)
    _assert_equal(norm_after, max_norm)
    assert norm_after <= norm_before
    compare_scaling(grads)

    # Small gradients should be left unchanged
    grads = torch.rand(10, 10).div(10000), torch.ones(10).div(500)
    for p, g in zip(lin.parameters(), grads, strict=True):
        p.grad.data.copy_(g)
    norm_before = compute_norm(norm_type)
    norm = gradlab.clip_grad_norm_(lin.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    norm_after = compute_norm(norm_type)
    _assert_equal(norm, norm_before)
    _assert_equal(norm_before, norm_after)
    assert norm_after <= max_norm
    scale = compare_scaling(grads)
    _assert_equal(scale, 1)

    # Should accept a single Tensor as input
    p1, p2 = torch.randn(10, 10), torch.randn(10, 10)
    g = torch.arange(1.0, 101).view(10, 10)
    p1._grad = g.clone()
    p2._grad = g.clone()
    gradlab.clip_grad_norm_(p1, max_norm, norm_type=norm_type, foreach=foreach)
    gradlab.clip_grad_norm_([p2], max_norm, norm_type=norm_type, foreach=foreach)
    _assert_equal(p1.grad, p2.grad)

    # Should warn when the parameters generator is exhausted
    params = lin.parameters()
    for _p in params:
        pass
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        gradlab.clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=foreach)
    assert len(w) == 1
    assert str(w[0].message) == (
        "`parameters` is an empty generator, no gradient clipping will occur."
    )


@FOREACH
def test_clip_grad_value(foreach):
    lin = nn.Linear(10, 10)
    clip_value = 2.5

    grad_w, grad_b = torch.arange(-50.0, 50).view(10, 10).div_(5), torch.ones(10).mul_(2)
    for grad_list in [[grad_w, grad_b], [grad_w, None]]:
        for p, g in zip(lin.parameters(), grad_list, strict=True):
            p._grad = g.clone().view_as(p.data) if g is not None else g

        gradlab.clip_grad_value_(lin.parameters(), clip_value, foreach=foreach)
        for p in filter(lambda p: p.grad is not None, lin.parameters()):
            assert p.grad.data.max() <= clip_value
            assert p.grad.data.min() >= -clip_value

    # Should accept a single Tensor as input
    p1, p2 = torch.randn(10, 10), torch.randn(10, 10)
    g = torch.arange(-50.0, 50).view(10, 10).div_(5)
    p1._grad = g.clone()
    p2._grad = g.clone()
    gradlab.clip_grad_value_(p1, clip_value, foreach=foreach)
    gradlab.clip_grad_value_([p2], clip_value, foreach=foreach)
    _assert_equal(p1.grad, p2.grad)


NORMS_POS = [0.1, 1, 2, 3.5, inf]
NORMS_NEG = [-0.1, -1, -2, -3.5]
NORMS_EXCEPT_0 = NORMS_POS + NORMS_NEG
NORMS_ALL = [*NORMS_EXCEPT_0, 0]

# (grad_only_one_elem, prefix_finite_grad_param, scalars, norms_nonfinite, norms_finite)
NONFINITE_CASES = [
    # Test errors from an infinite grad
    (False, False, [inf, -inf], NORMS_EXCEPT_0, [0]),
    (False, True, [inf, -inf], NORMS_POS, [*NORMS_NEG, 0]),
    (True, False, [inf, -inf], NORMS_POS, [*NORMS_NEG, 0]),
    (True, True, [inf, -inf], NORMS_POS, [*NORMS_NEG, 0]),
    # Test errors from a NaN grad
    (False, False, [nan], NORMS_EXCEPT_0, [0]),
    (False, True, [nan], NORMS_EXCEPT_0, [0]),
    (True, False, [nan], NORMS_EXCEPT_0, [0]),
    (True, True, [nan], NORMS_EXCEPT_0, [0]),
    # Test a grad that should never error
    (False, False, [2e22, -2e22], [], NORMS_ALL),
    (False, True, [2e22, -2e22], [], NORMS_ALL),
    (True, False, [2e22, -2e22], [], NORMS_ALL),
    (True, True, [2e22, -2e22], [], NORMS_ALL),
    # Test a grad that will overflow to inf for only some norm orders
    (False, False, [2e200, -2e200], [3.5, 2, -2, -3.5], [inf, 1, 0.1, 0, -1, -0.1]),
    (False, True, [2e200, -2e200], [3.5, 2], [*NORMS_NEG, inf, 1, 0.1, 0]),
    (True, False, [2e200, -2e200], [3.5, 2], [*NORMS_NEG, inf, 1, 0.1, 0]),
    (True, True, [2e200, -2e200], [3.5, 2], [*NORMS_NEG, inf, 1, 0.1, 0]),
]


@FOREACH
def test_clip_grad_norm_error_if_nonfinite(foreach):
    def gen_parameters(scalar, grad_only_one_elem, prefix_finite_grad_param):
        param = torch.ones(10, dtype=torch.float64, requires_grad=True)
        if grad_only_one_elem:
            param[1].mul(scalar).sum().backward()
        else:
            param.mul(scalar).sum().backward()
        if prefix_finite_grad_param:
            prefix_param = torch.ones(1, dtype=torch.float64, requires_grad=True)
            prefix_param.mul(1).sum().backward()
            return [prefix_param, param]
        return [param]

    def run_test_case(norm_type, error_if_nonfinite, scalar, one_elem, prefix, is_nonfinite):
        parameters = gen_parameters(scalar, one_elem, prefix)
        kwargs = {"norm_type": norm_type, "foreach": foreach}
        if norm_type <= 0:
            # REFUSED: torch computes a "norm" of order <= 0; gradlab documents a
            # ValueError, raised before any gradient changes.
            grads_before = [p.grad.clone() for p in parameters]
            with pytest.raises(ValueError, match="norm_type"):
                gradlab.clip_grad_norm_(
                    parameters, 1, error_if_nonfinite=error_if_nonfinite, **kwargs
                )
            torch.testing.assert_close([p.grad for p in parameters], grads_before, equal_nan=True)
        elif is_nonfinite and error_if_nonfinite:
            # Should only throw an error if the total norm is expected to be
            # nonfinite and `error_if_nonfinite=True`
            error_msg = f"The total norm of order {float(norm_type)} for gradients"
            grads_before = [p.grad.clone() for p in parameters]
            with pytest.raises(RuntimeError, match=error_msg):
                gradlab.clip_grad_norm_(parameters, 1, error_if_nonfinite=True, **kwargs)
            # Grad should not change if error is thrown
            torch.testing.assert_close([p.grad for p in parameters], grads_before, equal_nan=True)
        else:
            gradlab.clip_grad_norm_(parameters, 1, error_if_nonfinite=error_if_nonfinite, **kwargs)

    for one_elem, prefix, scalars, norms_nonfinite, norms_finite in NONFINITE_CASES:
        for error_if_nonfinite in [False, True]:
            for norm_type, scalar in product(norms_nonfinite, scalars):
                run_test_case(norm_type, error_if_nonfinite, scalar, one_elem, prefix, True)
            for norm_type, scalar in product(norms_finite, scalars):
                run_test_case(norm_type, error_if_nonfinite, scalar, one_elem, prefix, False)


# --------------------------------------------------- the rest of torch's behaviour


def _warnings_of(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught]


@pytest.mark.parametrize("empty", ["list", "generator"])
def test_empty_input_returns_and_warns_like_torch(empty):
    def arg():
        return [] if empty == "list" else (p for p in [])

    theirs, their_warnings = _warnings_of(lambda: torch.nn.utils.clip_grad_norm_(arg(), 1.0))
    ours, our_warnings = _warnings_of(lambda: gradlab.clip_grad_norm_(arg(), 1.0))
    expected = ["`parameters` is an empty generator, no gradient clipping will occur."]
    assert our_warnings == their_warnings == (expected if empty == "generator" else [])
    assert_same_bits(ours, theirs)
    # clip_grad_value_ and get_total_norm do not warn (torch's clip_grad_value_ of an
    # empty list raises, a bug not copied).
    assert _warnings_of(lambda: gradlab.clip_grad_value_(arg(), 1.0)) == (None, [])
    for fn in (torch.nn.utils.get_total_norm, gradlab.get_total_norm):
        assert _warnings_of(lambda fn=fn: fn(arg()))[1] == []


@pytest.mark.parametrize("bad", [nan, inf, -inf])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, inf])
def test_nonfinite_error_has_torch_wording(bad, norm_type):
    params = make_params([(3,), (2, 2)], seed=1)
    params[1].grad[0, 1] = bad

    def message(call):
        with pytest.raises(RuntimeError) as raised:
            call()
        return str(raised.value)

    kw = {"norm_type": norm_type, "error_if_nonfinite": True}
    assert message(lambda: gradlab.clip_grad_norm_(params, 1.0, **kw)) == message(
        lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, **kw)
    )
    assert message(lambda: gradlab.get_total_norm(grads(params), **kw)) == message(
        lambda: torch.nn.utils.get_total_norm(grads(params), **kw)
    )
    # grad_ignore_norm_ starts the same way and says what it would do instead.
    text = message(lambda: gradlab.grad_ignore_norm_(params, 1.0, norm_type, True))
    assert text.startswith(f"The total norm of order {norm_type} for gradients from `parameters`")
    assert "zero" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("max_dtype", [torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_a_0_dim_tensor_max_norm_is_accepted_like_torch(dtype, max_dtype, factor):
    ours = make_params([(4, 3), (5,)], dtype=dtype, seed=2, scale=3.0)
    theirs = copy_params(ours)
    max_norm = torch.tensor(factor * float(gradlab.get_total_norm(grads(ours)))).to(max_dtype)
    assert_same_bits(
        gradlab.clip_grad_norm_(ours, max_norm), torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    )
    for a, b in zip(grads(ours), grads(theirs), strict=True):
        assert_same_bits(a, b)
    gradlab.clip_grad_value_(ours, max_norm / 10)
    torch.nn.utils.clip_grad_value_(theirs, max_norm / 10)
    for a, b in zip(grads(ours), grads(theirs), strict=True):
        assert_same_bits(a, b)


@pytest.mark.parametrize(
    ("dtype", "real"), [(torch.complex64, torch.float32), (torch.complex128, torch.float64)]
)
@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.5, inf])
@pytest.mark.parametrize("foreach", [None, False])
def test_complex_gradients_have_torch_real_dtype_and_bits(dtype, real, norm_type, foreach):
    gen = torch.Generator().manual_seed(5)
    ours = []
    for shape in [(3,), (2, 2), ()]:
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.randn(shape, dtype=dtype, generator=gen)
        ours.append(p)
    theirs = copy_params(ours)
    total = gradlab.get_total_norm(grads(ours), norm_type, foreach=foreach)
    assert total.dtype == real
    assert_same_bits(total, torch.nn.utils.get_total_norm(grads(ours), norm_type, foreach=foreach))
    exact = torch.linalg.vector_norm(
        torch.cat([g.reshape(-1).to(torch.complex128) for g in grads(ours)]), norm_type
    )
    assert math.isclose(float(total), float(exact), rel_tol=1e-6)
    max_norm = 0.5 * float(total)
    assert_same_bits(
        gradlab.clip_grad_norm_(ours, max_norm, norm_type, foreach=foreach),
        torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type, foreach=foreach),
    )
    for a, b in zip(grads(ours), grads(theirs), strict=True):
        assert_same_bits(a, b)


# ---------------------------------------------------------------- two-phase API


def _sharded_norm(params, ranks=4):
    """What an all-reduce over ``ranks`` equal shards would give: not the local norm."""
    return torch.nn.utils.get_total_norm(grads(params)) * math.sqrt(ranks)


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize("max_norm", [0.0, 1.0, 5.0, 1e6, inf])
def test_clip_grads_with_norm_is_torch(foreach, max_norm):
    ours = make_params([(4, 3), (5,), ()], seed=6)
    theirs = copy_params(ours)
    total = _sharded_norm(ours)
    assert gradlab.clip_grads_with_norm_(ours, max_norm, total, foreach=foreach) is None
    torch.nn.utils.clip_grads_with_norm_(theirs, max_norm, total, foreach=foreach)
    for a, b in zip(grads(ours), grads(theirs), strict=True):
        assert_same_bits(a, b)


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize("max_norm", [0.0, 1.0, 5.0, 1e6, inf])
@pytest.mark.parametrize("bad", [None, nan, inf])
def test_grad_ignore_with_norm_zeroes_exactly_when_torch_would_rescale(foreach, max_norm, bad):
    ours = make_params([(4, 3), (5,), ()], seed=7)
    total = _sharded_norm(ours)
    if bad is not None:
        total = torch.tensor(bad)
    clipped = copy_params(ours)
    before = [g.clone() for g in grads(ours)]
    torch.nn.utils.clip_grads_with_norm_(clipped, max_norm, total, foreach=foreach)
    torch_rescales = not all(same_bits(a, b) for a, b in zip(grads(clipped), before, strict=True))
    assert gradlab.grad_ignore_with_norm_(ours, max_norm, total, foreach=foreach) is None
    for g, old in zip(grads(ours), before, strict=True):
        assert_same_bits(g, torch.zeros_like(old) if torch_rescales else old)


def test_norm_then_with_norm_is_the_one_call():
    for one_call, second_phase in [
        (gradlab.clip_grad_norm_, gradlab.clip_grads_with_norm_),
        (gradlab.grad_ignore_norm_, gradlab.grad_ignore_with_norm_),
    ]:
        for max_norm in (0.5, 1e6):
            a = make_params([(4, 3), (5,)], seed=8, scale=2.0)
            b = copy_params(a)
            total_a = one_call(a, max_norm, 3.5)
            total_b = gradlab.get_total_norm(grads(b), 3.5)
            second_phase(b, max_norm, total_b)
            assert_same_bits(total_a, total_b)
            for x, y in zip(grads(a), grads(b), strict=True):
                assert_same_bits(x, y)


@pytest.mark.parametrize("fn", [gradlab.clip_grads_with_norm_, gradlab.grad_ignore_with_norm_])
@pytest.mark.parametrize("total", [1.0, torch.ones(2), torch.tensor(1), None])
def test_with_norm_refuses_a_total_norm_that_is_not_a_0_dim_float_tensor(fn, total):
    params = make_params([(3,)], seed=9)
    before = [g.clone() for g in grads(params)]
    with pytest.raises(ValueError, match="total_norm"):
        fn(params, 1.0, total)
    for g, old in zip(grads(params), before, strict=True):
        assert_same_bits(g, old)


# ------------------------------------------------------------------------- 16-bit


def test_float16_norm_above_65504_torch_zeroes_everything_gradlab_clips():
    # 64 entries of 10000: the true norm is 80000, above float16's largest 65504.
    ours = make_params([(8, 8)], dtype=torch.float16)
    ours[0].grad.fill_(10000.0)
    theirs = copy_params(ours)
    torch_total = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert torch_total.dtype == torch.float16 and torch.isinf(torch_total)
    assert torch.equal(theirs[0].grad, torch.zeros(8, 8, dtype=torch.float16))  # all lost
    total = gradlab.clip_grad_norm_(ours, 1.0)
    assert total.dtype == torch.float32 and float(total) == 80000.0
    # The true direction, scaled to the norm 1: every entry 1/8.
    torch.testing.assert_close(
        ours[0].grad.double(), torch.full((8, 8), 0.125, dtype=torch.float64), rtol=1e-3, atol=0
    )


# -------------------------------------------------------------- large norm_type


def _exact_norm(tensors, p: int) -> float:
    """The p-norm of all entries, from the exact rational sum of |x|^p (p an integer)."""
    from fractions import Fraction

    total = sum(Fraction(abs(x)) ** p for t in tensors for x in t.double().reshape(-1).tolist())
    if total == 0:
        return 0.0
    return math.exp((math.log(total.numerator) - math.log(total.denominator)) / p)


@pytest.mark.parametrize("p", [8, 100, 1000])
@pytest.mark.parametrize("scale", [1e-3, 1e3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("foreach", [None, False])
def test_large_norm_type_neither_underflows_nor_overflows(p, scale, dtype, foreach):
    """16-bit gradients included: each is divided by its largest entry in float32 (in
    16 bits every ratio was rounded, 3e-4 off at p = 8 in bfloat16)."""
    if dtype == torch.float16 and scale > 1:
        scale = 1e2  # 1e3 * a normal sample overflows float16 itself
    params = make_params([(6, 5), (7,), ()], dtype=dtype, seed=10, scale=scale)
    exact = _exact_norm(grads(params), p)
    total = gradlab.get_total_norm(grads(params), p, foreach=foreach)
    assert math.isclose(float(total), exact, rel_tol=1e-5)
    # The decision is right just above and just below the exact norm.
    for factor, kept in [(1.001, True), (0.999, False)]:
        trial = copy_params(params)
        before = [g.clone() for g in grads(trial)]
        gradlab.grad_ignore_norm_(trial, factor * exact, p, foreach=foreach)
        for g, old in zip(grads(trial), before, strict=True):
            assert_same_bits(g, old if kept else torch.zeros_like(old))


def test_large_norm_type_is_the_case_where_the_plain_sum_fails():
    # The premise of the test above: |g|^p in float32 underflows (or overflows).
    small = make_params([(40, 30)], seed=10, scale=1e-3)
    large = make_params([(40, 30)], seed=10, scale=1e3)
    assert float(torch.nn.utils.get_total_norm(grads(small), 100.0)) == 0.0
    assert math.isinf(float(torch.nn.utils.get_total_norm(grads(large), 100.0)))


@pytest.mark.parametrize("bad", [nan, inf])
def test_large_norm_type_of_nonfinite_and_zero_gradients(bad):
    params = make_params([(3,), (4,)], seed=11)
    params[1].grad[2] = bad
    total = gradlab.get_total_norm(grads(params), 100.0)
    assert math.isnan(float(total)) if math.isnan(bad) else math.isinf(float(total))
    zeros = [torch.zeros(3), torch.zeros(0), torch.zeros(())]
    assert_same_bits(gradlab.get_total_norm(zeros, 100.0), torch.tensor(0.0))
