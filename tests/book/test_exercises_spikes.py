"""The loss-spike chapter's check accepts correct answers and rejects the usual mistakes.

The correct answers are written here: the closed form of the chapter and a loop over
Adam's recursion. The reference the check uses is compared with the closed form on a
grid, so that the check itself is held to the mathematics.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradlab_book import exercises_spikes as ex


def closed_form(ratio, level, beta2):
    excess, need = (1 - beta2) * (ratio * ratio - 1), 1 / level**2 - 1
    if excess <= need:
        return 0
    return max(0, math.ceil(math.log(need / excess) / math.log(beta2)) - 1)


def by_loop(ratio, level, beta2):
    v, n = 1 + (1 - beta2) * (ratio * ratio - 1), 0
    while 1 / math.sqrt(beta2 * v + 1 - beta2) < level:
        v, n = beta2 * v + 1 - beta2, n + 1
    return n


def without_minus_one(ratio, level, beta2):
    excess, need = (1 - beta2) * ratio * ratio, 1 / level**2 - 1
    if excess <= need:
        return 0
    return max(0, math.ceil(math.log(need / excess) / math.log(beta2)) - 1)


def counting_the_spike_step(ratio, level, beta2):
    return closed_form(ratio, level, beta2) + (closed_form(ratio, level, beta2) > 0)


def fixed_beta2(ratio, level, beta2):
    return closed_form(ratio, level, 0.999)


def real_valued(ratio, level, beta2):
    excess, need = (1 - beta2) * (ratio * ratio - 1), 1 / level**2 - 1
    return math.log(need / excess) / math.log(beta2) if excess > need else 0.0


def not_written(ratio, level, beta2):
    raise NotImplementedError


@pytest.mark.parametrize(
    "answer",
    [
        closed_form,
        by_loop,
        lambda r, lv, b: np.int64(closed_form(r, lv, b)),
        lambda r, lv, b: float(closed_form(r, lv, b)),
        lambda r, lv, b: torch.tensor(closed_form(r, lv, b)),
    ],
)
def test_correct_answers_pass(answer, capsys):
    assert ex.check_suppressed_steps(answer) is True
    assert capsys.readouterr().out == f"All {len(ex._CASES)} cases pass.\n"


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (without_minus_one, "ratio^2 - 1"),
        (counting_the_spike_step, "off by one"),
        (fixed_beta2, "beta2 from the arguments"),
        (real_valued, "Expected an integer"),
        (not_written, "Not implemented yet"),
        (lambda r, lv, b: None, "Expected an integer"),
        (lambda r, lv, b: True, "Expected an integer"),
        (lambda r, lv, b: 1 / 0, "ZeroDivisionError"),
        (42, "Expected a function"),
    ],
)
def test_wrong_answers_fail_with_a_reason(answer, says, capsys):
    assert ex.check_suppressed_steps(answer) is False
    out = capsys.readouterr().out
    assert says in out
    assert out.rstrip().endswith("Not passed.") or "Expected a function" in out


def test_the_verdict_is_deterministic(capsys):
    ex.check_suppressed_steps(without_minus_one)
    first = capsys.readouterr().out
    ex.check_suppressed_steps(without_minus_one)
    assert capsys.readouterr().out == first


@pytest.mark.parametrize("beta2", [0.5, 0.9, 0.99, 0.999])
@pytest.mark.parametrize("level", [0.3, 0.5, 0.7, 0.9, 0.99])
@pytest.mark.parametrize("ratio", [1.0, 1.7, 4.0, 30.0, 300.0])
def test_the_reference_is_the_closed_form(ratio, level, beta2):
    excess, need = (1 - beta2) * (ratio * ratio - 1), 1 / level**2 - 1
    if excess > need:
        t_star = math.log(need / excess) / math.log(beta2)
        if abs(t_star - round(t_star)) < 1e-6:
            pytest.skip("on a boundary: rounding decides")
    assert ex.reference_suppressed_steps(ratio, level, beta2) == closed_form(ratio, level, beta2)


def test_no_case_sits_on_a_boundary():
    for ratio, level, beta2, _ in ex._CASES:
        excess, need = (1 - beta2) * (ratio * ratio - 1), 1 / level**2 - 1
        if excess > need:
            t_star = math.log(need / excess) / math.log(beta2)
            assert abs(t_star - round(t_star)) > 1e-3, (ratio, level, beta2)
