r"""Self-checking exercises of Part IV: a threshold from a warm-up window, one ZClip step.

The conventions of :mod:`gradlab_book.exercises`: a ``check_*`` function takes the
student's function, runs it on a fixed battery of small, seeded cases and prints one
short verdict in plain words, ``All N cases pass.`` or the *first* case that fails (its
input, what was expected, what came back and, where the answer matches a typical
mistake, which one). It returns True or False and never raises because an answer is
wrong. The output is deterministic.

The expected values are computed here, in float64 on the host, from the formulas the
exercises state; gradlab is not called, so a check also holds gradlab to them.

* :func:`check_warmup_threshold`: a threshold chosen from the norms of a warm-up window
  alone (no labels saying which steps were bad), robust to NaN and inf in the window.
* :func:`check_zclip_step`: one step of ZClip after its warm-up (the z-score, the
  adaptive-scaling threshold, the optional cap ``max_norm`` on it at every step and the
  EMA update with the value clipped at the uncapped threshold), a non-finite norm
  leaving the state unchanged. The semantics of :class:`gradlab.adaptive.ZClip` and of
  the reference implementation (``bluorion-com/ZClip``), which feeds its EMA the
  adaptive ``clip_val``, before ``max_grad_norm`` is merged in.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradlab_book.exercise_kit import (
    answer,
    num,
    say,
    value_text,
)

__all__ = ["check_warmup_threshold", "check_zclip_step"]

_INF = math.inf
_NAN = math.nan


# --------------------------------------------------------------------- helpers


def _as_number(value: object) -> float | None:
    """A real number, a numpy scalar or a one-element real tensor or array as a float;
    ``None`` for anything else (bools included)."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            return None
        return float(value.detach().to("cpu", torch.float64).reshape(()))
    if isinstance(value, np.ndarray):
        if value.size != 1 or value.dtype.kind not in "iuf":
            return None
        return float(value.reshape(()))
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _close(expected: float, got: float, rtol: float) -> bool:
    """Equal within ``rtol`` (relative); NaN matches NaN and inf matches inf of its sign."""
    if math.isnan(expected) or math.isnan(got):
        return math.isnan(expected) and math.isnan(got)
    if math.isinf(expected) or math.isinf(got):
        return expected == got
    return abs(got - expected) <= rtol * max(abs(expected), 1e-300)


def _n(x: float) -> str:
    """A result with seven significant digits (nan, inf as words)."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.7g}"


# ----------------------------------------------------------- warm-up threshold


def _linear(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of sorted values by linear interpolation between
    the two nearest ranks: ``r = q/100 (n - 1)`` (numpy's and torch's default)."""
    r = q / 100.0 * (len(sorted_values) - 1)
    lo, hi = math.floor(r), math.ceil(r)
    return sorted_values[lo] + (r - lo) * (sorted_values[hi] - sorted_values[lo])


def _threshold64(values: Sequence[float], q: float) -> float:
    finite = sorted(v for v in values if math.isfinite(v))
    return _linear(finite, q) if finite else _INF


def _threshold_mistakes(values: Sequence[float], q: float) -> list[tuple[float, str]]:
    """What typical wrong answers return on ``values``, each with its explanation."""
    finite = sorted(v for v in values if math.isfinite(v))
    not_nan = sorted(v for v in values if not math.isnan(v))
    has_nan = any(math.isnan(v) for v in values)
    has_inf = any(math.isinf(v) for v in values)
    out: list[tuple[float, str]] = []
    if has_inf and not_nan:
        out.append(
            (
                _linear(not_nan, q),
                "Your threshold counts the infinite norms: drop them as well as NaN. "
                "np.nanpercentile and torch.nanquantile skip NaN but keep inf; filter "
                "with math.isfinite or torch.isfinite.",
            )
        )
    if has_nan:
        out.append(
            (
                _NAN,
                "A NaN in the window made your threshold NaN: keep only the finite norms "
                "(math.isfinite or torch.isfinite) before taking the percentile.",
            )
        )
    if not finite:
        return out
    n = len(finite)
    r = q / 100.0 * (n - 1)
    if q > 1:
        out.append(
            (
                _linear(finite, q / 100.0),
                f"Your value is the {num(q / 100)}th percentile, not the {num(q)}th: "
                "numpy.percentile takes q from 0 to 100, torch.quantile and numpy.quantile "
                "take q/100 from 0 to 1. Convert once.",
            )
        )
    order = (
        "an order statistic of the finite norms ({}), not the linear interpolation between "
        "the two nearest ranks, r = q/100 (n - 1) (method='linear', the default of "
        "numpy.percentile and torch.quantile)"
    )
    rank = max(math.ceil(q / 100.0 * n) - 1, 0)
    for value, which in (
        (finite[math.floor(r)], "the lower of the two nearest"),
        (finite[math.ceil(r)], "the higher of the two nearest"),
        (finite[min(rank, n - 1)], "the nearest-rank percentile"),
    ):
        out.append((value, f"Your value is {order.format(which)}."))
    out.append((sum(finite) / n, "Your value is the mean of the finite norms, not a percentile."))
    out.append((finite[-1], "Your value is the largest finite norm, not a percentile."))
    return out


