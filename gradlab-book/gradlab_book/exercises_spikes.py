r"""Self-checking exercises of the loss-spike chapter (book/adaptive/loss_spikes).

Same pattern as :mod:`gradlab_book.exercises`: a ``check_*`` function runs the
student's answer on a fixed battery of cases, compares it with a reference computed
independently in float64 on the host, and prints ``All N cases pass.`` or the first
case that fails, with what was expected and a hint. It returns True or False and
never raises because an answer is wrong.

The reference is Adam's second-moment recursion itself, stepped one step at a time
in float64, not the closed form the exercise asks for, so a closed form that is off
by one step, or that forgets the :math:`-1` in :math:`\rho^2 - 1`, is caught.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

from gradlab_book.exercise_kit import (
    Raised,
    call,
    num,
    say,
    value_text,
)

__all__ = ["check_suppressed_steps", "reference_suppressed_steps"]


def reference_suppressed_steps(ratio: float, level: float, beta2: float) -> int:
    r"""The answer by the recursion, in float64: how many steps :math:`t \ge 1` after
    the spike have :math:`1/\sqrt{v_t} < \text{level}`.

    Steady state :math:`v = 1` (gradient 1, bias correction 1); at step 0 the
    gradient is :math:`\rho`, from step 1 on it is 1 again:
    :math:`v_0 = \beta_2 + (1-\beta_2)\rho^2`,
    :math:`v_t = \beta_2 v_{t-1} + (1-\beta_2)`. :math:`v_t` decreases towards 1, so
    the suppressed steps are :math:`1, \dots, n`.
    """
    v = beta2 + (1 - beta2) * ratio * ratio
    count = 0
    while True:
        v = beta2 * v + (1 - beta2)
        if not 1 / math.sqrt(v) < level:
            return count
        count += 1


# (ratio, level, beta2, what a wrong answer has probably missed)
_CASES = (
    (100.0, 0.5, 0.999, ""),
    (100.0, 0.9, 0.999, ""),
    (1000.0, 0.1, 0.999, ""),
    (
        1.5,
        0.95,
        0.9,
        "a small spike: the excess of v_0 over 1 is (1 - beta2)(ratio^2 - 1)",
    ),
    (30.0, 0.5, 0.99, ""),
    (100.0, 0.5, 0.95, ""),
    (5.0, 0.8, 0.9, ""),
    (10.0, 0.5, 0.999, "a spike too small to push 1/sqrt(v) below the level: 0 steps"),
    (1.0, 0.5, 0.999, "no spike at all (ratio 1): 0 steps"),
    (100.0, 0.999, 0.999, "a level close to 1 takes a long time to reach"),
)


def _diagnose(ratio: float, level: float, beta2: float, count: int, expected: int) -> str:
    """What a wrong ``count`` has probably missed, where a usual mistake explains it."""
    if beta2 != 0.999 and count == reference_suppressed_steps(ratio, level, 0.999):
        return "use beta2 from the arguments, not 0.999"
    # an excess of (1 - beta2) ratio^2 is the recursion with ratio^2 + 1 in place of ratio^2
    if count == reference_suppressed_steps(math.sqrt(ratio * ratio + 1), level, beta2):
        return "the excess of v_0 over 1 is (1 - beta2)(ratio^2 - 1), not (1 - beta2) ratio^2"
    if abs(count - expected) == 1:
        return (
            "off by one: count the steps t >= 1 with v_t > 1/level^2, the spike's own "
            "step 0 not included"
        )
    return ""


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _integer(value: object) -> int | None:
    """``value`` as an int if it is an integer (int, integral float, NumPy or 0-dim
    integer tensor); None otherwise."""
    if isinstance(value, bool):
        return None
    if hasattr(value, "numel") and callable(value.numel):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype.is_complex:
            return None
        return int(value.item())
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    return None


def check_suppressed_steps(fn: Callable) -> bool:
    r"""Check ``fn(ratio, level, beta2) -> int``: the number of steps after a spike
    during which Adam's second moment shrinks the step below ``level`` times its
    usual size.

    The contract: a coordinate has had gradient 1 for ever, so Adam's
    :math:`v = 1` (bias correction 1). At step 0 its gradient is ``ratio`` (at
    least 1), from step 1 on it is 1 again. Return how many of the steps
    :math:`t = 1, 2, \dots` have :math:`1/\sqrt{v_t} < \text{level}`
    (``0 < level < 1``, ``0 < beta2 < 1``), as an integer. Ten cases, compared
    exactly with the float64 recursion (:func:`reference_suppressed_steps`).
    """
    if not callable(fn):
        say([f"Expected a function, got {value_text(fn)}."])
        return False
    for ratio, level, beta2, why in _CASES:
        call_text = f"fn(ratio={num(ratio)}, level={num(level)}, beta2={num(beta2)})"
        expected = reference_suppressed_steps(ratio, level, beta2)
        try:
            got = call(fn, call_text, ratio, level, beta2)
        except Raised as raised:
            say([f"Case: {call_text}.", *raised.lines, "Not passed."])
            return False
        count = _integer(got)
        if count is None:
            say(
                [
                    f"Case: {call_text}.",
                    f"  Expected an integer, {_steps(expected)}; got {value_text(got)}.",
                    "  Round: the answer counts whole steps (math.ceil or math.floor).",
                    "Not passed.",
                ]
            )
            return False
        if count != expected:
            lines = [f"Case: {call_text}.", f"  Expected {_steps(expected)}, got {count}."]
            hint = _diagnose(ratio, level, beta2, count, expected) or why
            if hint:
                lines.append(f"  Hint: {hint}.")
            say([*lines, "Not passed."])
            return False
    say([f"All {len(_CASES)} cases pass."])
    return True
