r"""Self-checking exercises of the chapter "Accumulation and many processes".

:func:`check_global_norm` runs a student's ``global_norm(local_norms, p)``, the norm
of a gradient split across ranks put together from each rank's local norm, on a fixed
battery of cases, and prints one verdict as :mod:`gradlab_book.exercises` does. The
expected values are computed here, independently, in float64 with :mod:`math`:

.. math::
    \|g\|_p = \Bigl(\sum_r n_r^p\Bigr)^{1/p}
            = M\,\Bigl(\sum_r (n_r / M)^p\Bigr)^{1/p},\quad M = \max_r n_r,
    \qquad \|g\|_\infty = \max_r n_r ,

NaN if any :math:`n_r` is NaN, inf if any is inf (and none is NaN).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import torch

from gradlab_book.exercise_kit import (
    answer,
    num,
    say,
    value_text,
)

__all__ = ["check_global_norm", "expected_global_norm"]

_NAN, _INF = math.nan, math.inf


def expected_global_norm(local_norms: Sequence[float], p: float) -> float:
    """The p-norm of the whole from the ranks' p-norms, in float64 (no overflow)."""
    norms = [float(n) for n in local_norms]
    if any(math.isnan(n) for n in norms):
        return _NAN
    if any(math.isinf(n) for n in norms):
        return _INF
    if not norms:
        return 0.0
    m = max(norms)
    if p == _INF or m == 0:
        return m
    return m * math.fsum((n / m) ** p for n in norms) ** (1.0 / p)


# (title, local norms, p, hint shown when it fails)
_CASES: list[tuple[str, list[float], float, str]] = [
    ("two ranks, p=2", [3.0, 4.0], 2.0, "For p = 2: the square root of the sum of squares."),
    ("two ranks, p=1", [3.0, 4.0], 1.0, "For p = 1 the local norms simply add up."),
    ("two ranks, p=inf", [3.0, 4.0], _INF, "For p = inf: the largest local norm."),
    ("four ranks, p=2", [1.5, 2.0, 0.5, 1.0], 2.0, ""),
    ("three ranks, p=3", [1.0, 2.0, 3.0], 3.0, "(sum of n_r ** p) ** (1 / p)."),
    ("one rank, p=2", [2.5], 2.0, "With one rank the global norm is its local norm."),
    ("all zero, p=2", [0.0, 0.0], 2.0, "The norm of zeros is 0 (mind a division by 0)."),
    ("all zero, p=inf", [0.0, 0.0], _INF, ""),
    (
        "NaN on rank 1, p=2",
        [3.0, _NAN],
        2.0,
        "A NaN on one rank must make the global norm NaN.",
    ),
    (
        "NaN on rank 0, p=inf",
        [_NAN, 3.0],
        _INF,
        "A NaN on one rank must make the global norm NaN.",
    ),
    (
        "NaN on rank 1, p=inf",
        [3.0, _NAN],
        _INF,
        "Python's max(3.0, nan) is 3.0 and max(nan, 3.0) is nan (every comparison "
        "with NaN is false): the same pitfall as gloo's all_reduce MAX. Test for NaN "
        "separately (math.isnan).",
    ),
    ("inf on rank 0, p=2", [_INF, 1.0], 2.0, "An infinite local norm makes the whole inf."),
    ("inf and NaN, p=inf", [_INF, _NAN], _INF, "NaN wins over inf."),
    (
        "two ranks of norms 3e200 and 4e200, p=2",
        [3e200, 4e200],
        2.0,
        "(3e200) ** 2 overflows to inf in float64: divide by the largest local norm "
        "M first, and multiply the result by M.",
    ),
    (
        "two ranks of norms 3e-200 and 4e-200, p=2",
        [3e-200, 4e-200],
        2.0,
        "(3e-200) ** 2 underflows to 0 in float64: divide by the largest local norm "
        "M first, and multiply the result by M.",
    ),
]


def _as_float(value: object) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().to("cpu", torch.float64).reshape(()))
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _agrees(expected: float, got: float) -> bool:
    if math.isnan(expected):
        return math.isnan(got)
    if math.isinf(expected):
        return got == expected
    return math.isfinite(got) and math.isclose(got, expected, rel_tol=1e-12, abs_tol=0.0)


def check_global_norm(fn: Callable) -> bool:
    """Check ``fn(local_norms, p)``: the global p-norm from the ranks' local p-norms.

    ``local_norms`` is a list of Python floats, one per rank (each rank's p-norm of
    its part of the gradient); ``p`` a positive float or ``math.inf``. The answer
    must return a number (or a 0-dim tensor) within 1e-12 relative of the float64
    value of :func:`expected_global_norm`, NaN where a rank's norm is NaN and inf
    where one is inf; it must not change ``local_norms``.
    """
    if not callable(fn):
        say([f"Expected a function, got {value_text(fn)}."])
        return False
    for index, (title, norms, p, hint) in enumerate(_CASES, start=1):
        given = list(norms)
        shown = "[" + ", ".join(num(n) for n in norms) + "]"
        call_text = f"fn({shown}, {num(p)})"
        header = [f"Case {index} of {len(_CASES)} fails: {title}.", f"  call:     {call_text}"]
        ok, result, _ = answer(fn, call_text, header, [], given, p, watch_host=False)
        if not ok:
            return False
        got = _as_float(result)
        expected = expected_global_norm(norms, p)
        if got is None or not _agrees(expected, got):
            say(
                [
                    *header,
                    f"  expected: {num(expected)}",
                    f"  yours:    {value_text(result) if got is None else num(got)}",
                    *([f"  Hint: {hint}"] if hint else []),
                ]
            )
            return False
        same = len(given) == len(norms) and all(
            (a == b) or (math.isnan(a) and math.isnan(b))
            for a, b in zip(given, norms, strict=False)
        )
        if not same:
            say([*header, "  Your function changed local_norms: leave its input as it is."])
            return False
    say([f"All {len(_CASES)} cases pass."])
    return True
