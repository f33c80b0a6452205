"""check_global_norm passes a correct answer and names the first wrong case of others."""

from __future__ import annotations

import math

import pytest
import torch

from gradlab_book.exercises_distributed import check_global_norm, expected_global_norm


def _correct(local_norms, p):
    norms = [float(n) for n in local_norms]
    if any(math.isnan(n) for n in norms):
        return math.nan
    m = max(norms)
    if p == math.inf or m == 0 or math.isinf(m):
        return m
    return m * math.fsum((n / m) ** p for n in norms) ** (1 / p)


def _as_tensor(local_norms, p):
    t = torch.tensor(local_norms, dtype=torch.float64)
    if bool(torch.isnan(t).any()):
        return torch.tensor(math.nan)
    m = t.max()
    if p == math.inf or m == 0 or torch.isinf(m):
        return m
    return m * torch.linalg.vector_norm(t / m, p)


def _naive(local_norms, p):
    if p == math.inf:
        return max(local_norms)
    return sum(n**p for n in local_norms) ** (1 / p)


def _no_nan_check(local_norms, p):
    m = max(local_norms)
    if p == math.inf or m == 0 or math.isinf(m):
        return m
    return m * sum((n / m) ** p for n in local_norms) ** (1 / p)


def _sum(local_norms, p):
    return sum(local_norms)


def _mutates(local_norms, p):
    value = _correct(local_norms, p)
    local_norms.append(0.0)
    return value


def _stub(local_norms, p):
    raise NotImplementedError


def _raises(local_norms, p):
    raise ZeroDivisionError("boom")


def test_correct_answers_pass(capsys):
    assert check_global_norm(_correct) is True
    assert check_global_norm(_as_tensor) is True
    assert capsys.readouterr().out.count("cases pass.") == 2


@pytest.mark.parametrize(
    "fn, words",
    [
        (_naive, ["Case 11", "max(3.0, nan)"]),
        (_no_nan_check, ["Case 11", "expected: nan"]),
        (_sum, ["Case 1 ", "p=2"]),
        (_mutates, ["changed local_norms"]),
        (_stub, ["Not implemented"]),
        (_raises, ["ZeroDivisionError", "boom"]),
        (3, ["Expected a function"]),
    ],
)
def test_wrong_answers_fail_with_a_reason(capsys, fn, words):
    assert check_global_norm(fn) is False
    out = capsys.readouterr().out
    for word in words:
        assert word in out, out


def test_overflow_case_is_reached_by_an_answer_correct_otherwise(capsys):
    def unscaled(local_norms, p):
        if any(math.isnan(n) for n in local_norms):
            return math.nan
        if p == math.inf:
            return max(local_norms)
        return sum(n**p for n in local_norms) ** (1 / p)

    assert check_global_norm(unscaled) is False
    assert "3e200" in capsys.readouterr().out


@pytest.mark.parametrize(
    "norms, p, want",
    [
        ([3.0, 4.0], 2.0, 5.0),
        ([3.0, 4.0], 1.0, 7.0),
        ([3.0, 4.0], math.inf, 4.0),
        ([3e200, 4e200], 2.0, 5e200),
        ([3e-200, 4e-200], 2.0, 5e-200),
        ([0.0, 0.0], 2.0, 0.0),
        ([], 2.0, 0.0),
    ],
)
def test_expected_values(norms, p, want):
    assert expected_global_norm(norms, p) == pytest.approx(want, rel=1e-14)


def test_expected_nonfinite():
    assert math.isnan(expected_global_norm([3.0, math.nan], math.inf))
    assert math.isnan(expected_global_norm([math.inf, math.nan], 2.0))
    assert expected_global_norm([math.inf, 1.0], 2.0) == math.inf
