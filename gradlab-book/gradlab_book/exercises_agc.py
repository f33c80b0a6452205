r"""Self-checking exercise of the AGC chapter: unit-wise adaptive gradient clipping.

The conventions of :mod:`gradlab_book.exercises`: :func:`check_agc` takes the
student's function, runs it on a fixed battery of small, seeded cases and prints one
short verdict in plain words, ``All N cases pass.`` or the *first* case that fails (its
input, what was expected, what came back and, where the answer matches a typical
mistake, which one). It returns True or False and never raises because an answer is
wrong. The output is deterministic.

The expected gradients are computed here, in float64 on the host, from the rule that
the chapter states (and :func:`gradlab.adaptive.agc_` documents); gradlab is not
called, so the check also holds ``agc_`` to its documentation. For every unit
:math:`i` (an output row of a tensor with two or more dims, that is its dims 1..n; the
whole tensor for a vector), with :math:`\rho` the ``clip_factor`` and
:math:`\varepsilon_W` the ``eps``:

.. math::
    G_i \leftarrow G_i \cdot \min\Bigl(1,
        \frac{\rho \max(\|W_i\|_2, \varepsilon_W)}{\|G_i\|_2}\Bigr),

applied only where :math:`\|G_i\| > \rho\max(\|W_i\|, \varepsilon_W)` (strictly). A unit
whose gradient norm is NaN or infinite, or whose weight norm is NaN, is left exactly as
it is.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gradlab_book.exercise_kit import (
    answer,
    identical,
    num,
    say,
    tensor_text,
    value_text,
)

__all__ = ["check_agc"]

_INF = math.inf
_NAN = math.nan
_DEFAULT_CLIP_FACTOR = 0.01
_DEFAULT_EPS = 1e-3


# --------------------------------------------------------------- the reference


def _norms64(t: Tensor, unit: str) -> Tensor:
    """The 2-norm of every unit of a float64 tensor, kept broadcastable over the tensor.

    ``unit`` is ``"rows"`` (the rule: dims 1..n, the whole tensor for a vector) or one
    typical mistake: ``"whole"`` (one norm for the tensor), ``"columns"`` (dim 0 of a
    matrix), ``"last"`` (the last dim only), ``"entries"`` (each entry of a vector).
    """
    d = t.dim()
    if unit == "whole" or (d <= 1 and unit != "entries"):
        return torch.linalg.vector_norm(t, keepdim=True)
    if unit == "entries":
        return t.abs() if d == 1 else _norms64(t, "rows")
    if unit == "columns" and d == 2:
        return torch.linalg.vector_norm(t, dim=0, keepdim=True)
    if unit == "last":
        return torch.linalg.vector_norm(t, dim=-1, keepdim=True)
    return torch.linalg.vector_norm(t, dim=tuple(range(1, d)), keepdim=True)


def _agc64(weight: Tensor, grad: Tensor, rho: float, eps: float, mistake: str = "") -> Tensor:
    """The clipped gradient in float64; ``mistake`` names one typical wrong answer
    (``""``, the default, gives the right one)."""
    w = weight.detach().to("cpu", torch.float64)
    g = grad.detach().to("cpu", torch.float64)
    unit = mistake if mistake in ("whole", "columns", "last", "entries") else "rows"
    wn, gn = _norms64(w, unit), _norms64(g, unit)
    if mistake == "squared":
        wn, gn = wn**2, gn**2
    if mistake == "no_floor":
        floor = wn
    elif mistake == "add_eps":
        floor = wn + eps
    else:  # max(||W_i||, eps), a NaN norm staying NaN
        floor = torch.where(wn < eps, torch.full_like(wn, eps), wn)
    bound = rho * floor
    finite = gn < _INF  # a norm is >= 0 or NaN: false for NaN and inf
    over = finite & (gn > bound)  # strictly over; false where the bound is NaN
    one = torch.ones_like(gn)
    if mistake == "by_rho":
        coef = torch.where(over, torch.full_like(gn, rho), one)
    elif mistake == "clip_all":
        coef = torch.where(finite, bound / gn, one)
    elif mistake == "nonfinite":
        coef = torch.clamp(bound / gn, max=1.0)  # NaN and inf * 0 spread over the unit
    else:
        coef = torch.where(over, bound / gn, one)
    return g * coef


_MISTAKES: tuple[tuple[str, str], ...] = (
    (
        "nonfinite",
        "A unit whose gradient norm is NaN or infinite, or whose weight norm is NaN, must "
        "come back exactly as it was: scaling it turns inf into NaN (inf * 0) and spreads "
        "NaN over the unit. Scale only where torch.isfinite(g_norm) & (g_norm > bound) "
        "(a comparison with NaN is false).",
    ),
    (
        "no_floor",
        "The bound is clip_factor * max(||W_i||, eps): a unit whose weights are zero, or "
        "smaller than eps, is measured against eps (torch.clamp(w_norm, min=eps)), "
        "otherwise a zero-initialised unit could never move.",
    ),
    (
        "add_eps",
        "The floor is max(||W_i||, eps), not ||W_i|| + eps: eps only replaces a weight "
        "norm that is smaller than eps.",
    ),
    (
        "whole",
        "Your norms are over the whole tensor: AGC takes one norm per unit, an output row "
        "(the norm over dims 1..n, keepdim=True), for the weight and its gradient alike.",
    ),
    (
        "columns",
        "Your units are columns (the norm over dim 0): a unit is an output row, row i of "
        "the weight, the norm over dims 1..n (dim=tuple(range(1, grad.dim())), "
        "keepdim=True).",
    ),
    (
        "last",
        "A unit is a whole output row: for a convolution's weight (out, in, kh, kw) the "
        "norm runs over dims 1, 2 and 3 (one output channel's filter), not only over the "
        "last dim.",
    ),
    (
        "entries",
        "A 1-d tensor (a bias) is a single unit: take the norm of the whole vector, not "
        "the size of each entry.",
    ),
    (
        "squared",
        "Use the 2-norm, the square root of the sum of squares (torch.linalg.vector_norm), "
        "not the sum of squares.",
    ),
    (
        "by_rho",
        "A clipped unit is multiplied by clip_factor * max(||W_i||, eps) / ||G_i||, so "
        "that its norm becomes exactly the bound, not by clip_factor itself.",
    ),
    (
        "clip_all",
        "A unit whose gradient norm is at most its bound is left as it is: the factor is "
        "min(1, bound / ||G_i||), so only units with ||G_i|| > bound are scaled.",
    ),
)


# -------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class _Case:
    title: str
    weight: Tensor
    grad: Tensor
    clip_factor: float | None  # None: called without clip_factor and eps (the defaults)
    eps: float = _DEFAULT_EPS
    parameter: bool = False  # the weight handed over as an nn.Parameter
    hint: str = ""


def _t(values, dtype=torch.float32) -> Tensor:
    return torch.tensor(values, dtype=dtype)


def _seeded(shape, seed: int, dtype=torch.float32) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).round(decimals=2).to(dtype)


def _conv(dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A (4, 3, 3, 3) convolution weight and a gradient whose four output channels have
    norms of about 0.05, 0.5, 5 and 0.005 times their weights'."""
    weight = _seeded((4, 3, 3, 3), 21, dtype)
    scale = torch.tensor([0.01, 0.1, 1.0, 0.001], dtype=torch.float64).reshape(4, 1, 1, 1)
    grad = (_seeded((4, 3, 3, 3), 22, torch.float64) * scale).to(dtype)
    return weight, grad


