r"""Clipping by norm and by value (taught in book/algorithms/clip_norm and clip_value).

Compute functions return plain numbers in frozen dataclasses; figure functions draw
them and nothing else. Every computation runs the real :mod:`gradlab` function on a
real tensor's ``.grad`` (never a re-implementation), so the pictures show exactly what
:func:`gradlab.clip_grad_norm_` and :func:`gradlab.clip_grad_value_` do.

* :func:`norm_clip_2d` and :func:`norm_ball_figure`: a 2-D gradient and the ball of
  radius ``max_norm``; the clipped vector keeps its direction.
* :func:`compare_clipping_2d` and :func:`norm_vs_value_figure`: the same gradient
  clipped by norm and by value, and the angle between the two results.
* :func:`layer_clamping` and :func:`layer_clamp_figure`: per layer of a real model,
  how many gradient entries a value threshold clamps.
* :func:`norms_after_clipping` and :func:`norm_after_figure`: the 2-norm left after
  each kind of clipping, against the bound :math:`\sqrt{n}\,c` of value clipping.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Circle, Rectangle
from torch import Tensor, nn

import gradlab
from gradlab_book.demos import grad_holders
from gradlab_book.plots import CLIP, KEEP, NONE, THRESHOLD, new_figure

__all__ = [
    "LayerClamping",
    "NormClip2D",
    "NormVsValue2D",
    "NormsAfterClipping",
    "angle_between",
    "compare_clipping_2d",
    "example_gradient_2d",
    "layer_clamp_figure",
    "layer_clamping",
    "norm_after_figure",
    "norm_ball_figure",
    "norm_clip_2d",
    "norm_vs_value_figure",
    "norms_after_clipping",
]

Vector2 = tuple[float, float]


# ------------------------------------------------------------------------ helpers


def _as_vector2(gradient: Sequence[float]) -> Vector2:
    values = tuple(float(v) for v in gradient)
    if len(values) != 2:
        raise ValueError(f"gradient must have exactly 2 entries, got {len(values)}")
    return values  # type: ignore[return-value]


def _with_grad(gradient: Sequence[float]) -> Tensor:
    """A 2-entry float64 parameter whose ``.grad`` is ``gradient``."""
    param = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    param.grad = torch.tensor(_as_vector2(gradient), dtype=torch.float64)
    return param


def _finite(v: Sequence[float]) -> bool:
    return all(math.isfinite(x) for x in v)


def angle_between(u: Sequence[float], v: Sequence[float]) -> float:
    """The angle between two vectors in degrees, in [0, 180].

    NaN when either vector is zero or not finite: a zero vector has no direction.
    """
    a = np.asarray(u, dtype=np.float64)
    b = np.asarray(v, dtype=np.float64)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return math.nan
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return math.nan
    cosine = float(np.dot(a, b)) / (na * nb)
    return math.degrees(math.acos(min(1.0, max(-1.0, cosine))))


def example_gradient_2d(seed: int = 0) -> Vector2:
    """A real gradient with two entries, for the 2-D pictures.

    The gradient of the mean-squared error of a two-weight linear model (no bias) at
    its zero initialisation, on eight seeded samples whose targets are large enough
    that its norm is several units: big enough to be clipped by the thresholds the
    sliders offer.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 2, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([[2.5], [-0.5]], dtype=torch.float64)
    model = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        model.weight.zero_()
    nn.functional.mse_loss(model(x), y).backward()
    grad = model.weight.grad.reshape(-1)
    return float(grad[0]), float(grad[1])


# -------------------------------------------------------------- clipping by norm


@dataclass(frozen=True)
class NormClip2D:
    """A 2-D gradient before and after :func:`gradlab.clip_grad_norm_`."""

    gradient: Vector2
    clipped: Vector2
    max_norm: float
    norm_before: float  #: what ``clip_grad_norm_`` returned
    norm_after: float
    coefficient: float  #: min(1, max_norm / (norm_before + eps)), the factor applied

    @property
    def was_clipped(self) -> bool:
        """True when the coefficient is below 1 (False for a NaN coefficient)."""
        return self.coefficient < 1.0


