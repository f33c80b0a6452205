"""check_max_loss_scale accepts correct answers and rejects the typical wrong ones.

The correct answers here are written independently of the check's own reference:
one uses torch's float16 cast itself, one the float64 arithmetic of the limit.
"""

from __future__ import annotations

import math

import pytest
import torch

from gradlab_book import exercises_precision as ex

# ------------------------------------------------------------ correct answers


def by_cast(grads):
    """Try 2**24, 2**23, ... and let torch's float16 cast decide."""
    grads = list(grads)
    for k in range(24, -25, -1):
        scale = 2.0**k
        if all(bool(torch.isfinite((g.double() * scale).to(torch.float16)).all()) for g in grads):
            return scale
    return None


def by_limit(grads):
    """The largest |entry| in float64, then the largest 2**k with 2**k m < 65520."""
    largest = torch.tensor(0.0, dtype=torch.float64)
    for g in grads:
        if g.numel():
            largest = torch.maximum(largest, g.detach().double().abs().max())
    m = float(largest)  # NaN propagates through torch.maximum
    if not math.isfinite(m):
        return None
    if m == 0:
        return 2.0**24
    k = min(24, math.floor(math.log2(65520.0 / m)))
    if 2.0**k * m >= 65520.0:  # log2 rounded up at an exact power
        k -= 1
    return 2.0**k if k >= -24 else None


@pytest.mark.parametrize("answer", [by_cast, by_limit, ex.reference_max_loss_scale])
def test_accepts_correct_answers(answer, capsys):
    assert ex.check_max_loss_scale(answer) is True
    out = capsys.readouterr().out
    assert out.startswith("All ") and out.endswith(" cases pass.\n")


def test_reference_agrees_with_torch_cast_on_random_cases():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        exponent = float(torch.empty(()).uniform_(-15, 15, generator=gen))
        g = torch.randn(7, generator=gen) * 10**exponent
        assert ex.reference_max_loss_scale([g]) == by_cast([g])


# ------------------------------------------------------------- wrong answers


def limit_65504(grads):  # the largest finite float16 as the limit: too cautious
    m = max((float(g.double().abs().max()) for g in grads if g.numel()), default=0.0)
    if not math.isfinite(m):
        return None
    for k in range(24, -25, -1):
        if 2.0**k * m <= 65504.0:
            return 2.0**k
    return None


def limit_inclusive(grads):  # 65520 itself counted as finite
    m = max((float(g.double().abs().max()) for g in grads if g.numel()), default=0.0)
    if not math.isfinite(m):
        return None
    for k in range(24, -25, -1):
        if 2.0**k * m <= 65520.0:
            return 2.0**k
    return None


def python_max(grads):  # Python's max() drops a NaN that comes after a number
    values = [float(v) for g in grads for v in g.double().abs().reshape(-1)]
    m = max(values, default=0.0)
    if math.isinf(m):
        return None
    return by_limit([torch.tensor([m])])


def first_only(grads):
    grads = list(grads)
    return by_limit(grads[:1])


def no_abs(grads):
    grads = list(grads)
    m = max((float(g.double().max()) for g in grads if g.numel()), default=0.0)
    return by_limit([torch.tensor([max(m, 0.0)])])


def no_cap(grads):
    grads = list(grads)
    result = by_limit(grads)
    if result == 2.0**24 and all(bool((g == 0).all()) for g in grads):
        return 2.0**30
    m = max((float(g.double().abs().max()) for g in grads if g.numel()), default=0.0)
    if result == 2.0**24 and m > 0:
        return 2.0 ** math.floor(math.log2(65520.0 / m))
    return result


def at_least_one(grads):  # never below 1
    result = by_limit(grads)
    return None if result is None else max(result, 1.0)


def walks_twice(grads):
    if not list(grads):  # consumes a generator
        return 2.0**24
    return by_limit(grads)


def returns_tensor(grads):
    result = by_limit(grads)
    return None if result is None else torch.tensor(result)


def returns_exponent(grads):
    result = by_limit(grads)
    return None if result is None else int(math.log2(result))


def scales_in_place(grads):
    grads = list(grads)
    result = by_limit(grads)
    for g in grads:
        g.mul_(2.0)
    return result


def raises(grads):
    raise NotImplementedError


def empty_crash(grads):
    grads = list(grads)
    return by_limit(grads) if grads[0].numel() else None


@pytest.mark.parametrize(
    "answer, fragments",
    [
        (limit_65504, ["65510", "expected 2**10 = 1024, got 2**9 = 512", "65520"]),
        (limit_inclusive, ["exactly 65520", "got 2**10", "Too large", "rounds to inf"]),
        (python_max, ["a NaN entry", "expected None", "return None"]),
        (first_only, ["largest entry in the last one", "every tensor"]),
        (no_abs, ["negative", "absolute value"]),
        (no_cap, ["no tensors at all", "at most 2**24", "cap 2**24"]),
        (at_least_one, ["up to 1e6", "expected 2**-4 = 0.0625", "below 1"]),
        (walks_twice, ["generator", "walk the iterable once"]),
        (returns_tensor, ["returned a tensor", "Python"]),
        (returns_exponent, ["expected 2**"]),
        (scales_in_place, ["changed the gradients"]),
        (raises, ["Not implemented yet"]),
        (empty_crash, ["no tensors at all", "raised IndexError"]),
    ],
)
def test_rejects_wrong_answers(answer, fragments, capsys):
    assert ex.check_max_loss_scale(answer) is False
    out = capsys.readouterr().out
    assert out.endswith("Not passed.\n"), out
    for fragment in fragments:
        assert fragment in out, out


def test_verdict_is_deterministic(capsys):
    ex.check_max_loss_scale(limit_65504)
    first = capsys.readouterr().out
    ex.check_max_loss_scale(limit_65504)
    assert capsys.readouterr().out == first


def test_docstring_says_what_is_checked():
    assert "Check" in ex.check_max_loss_scale.__doc__