@dataclass(frozen=True)
class _WindowCase:
    title: str
    values: tuple[float, ...]
    kind: str  # "list", "tuple", "float32", "float64", "numpy", "0-dim tensors"
    percentile: float | None  # None: called without it (the default, 90)


def _lognormal(n: int, seed: int, scale: float = 1.0) -> list[float]:
    """``n`` seeded, positive, heavy-tailed norms, rounded to 4 significant digits."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(0.5 * torch.randn(n, generator=gen, dtype=torch.float64)) * scale
    return [float(f"{v:.4g}") for v in raw.tolist()]


def _window_cases() -> list[_WindowCase]:
    base = _lognormal(50, 11)
    spiky = _lognormal(99, 12)
    spiky.insert(40, 1000.0)  # one bad batch in the window
    with_nan = list(base)
    with_nan[7] = _NAN
    with_inf = list(base)
    with_inf[3] = with_inf[30] = _INF
    both = _lognormal(20, 13, 2.0)
    both[2], both[9], both[15] = _NAN, _INF, _INF
    lonely = [_NAN, _NAN, 1.5, _NAN]
    return [
        _WindowCase("50 norms in a Python list, percentile=90", tuple(base), "list", 90.0),
        _WindowCase("the same 50 norms in a float64 tensor", tuple(base), "float64", 90.0),
        _WindowCase("the same 50 norms in a float32 tensor", tuple(base), "float32", 90.0),
        _WindowCase("called without percentile: the default is 90", tuple(base), "list", None),
        _WindowCase("51 norms, percentile=50 (the median)", tuple(_lognormal(51, 14)), "list", 50),
        _WindowCase(
            "100 norms with one bad batch of 1000, percentile=95, a numpy array",
            tuple(spiky),
            "numpy",
            95.0,
        ),
        _WindowCase(
            "30 norms as a list of 0-dim tensors (as gradlab.get_total_norm returns them)",
            tuple(_lognormal(30, 15)),
            "0-dim tensors",
            90.0,
        ),
        _WindowCase("a tuple of 40 norms, percentile=99", tuple(_lognormal(40, 16)), "tuple", 99),
        _WindowCase("percentile=0: the smallest norm", tuple(base), "list", 0.0),
        _WindowCase("percentile=100: the largest norm", tuple(base), "list", 100.0),
        _WindowCase("one NaN among 50 norms, a list", tuple(with_nan), "list", 90.0),
        _WindowCase("two +inf among 50 norms, a float32 tensor", tuple(with_inf), "float32", 90.0),
        _WindowCase(
            "one NaN and two +inf among 20 norms, a list, percentile=95",
            tuple(both),
            "list",
            95.0,
        ),
        _WindowCase("one finite norm among NaNs, a float64 tensor", tuple(lonely), "float64", 90),
        _WindowCase(
            "no finite norm at all: [nan, inf, nan], a list", (_NAN, _INF, _NAN), "list", 90.0
        ),
        _WindowCase("an empty window: an empty list", (), "list", 90.0),
        _WindowCase("an empty window: an empty float32 tensor", (), "float32", 90.0),
    ]


def _window_arg(case: _WindowCase) -> Any:
    values = list(case.values)
    if case.kind == "list":
        return values
    if case.kind == "tuple":
        return tuple(values)
    if case.kind == "numpy":
        return np.array(values, dtype=np.float64)
    if case.kind == "0-dim tensors":
        return [torch.tensor(v) for v in values]
    dtype = torch.float32 if case.kind == "float32" else torch.float64
    return torch.tensor(values, dtype=dtype)


def _window_values(arg: Any, case: _WindowCase) -> list[float]:
    """The values as the student's function receives them (float32 rounding included)."""
    if isinstance(arg, Tensor):
        return arg.to(torch.float64).tolist()
    if case.kind == "0-dim tensors":
        return [float(t.double()) for t in arg]
    return [float(v) for v in arg]