def norm_clip_2d(gradient: Sequence[float], max_norm: float) -> NormClip2D:
    """Clip a 2-D gradient by its 2-norm with :func:`gradlab.clip_grad_norm_`."""
    param = _with_grad(gradient)
    before = float(gradlab.clip_grad_norm_(param, max_norm))
    clipped = (float(param.grad[0]), float(param.grad[1]))
    after = float(torch.linalg.vector_norm(param.grad))
    coefficient = min(1.0, max_norm / (before + gradlab.clip.EPS))
    if math.isnan(before):
        coefficient = math.nan
    return NormClip2D(_as_vector2(gradient), clipped, float(max_norm), before, after, coefficient)


# ------------------------------------------------------------- clipping by value


@dataclass(frozen=True)
class NormVsValue2D:
    """One 2-D gradient clipped by norm and by value with the same threshold."""

    gradient: Vector2
    threshold: float
    by_norm: Vector2  #: gradlab.clip_grad_norm_(max_norm=threshold)
    by_value: Vector2  #: gradlab.clip_grad_value_(clip_value=threshold)
    angle_norm: float  #: degrees between the gradient and by_norm (0 unless undefined)
    angle_value: float  #: degrees between the gradient and by_value
    angle_between: float  #: degrees between by_norm and by_value

    @property
    def norm_by_norm(self) -> float:
        return math.hypot(*self.by_norm)

    @property
    def norm_by_value(self) -> float:
        return math.hypot(*self.by_value)


def compare_clipping_2d(gradient: Sequence[float], threshold: float) -> NormVsValue2D:
    """Clip the same 2-D gradient by norm and by value, and measure the directions.

    Angles are NaN where a vector is zero or not finite (no direction to compare).
    """
    g = _as_vector2(gradient)
    threshold = float(threshold)
    if not threshold >= 0:  # NaN fails too
        # named here: it is both clips' threshold, the library would say max_norm
        raise ValueError(
            f"threshold must be a non-negative number (inf allowed), got {threshold!r}"
        )
    by_norm = norm_clip_2d(g, threshold).clipped
    param = _with_grad(g)
    gradlab.clip_grad_value_(param, threshold)
    by_value = (float(param.grad[0]), float(param.grad[1]))
    return NormVsValue2D(
        gradient=g,
        threshold=float(threshold),
        by_norm=by_norm,
        by_value=by_value,
        angle_norm=angle_between(g, by_norm),
        angle_value=angle_between(g, by_value),
        angle_between=angle_between(by_norm, by_value),
    )


# ------------------------------------------------------------------- per layer