def _cases() -> list[_Case]:
    f64 = torch.float64
    rows = (
        _t([[1.0, 2.0, 2.0, 0.0], [0.0, 3.0, 0.0, 4.0], [2.0, 0.0, 1.0, 2.0]]),
        _t([[0.1, 0.0, 0.0, 0.0], [0.0, 0.6, 0.0, 0.8], [1.2, -1.6, 0.0, 0.0]]),
    )
    conv32, conv64 = _conv(torch.float32), _conv(f64)
    unit_hint = (
        "Reduce over dims 1..n with keepdim=True, so that each unit's coefficient "
        "broadcasts over its row; a 1-d tensor is one unit."
    )
    nonfinite_w = _t([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    return [
        _Case(
            "a 3x4 weight, clip_factor=0.1: row 0 under its bound, rows 1 and 2 over",
            *rows,
            0.1,
            hint=unit_hint,
        ),
        _Case(
            "a 2x3 weight whose row 1 is all zeros (the eps floor)",
            _t([[0.3, 0.4, 0.0], [0.0, 0.0, 0.0]]),
            _t([[0.01, 0.0, 0.0], [0.3, 0.0, -0.4]]),
            0.1,
            hint=unit_hint,
        ),
        _Case(
            "a 1-d bias of 4 entries (one unit), over its bound",
            _t([0.5, -0.2, 0.0, 0.1]),
            _t([0.2, 0.3, 0.1, -0.05]),
            0.5,
            hint="A 1-d tensor (a bias) is a single unit: the norm of the whole vector.",
        ),
        _Case(
            "a bias initialised at zero, gradient norm 1 (the eps floor)",
            _t([0.0, 0.0, 0.0]),
            _t([0.6, 0.8, 0.0]),
            0.01,
            hint="A 1-d tensor (a bias) is a single unit: the norm of the whole vector.",
        ),
        _Case(
            "a 4-d convolution weight (4, 3, 3, 3), float32: one unit per output channel",
            *conv32,
            0.05,
            hint=unit_hint,
        ),
        _Case(
            "the same convolution weight in float64, clip_factor=0.02",
            *conv64,
            0.02,
            hint=unit_hint,
        ),
        _Case(
            "a 2x2 float64 weight with eps=0.5, larger than both row norms",
            _t([[0.12, 0.16], [0.03, 0.04]], f64),
            _t([[0.3, 0.4], [0.0, 0.02]], f64),
            0.1,
            eps=0.5,
        ),
        _Case(
            "the weight of a layer, an nn.Parameter (requires_grad=True), clip_factor=0.1",
            *rows,
            0.1,
            parameter=True,
        ),
        _Case(
            "a 2x3 weight whose row 0 has a zero gradient: it stays zero",
            _t([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]),
            _t([[0.0, 0.0, 0.0], [5.0, 0.0, 0.0]]),
            0.1,
        ),
        _Case(
            "a NaN in row 0's gradient: row 0 comes back as it was, row 1 is clipped",
            nonfinite_w,
            _t([[_NAN, 0.5], [3.0, 4.0], [0.01, 0.0]]),
            0.1,
        ),
        _Case(
            "an inf in row 0's gradient: row 0 comes back as it was, row 1 is clipped",
            nonfinite_w,
            _t([[_INF, 1.0], [3.0, 4.0], [0.01, 0.0]]),
            0.1,
        ),
        _Case(
            "a NaN in row 0's weights: row 0 is left as it is, row 1 is clipped",
            _t([[_NAN, 1.0], [0.0, 1.0]]),
            _t([[3.0, 4.0], [3.0, 4.0]]),
            0.1,
        ),
        _Case(
            "called without clip_factor and eps: the defaults are 0.01 and 1e-3",
            _t([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]),
            _t([[0.01, 0.0, 0.0], [0.001, 0.0, 0.0], [0.0, 0.05, 0.0]]),
            None,
        ),
    ]


# ------------------------------------------------------------------ the check


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return (1e-5, 1e-10) if dtype == torch.float32 else (1e-9, 1e-15)


def _close(expected: Tensor, got: Tensor, dtype: torch.dtype) -> bool:
    """Same shape and values within the dtype's tolerance; NaN matches NaN, inf inf."""
    if tuple(expected.shape) != tuple(got.shape):
        return False
    rtol, atol = _tolerance(dtype)
    got64 = got.detach().to("cpu", torch.float64)
    return bool(torch.allclose(expected, got64, rtol=rtol, atol=atol, equal_nan=True))


def _unit_norms_text(t: Tensor) -> str:
    norms = _norms64(t.detach().to("cpu", torch.float64), "rows").reshape(-1)
    return "[" + ", ".join(num(v) for v in norms.tolist()) + "]"


def _unit_name(case: _Case, index: int) -> str:
    if case.grad.dim() <= 1:
        return "the tensor (a vector is one unit)"
    return f"row {index}" if case.grad.dim() == 2 else f"output channel {index}"


def _first_wrong_unit(case: _Case, expected: Tensor, got: Tensor) -> str:
    if case.grad.dim() <= 1:
        return _unit_name(case, 0)
    for i in range(expected.shape[0]):
        if not _close(expected[i], got[i], case.grad.dtype):
            return _unit_name(case, i)
    return _unit_name(case, 0)


def _nonfinite_units(case: _Case) -> Tensor:
    """A bool per unit (broadcastable): the units that the rule leaves alone."""
    w = _norms64(case.weight.to(torch.float64), "rows")
    g = _norms64(case.grad.to(torch.float64), "rows")
    return ~(g < _INF) | torch.isnan(w)


def _default_text(fn: Callable) -> str:
    """What the answer's signature says its defaults are, where it says so."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ""
    shown = []
    for name, wanted in (("clip_factor", _DEFAULT_CLIP_FACTOR), ("eps", _DEFAULT_EPS)):
        p = parameters.get(name)
        if p is None or p.default is inspect.Parameter.empty:
            continue
        if p.default != wanted:
            shown.append(f"{name}={p.default!r}")
    return f"  Your signature has {', '.join(shown)}." if shown else ""


def _inputs(case: _Case) -> tuple[Tensor, Tensor]:
    """Fresh copies of the case's weight and gradient, as the answer receives them."""
    grad = case.grad.clone()
    if case.parameter:
        weight = nn.Parameter(case.weight.clone())
        weight.grad = grad
        return weight, grad
    return case.weight.clone(), grad


def check_agc(fn: Callable) -> bool:
    r"""Check ``fn(weight, grad, clip_factor=0.01, eps=1e-3)``: unit-wise AGC of one tensor.

    The answer returns the clipped gradient as a new tensor, of ``grad``'s shape and
    dtype: every unit :math:`i` (an output row, that is dims 1..n of ``grad``; a 1-d
    tensor, such as a bias, is one unit) multiplied by
    :math:`\min(1, \rho\max(\|W_i\|_2, \varepsilon_W)/\|G_i\|_2)`, with :math:`\rho` the
    ``clip_factor`` and :math:`\varepsilon_W` the ``eps``, so that only units with
    :math:`\|G_i\| > \rho\max(\|W_i\|, \varepsilon_W)` change. A unit whose gradient norm
    is NaN or infinite, or whose weight norm is NaN, comes back exactly as it was (as
    :func:`gradlab.adaptive.agc_` leaves it). ``weight`` and ``grad`` must not be
    modified, and no tensor value may be read on the host. The values must match the
    float64 reference within a relative 1e-5 for float32 and 1e-9 for float64; the
    defaults are checked once, on a call without ``clip_factor`` and ``eps``.
    """
    if not callable(fn):
        say([f"Expected a function, got {value_text(fn)}."])
        return False
    cases = _cases()
    for index, case in enumerate(cases, start=1):
        rho = _DEFAULT_CLIP_FACTOR if case.clip_factor is None else case.clip_factor
        eps = _DEFAULT_EPS if case.clip_factor is None else case.eps
        if case.clip_factor is None:
            call_text, kwargs = "fn(weight, grad)", {}
        else:
            kwargs = {"clip_factor": case.clip_factor, "eps": case.eps}
            call_text = f"fn(weight, grad, clip_factor={num(rho)}, eps={num(eps)})"
        header = [
            f"Case {index} of {len(cases)} fails: {case.title}.",
            f"  call:        {call_text}",
            f"  weight:      {tensor_text(case.weight)}",
            f"  grad:        {tensor_text(case.grad)}",
            f"  ||W_i||:     {_unit_norms_text(case.weight)} (one norm per unit)",
            f"  ||G_i||:     {_unit_norms_text(case.grad)}",
        ]
        hint = [f"  Hint: {case.hint}"] if case.hint else []
        weight, grad = _inputs(case)
        ok, result, detector = answer(fn, call_text, header, hint, weight, grad, **kwargs)
        if not ok:
            return False
        expected = _agc64(case.weight, case.grad, rho, eps)

        def fail(*lines: str, _header=header) -> bool:
            say([*_header, *lines])
            return False

        # the inputs
        if not identical(weight.detach(), case.weight):
            return fail(
                "  Your function changed `weight`: AGC only reads the weights. Leave them "
                "as they are (work on the norms, never write into the weight)."
            )
        if not identical(grad.detach(), case.grad):
            return fail(
                "  Your function changed `grad` in place: return the clipped gradient as a "
                "new tensor (grad * coef, not grad.mul_(coef)) and leave `grad` as it was."
            )
        # the return value
        if not isinstance(result, Tensor):
            return fail(
                f"  expected:    {tensor_text(expected.to(case.grad.dtype))}",
                f"  yours:       {value_text(result)}",
                "  Return the clipped gradient, a new tensor of the shape and dtype of grad.",
            )
        if tuple(result.shape) != tuple(case.grad.shape):
            return fail(
                f"  expected:    a tensor of shape {tuple(case.grad.shape)}",
                f"  yours:       a tensor of shape {tuple(result.shape)}",
                "  Return a tensor of grad's shape: reduce with keepdim=True, so that each "
                "unit's coefficient broadcasts over its unit.",
            )
        if result.dtype != case.grad.dtype:
            dtype = str(case.grad.dtype).replace("torch.", "")
            return fail(
                f"  Your gradient is {str(result.dtype).replace('torch.', '')}: return it in "
                f"grad's dtype, {dtype} here."
            )
        if not _close(expected, result, case.grad.dtype):
            lines = [
                f"  expected:    {tensor_text(expected.to(case.grad.dtype))}",
                f"  yours:       {tensor_text(result)}",
                f"  ||G_i|| after, expected {_unit_norms_text(expected)}, "
                f"yours {_unit_norms_text(result)}",
                f"  (the first wrong unit is {_first_wrong_unit(case, expected, result)})",
            ]
            why = ""
            if case.clip_factor is None:
                why = (
                    "  Called without clip_factor and eps, your function must use "
                    "clip_factor=0.01 and eps=1e-3, the defaults of gradlab.adaptive.agc_."
                )
                signature = _default_text(fn)
                lines += [why, signature] if signature else [why]
                return fail(*lines)
            for mistake, text in _MISTAKES:
                wrong = _agc64(case.weight, case.grad, rho, eps, mistake)
                if _close(expected, wrong, case.grad.dtype):
                    continue
                if _close(wrong, result, case.grad.dtype):
                    why = f"  {text}"
                    break
            if not why:
                alone = _nonfinite_units(case).expand_as(expected)
                if bool(alone.any()):
                    res64 = result.detach().to("cpu", torch.float64)
                    keep = torch.where(alone, expected, res64)
                    if _close(expected, keep, case.grad.dtype):
                        why = f"  {_MISTAKES[0][1]}"
            return fail(*lines, *([why] if why else []))
        if detector is not None and detector.count:
            operation = detector.operations[0]
            return fail(
                f"  Your function reads a tensor value on the host, through {operation}; "
                "decide on the device (torch.where, torch.clamp, a tensor coefficient)."
            )
    say([f"All {len(cases)} cases pass."])
    return True