def _window_text(values: Sequence[float]) -> str:
    if len(values) <= 8:
        return "[" + ", ".join(num(v) for v in values) + "]"
    finite = [v for v in values if math.isfinite(v)]
    nans = sum(math.isnan(v) for v in values)
    infs = sum(math.isinf(v) for v in values)
    extra = "".join(f", {count} {name}" for count, name in ((nans, "NaN"), (infs, "inf")) if count)
    return (
        f"<{len(values)} norms, finite ones from {num(min(finite))} to {num(max(finite))}{extra}>"
    )


def _unchanged(arg: Any, original: Any) -> bool:
    if isinstance(arg, Tensor):
        return torch.equal(torch.nan_to_num(arg, nan=-1.0), torch.nan_to_num(original, nan=-1.0))
    if isinstance(arg, np.ndarray):
        return np.array_equal(arg, original, equal_nan=True)
    if isinstance(arg, list) and arg and isinstance(arg[0], Tensor):
        return len(arg) == len(original) and all(
            torch.equal(a, b) for a, b in zip(arg, original, strict=True)
        )
    return len(arg) == len(original) and all(
        (math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(arg, original, strict=True)
    )


def _copy(arg: Any) -> Any:
    if isinstance(arg, Tensor | np.ndarray):
        return arg.copy() if isinstance(arg, np.ndarray) else arg.clone()
    if isinstance(arg, list):
        return [a.clone() if isinstance(a, Tensor) else a for a in arg]
    return arg


def check_warmup_threshold(fn: Callable) -> bool:
    """Check ``fn(norms, percentile=90)``: a threshold from a warm-up window alone.

    ``norms`` is the window: a list, a tuple, a numpy array, a 1-d float32 or float64
    tensor, or a list of 0-dim tensors. The answer must be the ``percentile``-th
    percentile (0 to 100, default 90) of the *finite* norms, by linear interpolation
    between the two nearest ranks, ``r = percentile/100 (n - 1)`` (the default method of
    ``numpy.percentile`` and ``torch.quantile``), and ``inf`` when the window holds no
    finite norm (no threshold yet). NaN and inf entries are left out. The result is a
    number (a Python or numpy float, or a one-element tensor), equal to the float64
    reference within a relative 1e-6 (so float32 arithmetic passes); the window must not
    be modified. No labels are involved: nothing says which steps were bad.
    """
    if not callable(fn):
        say([f"Expected a function, got {value_text(fn)}."])
        return False
    cases = _window_cases()
    for index, case in enumerate(cases, start=1):
        arg = _window_arg(case)
        original = _copy(arg)
        values = _window_values(arg, case)
        q = 90.0 if case.percentile is None else float(case.percentile)
        call_text = "fn(norms)" if case.percentile is None else f"fn(norms, {num(q)})"
        header = [
            f"Case {index} of {len(cases)} fails: {case.title}.",
            f"  call:     {call_text}",
            f"  norms:    {_window_text(values)}",
        ]
        args = (arg,) if case.percentile is None else (arg, case.percentile)
        hint = []
        if not any(math.isfinite(v) for v in values):
            hint = [
                "  Hint: with no finite norm in the window there is nothing to set a "
                "threshold from: return math.inf (no clipping yet)."
            ]
        ok, result, _ = answer(fn, call_text, header, hint, *args, watch_host=False)
        if not ok:
            return False
        expected = _threshold64(values, q)
        got = _as_number(result)
        if got is None:
            say(
                [
                    *header,
                    f"  expected: the number {_n(expected)}",
                    f"  yours:    {value_text(result)}",
                    "  Your function must return one number (a float or a 0-dim tensor).",
                ]
            )
            return False
        rtol = 1e-6  # float32 arithmetic is fine: a threshold needs no more digits
        if not _close(expected, got, rtol):
            lines = [*header, f"  expected: {_n(expected)}", f"  yours:    {_n(got)}"]
            if math.isinf(expected):
                lines.append(
                    "  With no finite norm in the window there is nothing to set a threshold "
                    "from: return math.inf (no clipping yet)."
                )
            elif case.percentile is None:
                lines.append("  Called without a percentile, your function must use 90.")
            else:
                for value, why in _threshold_mistakes(values, q):
                    if not _close(expected, value, rtol) and _close(value, got, rtol):
                        lines.append(f"  {why}")
                        break
            say(lines)
            return False
        if not _unchanged(arg, original):
            say([*header, "  Your function modified the window it was given: leave it as it is."])
            return False
    say([f"All {len(cases)} cases pass."])
    return True


# --------------------------------------------------------------------- ZClip step


def _zclip64(
    x: float,
    mean: float,
    var: float,
    alpha: float,
    z_thresh: float,
    eps: float,
    max_norm: float | None = None,
    *,
    adaptive: bool = True,
    always_finite: bool = False,
    feed_raw: bool = False,
    feed_boundary: bool = False,
    feed_capped: bool = False,
    cap_spikes_only: bool = False,
    no_cap: bool = False,
    old_mean: bool = False,
    std_is_var: bool = False,
    eps_in_root: bool = False,
    no_eps: bool = False,
    swapped: bool = False,
    update_nonfinite: bool = False,
    nan_threshold: bool = False,
    inf_meets_inf: bool = False,
    ema_first: bool = False,
) -> tuple[float, float, float]:
    """One ZClip step in float64: ``(tau, new_mean, new_var)``. The keywords turn on
    one typical mistake each (the defaults give the right answer)."""
    if ema_first and math.isfinite(x):  # the statistics updated with x before the threshold
        mean_after = alpha * mean + (1 - alpha) * x
        var = alpha * var + (1 - alpha) * (x - mean_after) ** 2
        mean = mean_after
    std = var if std_is_var else math.sqrt(var + eps) if eps_in_root else math.sqrt(var)
    denominator = std if no_eps or eps_in_root else std + eps
    z = (x - mean) / denominator if denominator > 0 else math.copysign(_INF, x - mean)
    if math.isnan(x):
        z = _NAN
    spike = (not z <= z_thresh) if nan_threshold else z > z_thresh
    if always_finite:
        tau = mean + z_thresh * std
    elif not spike or (inf_meets_inf and math.isinf(x)):
        tau = _INF
    elif adaptive:
        tau = mean + z_thresh**2 * std / z
    else:
        tau = mean + z_thresh * std
    capped = tau
    if max_norm is not None and not no_cap and (spike or not cap_spikes_only):
        capped = min(tau, max_norm)
    if ema_first or (not math.isfinite(x) and not update_nonfinite):
        return capped, mean, var
    bound = mean + z_thresh * std if feed_boundary else capped if feed_capped else tau
    fed = x if feed_raw else min(x, bound)
    keep, new = (1 - alpha, alpha) if swapped else (alpha, 1 - alpha)
    new_mean = keep * mean + new * fed
    centre = mean if old_mean else new_mean
    new_var = keep * var + new * (fed - centre) ** 2
    return capped, new_mean, new_var


_ZCLIP_MISTAKES: tuple[tuple[dict[str, bool], str], ...] = (
    (
        {"nan_threshold": True},
        "For a NaN norm the z-score is NaN and every comparison with NaN is false: test "
        "`z > z_thresh` (false for NaN, so tau = inf), not `not z <= z_thresh`.",
    ),
    (
        {"update_nonfinite": True},
        "A NaN or infinite norm must leave the mean and the variance unchanged: return "
        "them as they were (one such norm would otherwise poison the EMA for good).",
    ),
    (
        {"inf_meets_inf": True},
        "An infinite norm has z = inf > z_thresh, so its threshold is mean + "
        "z_thresh**2 * std / inf = mean: a finite number, not inf.",
    ),
    (
        {"ema_first": True},
        "The threshold is computed from the statistics *before* this step; fold x into "
        "the mean and the variance only afterwards.",
    ),
    (
        {"adaptive": False},
        "Adaptive scaling: a spike's threshold is mean + z_thresh**2 * std / z, not "
        "mean + z_thresh * std.",
    ),
    (
        {"always_finite": True},
        "Below the z threshold there is no clipping: tau is inf when z <= z_thresh.",
    ),
    (
        {"cap_spikes_only": True},
        "max_norm caps the threshold at every step, not only on spikes: with z <= z_thresh "
        "the threshold is min(inf, max_norm) = max_norm.",
    ),
    (
        {"no_cap": True},
        "max_norm caps the threshold at every step: tau = min(tau, max_norm), also when "
        "z <= z_thresh (then tau = max_norm).",
    ),
    (
        {"feed_capped": True},
        "The EMA takes x clipped at the adaptive threshold *before* the cap, "
        "min(x, mean + z_thresh**2 * std / z), as the reference feeds back its clip_val: "
        "max_norm limits the step, not the statistics.",
    ),
    (
        {"feed_boundary": True},
        "The value fed back is min(x, tau) with tau the adaptive threshold "
        "mean + z_thresh**2 * std / z, not min(x, mean + z_thresh * std).",
    ),
    (
        {"feed_raw": True},
        "The EMA is updated with the clipped value min(x, tau), not with x itself.",
    ),
    (
        {"old_mean": True},
        "The variance update uses the new mean: var <- alpha * var + (1 - alpha) * "
        "(x_hat - new_mean)**2.",
    ),
    (
        {"std_is_var": True},
        "sigma is the square root of the variance: std = sqrt(var).",
    ),
    (
        {"eps_in_root": True},
        "eps is added to the standard deviation, outside the root: "
        "z = (x - mean) / (sqrt(var) + eps), not (x - mean) / sqrt(var + eps).",
    ),
    ({"no_eps": True}, "The z-score's denominator is std + eps, not std."),
    (
        {"swapped": True},
        "alpha weights the old statistics: mean <- alpha * mean + (1 - alpha) * x_hat.",
    ),
)


@dataclass(frozen=True)
class _ZCase:
    title: str
    x: float
    mean: float
    var: float
    alpha: float = 0.97
    z_thresh: float = 2.5
    eps: float = 1e-6
    max_norm: float | None = None
    tensors: bool = False  # x, mean and var as 0-dim float64 tensors
    defaults: bool = False  # called without alpha, z_thresh, eps and max_norm


def _zclip_cases() -> list[_ZCase]:
    return [
        _ZCase("an ordinary norm just above the mean (z about 0.5): no clipping", 5.5, 5.0, 1.0),
        _ZCase("a spike ten standard deviations out (x=15, mean 5, std 1)", 15.0, 5.0, 1.0),
        _ZCase("the same spike, called with the defaults", 15.0, 5.0, 1.0, defaults=True),
        _ZCase("a norm below the mean (z negative): no clipping", 3.2, 5.0, 2.25),
        _ZCase("z = 2.4, just below z_thresh = 2.5: no clipping", 7.4, 5.0, 1.0),
        _ZCase("z = 2.6, just above z_thresh = 2.5", 7.6, 5.0, 1.0),
        _ZCase(
            "a spike, x, mean and var as 0-dim float64 tensors", 0.9, 0.12, 0.0009, tensors=True
        ),
        _ZCase("a tiny spread, std 1e-4: eps matters", 0.1012, 0.1, 1e-8),
        _ZCase("a tiny spread, std 1e-3, a spike: eps outside the root", 0.13, 0.1, 1e-6),
        _ZCase("alpha=0.9, z_thresh=3, a spike of z about 20", 42.0, 2.0, 4.0, 0.9, 3.0),
        _ZCase("alpha=0.5, an ordinary norm", 1.1, 1.0, 0.04, 0.5, 2.0),
        _ZCase(
            "max_norm=4 below the spike's adaptive threshold 5.625: the cap sets tau",
            15.0,
            5.0,
            1.0,
            max_norm=4.0,
        ),
        _ZCase(
            "max_norm=1 (the reference's default) on an ordinary norm of 5.5: capped at 1",
            5.5,
            5.0,
            1.0,
            max_norm=1.0,
        ),
        _ZCase(
            "max_norm=100 above the adaptive threshold: no effect", 15.0, 5.0, 1.0, max_norm=100
        ),
        _ZCase("x is NaN: the state must not change", _NAN, 5.0, 1.0),
        _ZCase("x is +inf: the state must not change", _INF, 5.0, 1.0),
        _ZCase("x is NaN, given as 0-dim float64 tensors", _NAN, 0.3, 0.01, tensors=True),
        _ZCase("x is NaN with max_norm=2: tau is the cap", _NAN, 5.0, 1.0, max_norm=2.0),
    ]


def _zclip_args(case: _ZCase) -> tuple[tuple[Any, ...], dict[str, Any], str]:
    values = (case.x, case.mean, case.var)
    if case.tensors:
        args: tuple[Any, ...] = tuple(torch.tensor(v, dtype=torch.float64) for v in values)
        shown = ", ".join(f"tensor({num(v)})" for v in values)
    else:
        args, shown = values, ", ".join(num(v) for v in values)
    if case.defaults:
        return args, {}, f"fn({shown})"
    kwargs: dict[str, Any] = {"alpha": case.alpha, "z_thresh": case.z_thresh, "eps": case.eps}
    if case.max_norm is not None:
        kwargs["max_norm"] = case.max_norm
    more = ", ".join(f"{k}={num(v)}" for k, v in kwargs.items())
    return args, kwargs, f"fn({shown}, {more})"


def check_zclip_step(fn: Callable) -> bool:
    """Check ``fn(x, mean, var, alpha=0.97, z_thresh=2.5, eps=1e-6, max_norm=None)``: one
    ZClip step after the warm-up, returning ``(tau, new_mean, new_var)``.

    With ``std = sqrt(var)`` and ``z = (x - mean) / (std + eps)``, the adaptive threshold
    is ``t = mean + z_thresh**2 * std / z`` where ``z > z_thresh`` and ``inf`` otherwise
    (a NaN z is not above, so a NaN norm meets ``inf``; an infinite norm meets ``mean``).
    The threshold returned is ``tau = min(t, max_norm)`` at every step when ``max_norm``
    is given, ``t`` otherwise. For a finite ``x``, with ``x_hat = min(x, t)`` (the
    *uncapped* threshold, as in :class:`gradlab.adaptive.ZClip` and the reference, which
    feeds back its ``clip_val``), ``new_mean = alpha * mean + (1 - alpha) * x_hat`` and
    ``new_var = alpha * var + (1 - alpha) * (x_hat - new_mean)**2`` (the *new* mean); for
    a NaN or infinite ``x`` the mean and variance come back unchanged. ``x``, ``mean`` and
    ``var`` are Python floats or 0-dim float64 tensors; each result may be a number or a
    one-element tensor, and must match the float64 reference within a relative 1e-9.
    The defaults are checked once.
    """
    if not callable(fn):
        say([f"Expected a function, got {value_text(fn)}."])
        return False
    cases = _zclip_cases()
    for index, case in enumerate(cases, start=1):
        args, kwargs, call_text = _zclip_args(case)
        header = [f"Case {index} of {len(cases)} fails: {case.title}.", f"  call:     {call_text}"]
        hint = []
        if "max_norm" in kwargs:
            hint = [
                "  Hint: the function takes max_norm=None, a cap on the threshold at every "
                "step (ZClip's max_norm)."
            ]
        ok, result, _ = answer(fn, call_text, header, hint, *args, watch_host=False, **kwargs)
        if not ok:
            return False
        settings = (case.alpha, case.z_thresh, case.eps, case.max_norm)
        expected = _zclip64(case.x, case.mean, case.var, *settings)
        shown = ", ".join(_n(v) for v in expected)
        if not isinstance(result, tuple | list) or len(result) != 3:
            say(
                [
                    *header,
                    f"  expected: a tuple (tau, new_mean, new_var) = ({shown})",
                    f"  yours:    {value_text(result)}",
                    "  Return the three values as a tuple: return tau, new_mean, new_var.",
                ]
            )
            return False
        got = [_as_number(v) for v in result]
        if any(g is None for g in got):
            bad = next(i for i, g in enumerate(got) if g is None)
            name = ("tau", "new_mean", "new_var")[bad]
            say(
                [
                    *header,
                    f"  {name} must be a number (a float or a 0-dim tensor), got "
                    f"{value_text(result[bad])}.",
                ]
            )
            return False
        if all(_close(e, g, 1e-9) for e, g in zip(expected, got, strict=True)):
            continue
        names = [
            n
            for n, e, g in zip(("tau", "new_mean", "new_var"), expected, got, strict=True)
            if not _close(e, g, 1e-9)
        ]
        lines = [
            *header,
            f"  expected: (tau, new_mean, new_var) = ({shown})",
            f"  yours:    ({', '.join(_n(g) for g in got)})",
            f"  wrong:    {', '.join(names)}",
        ]
        for mistake, why in _ZCLIP_MISTAKES:
            wrong = _zclip64(case.x, case.mean, case.var, *settings, **mistake)
            differs = any(not _close(e, w, 1e-9) for e, w in zip(expected, wrong, strict=True))
            if differs and all(_close(w, g, 1e-9) for w, g in zip(wrong, got, strict=True)):
                lines.append(f"  {why}")
                break
        say(lines)
        return False
    say([f"All {len(cases)} cases pass."])
    return True