@dataclass(frozen=True)
class LayerClamping:
    """How many entries of each gradient tensor a value threshold clamps.

    ``fractions[t][k]`` is the fraction of the entries of tensor ``k`` whose absolute
    value exceeds ``thresholds[t]``: exactly the entries that
    :func:`gradlab.clip_grad_value_` changes (NaN entries are left as they are and so
    are not counted).
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    max_abs: tuple[float, ...]  #: largest |entry| per tensor (NaN if it holds a NaN)
    thresholds: tuple[float, ...]
    fractions: tuple[tuple[float, ...], ...]


def layer_clamping(
    named_grads: Iterable[tuple[str, Tensor]], thresholds: Sequence[float]
) -> LayerClamping:
    """Clamp copies of the gradients at each threshold and count what changed."""
    pairs = [(name, grad.detach()) for name, grad in named_grads]
    names = tuple(name for name, _ in pairs)
    sizes = tuple(grad.numel() for _, grad in pairs)
    max_abs = tuple(
        float(torch.linalg.vector_norm(grad, math.inf)) if grad.numel() else 0.0
        for _, grad in pairs
    )
    fractions = []
    for threshold in thresholds:
        params = grad_holders([grad for _, grad in pairs])
        gradlab.clip_grad_value_(params, threshold)
        row = []
        for (_, grad), param in zip(pairs, params, strict=True):
            changed = (param.grad != grad) & ~(grad.isnan() & param.grad.isnan())
            row.append(float(changed.sum()) / grad.numel() if grad.numel() else 0.0)
        fractions.append(tuple(row))
    return LayerClamping(
        names, sizes, max_abs, tuple(float(t) for t in thresholds), tuple(fractions)
    )


# ------------------------------------------------------- norms after clipping


@dataclass(frozen=True)
class NormsAfterClipping:
    r"""The 2-norm and inf-norm left after clipping, for a sweep of thresholds.

    For each threshold ``c`` (used as ``max_norm`` and as ``clip_value``):
    ``by_norm[i]`` is :math:`\|g\|_2` after clipping by norm, ``by_value_two[i]`` and
    ``by_value_inf[i]`` are :math:`\|g\|_2` and :math:`\|g\|_\infty` after clipping by
    value, and ``bound[i]`` is :math:`\sqrt{n}\,c`.
    """

    n: int
    norm_before: float
    inf_before: float
    thresholds: tuple[float, ...]
    by_norm: tuple[float, ...]
    by_value_two: tuple[float, ...]
    by_value_inf: tuple[float, ...]
    bound: tuple[float, ...]


def norms_after_clipping(
    grads: Sequence[Tensor], thresholds: Sequence[float]
) -> NormsAfterClipping:
    """Clip copies of ``grads`` by norm and by value at each threshold; measure norms."""
    grads = [g.detach() for g in grads]
    n = sum(g.numel() for g in grads)
    by_norm, two, inf, bound = [], [], [], []
    for c in thresholds:
        normed = grad_holders(grads)
        gradlab.clip_grad_norm_(normed, c)
        by_norm.append(float(gradlab.get_total_norm([p.grad for p in normed])))
        valued = grad_holders(grads)
        gradlab.clip_grad_value_(valued, c)
        two.append(float(gradlab.get_total_norm([p.grad for p in valued])))
        inf.append(float(gradlab.get_total_norm([p.grad for p in valued], math.inf)))
        bound.append(math.sqrt(n) * float(c))
    return NormsAfterClipping(
        n=n,
        norm_before=float(gradlab.get_total_norm(grads)),
        inf_before=float(gradlab.get_total_norm(grads, math.inf)),
        thresholds=tuple(float(c) for c in thresholds),
        by_norm=tuple(by_norm),
        by_value_two=tuple(two),
        by_value_inf=tuple(inf),
        bound=tuple(bound),
    )


# --------------------------------------------------------------------- drawing


def _arrow(ax: Axes, v: Vector2, color: str, label: str, style: str = "-", width: float = 2.0):
    """Draw ``v`` from the origin (a zero vector is drawn as a dot)."""
    if v[0] == 0.0 and v[1] == 0.0:
        ax.plot([0.0], [0.0], "o", color=color, label=label, markersize=6)
        return
    ax.annotate(
        "",
        xy=v,
        xytext=(0.0, 0.0),
        arrowprops={"arrowstyle": "-|>", "color": color, "lw": width, "linestyle": style},
    )
    ax.plot([], [], style, color=color, lw=width, label=label)  # legend entry


def _square_axes(ax: Axes, extent: float) -> None:
    ax.set_xlim(-extent, extent)
    ax.set_ylim(-extent, extent)
    ax.set_aspect("equal")
    ax.axhline(0.0, color="#bbbbbb", lw=0.8, zorder=0)
    ax.axvline(0.0, color="#bbbbbb", lw=0.8, zorder=0)
    ax.set_xlabel("$g_1$")
    ax.set_ylabel("$g_2$")


def _extent(gradient: Vector2, threshold: float, extent: float | None) -> float:
    if extent is not None and math.isfinite(extent) and extent > 0:
        return float(extent)
    sizes = [abs(x) for x in gradient if math.isfinite(x)] + [threshold]
    size = max([s for s in sizes if math.isfinite(s)] + [1.0])
    return 1.25 * size


def _fmt(x: float) -> str:
    return "NaN" if math.isnan(x) else f"{x:.3g}"


def _not_finite_note(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", wrap=True)


def norm_ball_figure(
    max_norm: float, gradient: Sequence[float] | None = None, extent: float | None = None
) -> Figure:
    """A 2-D gradient, the ball of radius ``max_norm`` and the norm-clipped gradient.

    ``gradient`` defaults to :func:`example_gradient_2d`; ``extent`` fixes the axes to
    ``[-extent, extent]`` so that the picture does not rescale as a slider moves.
    """
    g = example_gradient_2d() if gradient is None else _as_vector2(gradient)
    result = norm_clip_2d(g, max_norm)
    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot()
    _square_axes(ax, _extent(g, max_norm, extent))
    if math.isfinite(max_norm):
        ax.add_patch(
            Circle((0, 0), max_norm, fill=True, facecolor="#f2f2f2", edgecolor=THRESHOLD, lw=1.2)
        )
    ax.plot([], [], color=THRESHOLD, lw=1.2, label=rf"ball $\|g\|_2 \leq \tau = {max_norm:.3g}$")
    if not _finite(g):
        _not_finite_note(ax, "the gradient is not finite:\nclipping by norm returns NaN or zeros")
    else:
        _arrow(ax, g, NONE, f"gradient, norm {_fmt(result.norm_before)}", width=1.6)
        color = CLIP if result.was_clipped else KEEP
        what = "clipped" if result.was_clipped else "kept (inside the ball)"
        _arrow(ax, result.clipped, color, f"{what}, norm {_fmt(result.norm_after)}", width=2.6)
    coefficient = _fmt(result.coefficient)
    ax.set_title(
        rf"clip by norm: $c = \min(1, \tau / (\|g\|_2 + \varepsilon))$ = {coefficient}",
        fontsize=10,
    )
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=9)
    return fig


def norm_vs_value_figure(
    threshold: float, gradient: Sequence[float] | None = None, extent: float | None = None
) -> Figure:
    """The same 2-D gradient clipped by norm (left) and by value (right).

    Both use ``threshold``: as the radius of the ball and as the half-width of the
    square :math:`|g_i| \\le c`. The title gives the angle between the two results.
    """
    g = example_gradient_2d() if gradient is None else _as_vector2(gradient)
    result = compare_clipping_2d(g, threshold)
    fig = new_figure(6.4, 3.6)
    left, right = fig.subplots(1, 2)
    size = _extent(g, threshold, extent)
    for ax in (left, right):
        _square_axes(ax, size)
    if math.isfinite(threshold):
        left.add_patch(
            Circle((0, 0), threshold, facecolor="#f2f2f2", edgecolor=THRESHOLD, lw=1.2, zorder=0)
        )
        right.add_patch(
            Rectangle(
                (-threshold, -threshold),
                2 * threshold,
                2 * threshold,
                facecolor="#f2f2f2",
                edgecolor=THRESHOLD,
                lw=1.2,
                zorder=0,
            )
        )
    left.set_title(rf"by norm, $\|g\|_2 \leq {threshold:.3g}$", fontsize=10)
    right.set_title(rf"by value, $|g_i| \leq {threshold:.3g}$", fontsize=10)
    if not _finite(g):
        for ax in (left, right):
            _not_finite_note(ax, "gradient not finite")
        fig.suptitle("a NaN or inf gradient has no direction to compare", fontsize=10)
        return fig
    for ax, clipped, angle in (
        (left, result.by_norm, result.angle_norm),
        (right, result.by_value, result.angle_value),
    ):
        _arrow(ax, g, NONE, "gradient", width=1.4)
        changed = clipped != g
        _arrow(ax, clipped, CLIP if changed else KEEP, "clipped" if changed else "unchanged")
        ax.text(
            0.03,
            0.03,
            f"norm {_fmt(math.hypot(*clipped))}\nturned {_fmt(angle)}°",
            transform=ax.transAxes,
            fontsize=8.5,
            va="bottom",
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8},
        )
    right.legend(loc="upper left", fontsize=8)
    angle = result.angle_between
    title = (
        "angle between the two clipped gradients: undefined (a zero vector)"
        if math.isnan(angle)
        else f"angle between the two clipped gradients: {angle:.1f}°"
    )
    fig.suptitle(title, fontsize=10.5)
    return fig


def layer_clamp_figure(threshold: float, named_grads: Sequence[tuple[str, Tensor]] = ()) -> Figure:
    """Per gradient tensor: its largest |entry| (left) and the fraction clamped (right)."""
    data = layer_clamping(named_grads, [threshold])
    fig = new_figure(6.4, 3.6)
    left, right = fig.subplots(1, 2, sharey=True)
    if not data.names:
        _not_finite_note(left, "no gradients")
        return fig
    y = np.arange(len(data.names))
    maxima = np.asarray(data.max_abs, dtype=np.float64)
    finite = np.isfinite(maxima) & (maxima > 0)
    shown = np.where(finite, maxima, np.nan)
    left.barh(y, shown, color=NONE)
    left.set_xscale("log")
    positive = maxima[finite]
    marks = [*positive.tolist(), *([threshold] if 0 < threshold < math.inf else [])]
    low = min([*marks, 1.0]) / 3
    high = max([*marks, 3 * low]) * 3
    left.set_xlim(low, high)
    if 0 < threshold < math.inf:
        left.axvline(threshold, color=THRESHOLD, lw=1.4, label=f"c = {threshold:.3g}")
        left.legend(loc="lower right", fontsize=8)
    for k in np.flatnonzero(~np.isfinite(maxima)):
        left.text(low, k, " NaN/inf", va="center", fontsize=8)
    left.set_yticks(y, data.names)
    left.invert_yaxis()
    left.set_xlabel(r"largest $|g_{ij}|$ in the tensor")
    fractions = np.asarray(data.fractions[0])
    right.barh(y, fractions, color=CLIP)
    right.set_xlim(0.0, 1.0)
    right.set_xlabel("fraction of entries clamped")
    for k, f in enumerate(fractions):
        right.text(min(f, 0.8) + 0.02, k, f"{f:.0%}", va="center", fontsize=8)
    fig.suptitle(f"clip_grad_value_ with c = {threshold:.3g}", fontsize=10.5)
    return fig


def norm_after_figure(data: NormsAfterClipping) -> Figure:
    """The 2-norm left after clipping by norm and by value, against sqrt(n)·c."""
    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot()
    c = np.asarray(data.thresholds, dtype=np.float64)
    c = np.where(c > 0, c, np.nan)  # a log axis has no place for c = 0
    ax.plot(c, data.bound, color=THRESHOLD, ls="--", lw=1.2, label=r"bound $\sqrt{n}\,c$")
    ax.plot(c, data.by_value_two, color=CLIP, lw=2.2, label=r"$\|g\|_2$ after clip by value")
    ax.plot(c, data.by_norm, color=KEEP, lw=2.2, label=r"$\|g\|_2$ after clip by norm")
    if math.isfinite(data.norm_before):
        ax.axhline(data.norm_before, color=NONE, lw=1, label=r"$\|g\|_2$ unclipped")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("threshold c (max_norm = clip_value = c)")
    ax.set_ylabel("2-norm after clipping")
    ax.set_title(f"n = {data.n} gradient entries", fontsize=10)
    ax.legend(fontsize=8.5, loc="upper left")
    return fig
