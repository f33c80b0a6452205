r"""p-norms, unit balls, per-group vs global clipping (taught in book/foundations/norms).

Compute functions return plain numbers and NumPy arrays (tested against torch and the
mathematics); figure functions draw them and are what the chapter's explorable
figures call.

* :func:`unit_ball` traces the boundary :math:`\{v \in \mathbb{R}^2 : \|v\|_p = 1\}`.
* :func:`real_gradient_2d` is the gradient of a two-weight linear model.
* :func:`mlp_gradients` is a small MLP's gradients, named, for the clipping demos.
* :func:`group_clipping` clips a gradient by its global norm and, separately, group
  by group, and measures how far apart the two results are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from gradlab.clip import clip_grad_norm_, get_total_norm
from gradlab_book.demos import grad_holders, regression_data, small_mlp
from gradlab_book.plots import CLIP, KEEP, NONE, THRESHOLD, new_figure

__all__ = [
    "GroupClipping",
    "group_clipping",
    "group_clipping_figure",
    "layer_groups",
    "mlp_gradients",
    "p_norm",
    "real_gradient_2d",
    "unit_ball",
    "unit_ball_figure",
]


def _check_p(p: float) -> float:
    p = float(p)
    if math.isnan(p) or p <= 0:
        raise ValueError(f"p must be a positive number or inf, got {p!r}")
    return p


def p_norm(v: Sequence[float] | np.ndarray | Tensor, p: float) -> float:
    r""":math:`\|v\|_p` of a vector, in float64 (NaN in, NaN out)."""
    t = torch.as_tensor(np.asarray(v, dtype=float)).reshape(-1)
    return float(torch.linalg.vector_norm(t, _check_p(p)))


def unit_ball(p: float, points: int = 721) -> tuple[np.ndarray, np.ndarray]:
    r"""The closed curve :math:`\|v\|_p = 1` in the plane, as arrays ``(x, y)``.

    Each direction :math:`(\cos t, \sin t)` is divided by its own p-norm, so every
    point lies exactly on the unit sphere of the p-norm. For ``p < 1`` the set is
    not convex (and :math:`\|\cdot\|_p` is not a norm); the curve is still drawn.
    """
    p = _check_p(p)
    if points < 4:
        raise ValueError(f"points must be at least 4, got {points}")
    t = np.linspace(0.0, 2.0 * np.pi, points)
    directions = np.stack([np.cos(t), np.sin(t)], axis=1)
    if math.isinf(p):
        norms = np.abs(directions).max(axis=1)
    else:
        # Scale by the max first so |x|**p cannot underflow for large p.
        top = np.abs(directions).max(axis=1, keepdims=True)
        norms = top[:, 0] * (np.abs(directions / top) ** p).sum(axis=1) ** (1.0 / p)
    ring = directions / norms[:, None]
    return ring[:, 0], ring[:, 1]


def real_gradient_2d(seed: int = 0) -> np.ndarray:
    """The weight gradient of a seeded 2-input linear model on regression data."""
    x, y = regression_data(64, d_in=2, d_out=1, noise=0.1, seed=seed)
    torch.manual_seed(seed)
    model = nn.Linear(2, 1, bias=False)
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    return model.weight.grad.detach().reshape(-1).double().numpy().copy()


def unit_ball_figure(p: float = 2.0, gradient: Sequence[float] | None = None) -> Figure:
    r"""The unit ball of the p-norm, the sphere :math:`\|v\|_p = \|g\|_p`, and g itself."""
    p = _check_p(p)
    g = real_gradient_2d() if gradient is None else np.asarray(gradient, dtype=float).reshape(-1)
    if g.shape != (2,):
        raise ValueError(f"gradient must have two entries, got shape {g.shape}")
    size = p_norm(g, p)
    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot()
    for q, style in ((1.0, ":"), (2.0, "--"), (math.inf, "-.")):
        x, y = unit_ball(q)
        ax.plot(x, y, ls=style, lw=1, color=NONE, label=rf"$\|v\|_{{{_p_text(q)}}} = 1$")
    x, y = unit_ball(p)
    ax.fill(x, y, color=KEEP, alpha=0.15, lw=0)
    ax.plot(x, y, color=KEEP, lw=2, label=rf"unit ball, p = {_p_text(p)}")
    finite = bool(np.all(np.isfinite(g)))
    if finite and size > 0:
        ax.plot(size * x, size * y, color=CLIP, lw=1.5, label=r"$\|v\|_p = \|g\|_p$")
        ax.annotate(
            "",
            xy=(g[0], g[1]),
            xytext=(0, 0),
            arrowprops={"arrowstyle": "->", "color": THRESHOLD, "lw": 1.5},
        )
        ax.plot([g[0]], [g[1]], "o", color=THRESHOLD, ms=4, label=f"g = ({g[0]:.2f}, {g[1]:.2f})")
        ax.plot(
            [g[0] / size],
            [g[1] / size],
            "D",
            color=CLIP,
            ms=5,
            label=r"$g / \|g\|_p$, on the unit ball",
        )
    reach = max(1.2, 1.15 * size) if finite else 1.2
    reach = max(reach, 1.15 * float(np.abs(g).max())) if finite else reach
    ax.set_xlim(-reach, reach)
    ax.set_ylim(-reach, reach)
    ax.set_aspect("equal")
    ax.axhline(0, color=THRESHOLD, lw=0.5)
    ax.axvline(0, color=THRESHOLD, lw=0.5)
    shown = f"{size:.3f}" if math.isfinite(size) else str(size)
    ax.set_title(rf"p = {_p_text(p)}:  $\|g\|_p$ = {shown}", fontsize=10)
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    return fig


def _p_text(p: float) -> str:
    return r"\infty" if math.isinf(p) else f"{p:g}"


# ------------------------------------------------------------ group clipping


def mlp_gradients(seed: int = 0) -> tuple[list[str], list[Tensor]]:
    """Names and gradients of ``small_mlp(4, 16, 1)`` after one MSE backward pass."""
    x, y = regression_data(64, d_in=4, d_out=1, noise=0.1, seed=seed)
    model = small_mlp(4, 16, 1, seed=seed)
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    names = [name for name, _ in model.named_parameters()]
    return names, [p.grad.detach().clone() for p in model.parameters()]


def layer_groups(names: Sequence[str]) -> list[list[int]]:
    """Indices of the tensors grouped by layer: ``'0.weight'`` and ``'0.bias'`` together."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(name.rsplit(".", 1)[0], []).append(i)
    return list(groups.values())


@dataclass(frozen=True)
class GroupClipping:
    """The same gradient clipped globally and group by group, to the same ``max_norm``.

    Attributes:
        max_norm, norm_type, groups: the setting.
        before, after_global, after_groups: the gradients (float64 NumPy copies, one
            array per tensor) before clipping, after one global clip, after one clip
            per group.
        group_norms_before, group_norms_global, group_norms_groups: each group's norm.
        total_before, total_global, total_groups: the norm of all tensors together.
        cosine: cosine similarity between the per-group result and the original
            gradient (1: same direction; the global result always has 1). NaN when
            either is zero or not finite.
        difference: ``||after_groups - after_global|| / ||after_global||`` (2-norm);
            NaN when the global result is zero or not finite.
    """

    max_norm: float
    norm_type: float
    groups: list[list[int]]
    before: list[np.ndarray]
    after_global: list[np.ndarray]
    after_groups: list[np.ndarray]
    group_norms_before: np.ndarray
    group_norms_global: np.ndarray
    group_norms_groups: np.ndarray
    total_before: float
    total_global: float
    total_groups: float
    cosine: float
    difference: float


def _flat(arrays: Sequence[np.ndarray]) -> np.ndarray:
    if not arrays:
        return np.zeros(0)
    return np.concatenate([a.reshape(-1) for a in arrays])


def group_clipping(
    grads: Sequence[Tensor],
    max_norm: float,
    groups: Sequence[Sequence[int]] | None = None,
    norm_type: float = 2.0,
) -> GroupClipping:
    """Clip copies of ``grads`` globally and per group with :func:`gradlab.clip_grad_norm_`.

    ``groups`` lists the tensor indices of each group (default: every tensor its
    own group). The input tensors are not modified.
    """
    n = len(grads)
    groups = [list(range(n))] if n == 0 else [[i] for i in range(n)] if groups is None else groups
    groups = [list(g) for g in groups]
    if sorted(i for g in groups for i in g) != list(range(n)):
        raise ValueError("groups must use every tensor index exactly once")

    global_holders = grad_holders(grads, torch.float64)
    clip_grad_norm_(global_holders, max_norm, norm_type=norm_type)
    group_holders = grad_holders(grads, torch.float64)
    for group in groups:
        clip_grad_norm_([group_holders[i] for i in group], max_norm, norm_type=norm_type)

    before = [g.detach().to(torch.float64).numpy().copy() for g in grads]
    after_global = [h.grad.numpy().copy() for h in global_holders]
    after_groups = [h.grad.numpy().copy() for h in group_holders]

    def norm_of(arrays: Sequence[np.ndarray]) -> float:
        return float(get_total_norm([torch.from_numpy(a) for a in arrays], norm_type))

    def per_group(arrays: list[np.ndarray]) -> np.ndarray:
        return np.array([norm_of([arrays[i] for i in g]) for g in groups])

    flat_before, flat_global, flat_groups = _flat(before), _flat(after_global), _flat(after_groups)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        denom = np.linalg.norm(flat_groups) * np.linalg.norm(flat_before)
        cosine = float(flat_groups @ flat_before / denom) if denom > 0 else math.nan
        gnorm = np.linalg.norm(flat_global)
        difference = (
            float(np.linalg.norm(flat_groups - flat_global) / gnorm)
            if gnorm > 0 and np.isfinite(gnorm)
            else math.nan
        )
    if not math.isfinite(cosine):
        cosine = math.nan
    return GroupClipping(
        max_norm=float(max_norm),
        norm_type=float(norm_type),
        groups=groups,
        before=before,
        after_global=after_global,
        after_groups=after_groups,
        group_norms_before=per_group(before),
        group_norms_global=per_group(after_global),
        group_norms_groups=per_group(after_groups),
        total_before=norm_of(before),
        total_global=norm_of(after_global),
        total_groups=norm_of(after_groups),
        cosine=cosine,
        difference=difference,
    )


def group_clipping_figure(max_norm: float = 2.0, by: str = "layer") -> Figure:
    """Group norms of a small MLP's gradient: unclipped, clipped globally, clipped per group.

    ``by`` is ``"layer"`` (weight and bias of a layer together) or ``"tensor"``.
    """
    names, grads = mlp_gradients()
    if by == "layer":
        groups = layer_groups(names)
        labels = [f"layer {k + 1}" for k in range(len(groups))]
    elif by == "tensor":
        groups = [[i] for i in range(len(names))]
        labels = list(names)
    else:
        raise ValueError(f"by must be 'layer' or 'tensor', got {by!r}")
    data = group_clipping(grads, max_norm, groups)
    labels = [*labels, "whole model"]
    series = [
        ("before clipping", [*data.group_norms_before, data.total_before], NONE, None),
        ("global clip", [*data.group_norms_global, data.total_global], CLIP, None),
        (f"clip each {by}", [*data.group_norms_groups, data.total_groups], KEEP, "//"),
    ]
    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot()
    xs = np.arange(len(labels))
    width = 0.26
    for k, (label, values, colour, hatch) in enumerate(series):
        values = np.nan_to_num(np.asarray(values, dtype=float), nan=0.0, posinf=0.0)
        bars = ax.bar(
            xs + (k - 1) * width,
            values,
            width,
            color=colour,
            alpha=0.85,
            hatch=hatch,
            edgecolor="white",
            label=label,
        )
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.axhline(max_norm, color=THRESHOLD, lw=1, ls="--", label=rf"max_norm $\tau$ = {max_norm:g}")
    ax.set_xticks(xs, labels)
    ax.set_ylabel("2-norm of the gradient")
    top = max(data.total_before, max_norm) if math.isfinite(data.total_before) else max_norm
    ax.set_ylim(0, 1.25 * top)
    cos = f"{data.cosine:.4f}" if math.isfinite(data.cosine) else "n/a"
    diff = f"{100 * data.difference:.1f}%" if math.isfinite(data.difference) else "n/a"
    ax.set_title(
        f"per-{by} vs global: cosine to the original {cos}, relative difference {diff}",
        fontsize=10,
    )
    ax.legend(loc="upper left", fontsize=8)
    return fig
