r"""Ignoring by norm and by value (taught in book/algorithms/ignore_norm and ignore_value).

Compute functions return plain numbers in frozen dataclasses; figure functions draw
them and nothing else. The gradients are real: :func:`minibatch_stream` trains a
small MLP from :mod:`gradlab_book.demos` for a while and then records the gradient of a
stream of minibatches, a few of which are corrupted on purpose. That is the slow
part, so it is computed once per set of arguments and cached; moving a threshold
only re-runs the decisions, and every decision is made by calling the real
:mod:`gradlab` function on a copy of the recorded gradient (never a
re-implementation), so the pictures show exactly what gradlab does.

* :func:`minibatch_stream`: the recorded gradients, their total 2-norm and their
  largest absolute entry, and what happened to each batch.
* :func:`norm_decisions` and :func:`ignore_norm_stream_figure`: for a threshold
  ``max_norm``, which steps :func:`gradlab.grad_ignore_norm_` keeps, and how long
  the update is under clipping and under ignoring.
* :func:`value_norm_decisions` and :func:`value_vs_norm_figure`: ignoring by value
  and ignoring by norm side by side, both thresholds set at the same multiple of
  what clean batches reach.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from torch import Tensor

import gradlab
from gradlab_book import demos
from gradlab_book.plots import CLIP, IGNORE, KEEP, THRESHOLD, new_figure

__all__ = [
    "KINDS",
    "GradientStream",
    "NormDecisions",
    "ValueNormDecisions",
    "ignore_norm_stream_figure",
    "minibatch_stream",
    "norm_decisions",
    "stream_from_gradients",
    "value_norm_decisions",
    "value_vs_norm_figure",
]

#: What can happen to a batch of the stream, and how the figures call it.
KINDS = {
    "clean": "clean batch",
    "glitch": "one corrupted input reading",
    "labels": "targets in the wrong scale",
    "nan": "a NaN reading",
}

# The model and data behind the stream (kept small: the whole stream costs well
# under a second on a laptop CPU).
_D_IN = 32
_HIDDEN = 16
_BATCH = 16
_WARMUP_STEPS = 300
_WARMUP_LR = 0.02


@dataclass(frozen=True)
class GradientStream:
    r"""The gradients of a stream of minibatches, recorded once.

    Attributes:
        grads: per step, the gradient of every parameter (detached copies).
        kinds: per step, a key of :data:`KINDS`.
        norms: per step, the total 2-norm of the gradient (float32 arithmetic, as
            gradlab computes it; NaN for a NaN gradient).
        largest: per step, the largest absolute entry, :math:`\|g\|_\infty`.
        reference_norm: the largest total norm over the clean steps.
        reference_largest: the largest absolute entry over the clean steps.
    """

    grads: tuple[tuple[Tensor, ...], ...]
    kinds: tuple[str, ...]
    norms: tuple[float, ...]
    largest: tuple[float, ...]
    reference_norm: float
    reference_largest: float

    @property
    def steps(self) -> int:
        return len(self.grads)

    @property
    def size(self) -> int:
        """The number of gradient entries per step."""
        return sum(g.numel() for g in self.grads[0]) if self.grads else 0


def _reference(values: Sequence[float], kinds: Sequence[str]) -> float:
    clean = [v for v, k in zip(values, kinds, strict=True) if k == "clean" and math.isfinite(v)]
    return max(clean) if clean else 0.0


def stream_from_gradients(
    grads: Sequence[Sequence[Tensor]], kinds: Sequence[str] | None = None
) -> GradientStream:
    """A :class:`GradientStream` from given gradients (each step a list of tensors).

    ``kinds`` defaults to ``"clean"`` for every step. Used by :func:`minibatch_stream`
    and by tests that need zero or NaN gradients.
    """
    grads = tuple(tuple(g.detach().clone() for g in step) for step in grads)
    kinds = tuple(kinds) if kinds is not None else ("clean",) * len(grads)
    if len(kinds) != len(grads):
        raise ValueError(f"got {len(kinds)} kinds for {len(grads)} steps")
    if unknown := set(kinds) - set(KINDS):
        raise ValueError(f"unknown kinds {sorted(unknown)}; expected keys of KINDS")
    norms = tuple(float(gradlab.get_total_norm(step)) for step in grads)
    largest = tuple(float(gradlab.get_total_norm(step, math.inf)) for step in grads)
    return GradientStream(
        grads=grads,
        kinds=kinds,
        norms=norms,
        largest=largest,
        reference_norm=_reference(norms, kinds),
        reference_largest=_reference(largest, kinds),
    )


@functools.lru_cache(maxsize=4)
def minibatch_stream(
    steps: int = 60, glitches: int = 4, label_errors: int = 4, nans: int = 1, seed: int = 0
) -> GradientStream:
    """Real minibatch gradients of a small MLP, with a few corrupted batches.

    A ``small_mlp(32, 16, 1)`` is first trained with plain SGD on clean batches of
    a linear teacher (so its gradients are those of a model in training, not at
    initialisation). Then the gradients of ``steps`` fresh batches of 16 are
    recorded at those fixed parameters. At seeded random positions, some batches
    are corrupted:

    * ``"glitch"``: one input reading of one sample is replaced by +-8 (a sensor
      glitch): it mostly inflates a few entries of the gradient;
    * ``"labels"``: all targets of the batch are 1.2 to 1.3 times too large (a unit
      error): every entry grows a little;
    * ``"nan"``: one input reading is NaN, which makes the whole gradient NaN.

    Cached: the same arguments return the same (immutable) object.
    """
    for name, value in (
        ("steps", steps),
        ("glitches", glitches),
        ("label_errors", label_errors),
        ("nans", nans),
    ):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if glitches + label_errors + nans > steps:
        raise ValueError("more corrupted batches than steps")
    gen = torch.Generator().manual_seed(seed)
    model = demos.small_mlp(_D_IN, _HIDDEN, 1, seed=seed)
    n_warm = _WARMUP_STEPS * _BATCH
    x, y = demos.regression_data(n_warm + steps * _BATCH, _D_IN, 1, noise=0.3, seed=seed + 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=_WARMUP_LR)
    for t in range(_WARMUP_STEPS):
        rows = slice(t * _BATCH, (t + 1) * _BATCH)
        demos.backward(model, x[rows], y[rows])
        optimizer.step()

    order = torch.randperm(steps, generator=gen).tolist()
    kinds = ["clean"] * steps
    plan = ["glitch"] * glitches + ["labels"] * label_errors + ["nan"] * nans
    for position, kind in zip(order, plan, strict=False):
        kinds[position] = kind

    grads = []
    for t in range(steps):
        rows = slice(n_warm + t * _BATCH, n_warm + (t + 1) * _BATCH)
        xb, yb = x[rows].clone(), y[rows].clone()
        sample = int(torch.randint(_BATCH, (), generator=gen))
        feature = int(torch.randint(_D_IN, (), generator=gen))
        sign = 1.0 if float(torch.rand((), generator=gen)) < 0.5 else -1.0
        scale = 1.2 + 0.1 * float(torch.rand((), generator=gen))
        if kinds[t] == "glitch":
            xb[sample, feature] = 8.0 * sign
        elif kinds[t] == "labels":
            yb = yb * scale
        elif kinds[t] == "nan":
            xb[sample, feature] = math.nan
        demos.backward(model, xb, yb)
        grads.append(demos.gradients(model))
    return stream_from_gradients(grads, kinds)


# ------------------------------------------------------------------ decisions


@dataclass(frozen=True)
class NormDecisions:
    """What clipping and ignoring by norm do to each step for one ``max_norm``.

    Attributes:
        max_norm: the threshold.
        kept: per step, True when :func:`gradlab.grad_ignore_norm_` left the
            gradient as it was (False: it zeroed it). This is the effect, so an
            all-zero gradient always counts as kept.
        returned: per step, the total norm the ignore function returned.
        clip_update: per step, the 2-norm of the gradient after
            :func:`gradlab.clip_grad_norm_` (NaN when clipping leaves NaN).
        ignore_update: per step, the 2-norm of the gradient after
            :func:`gradlab.grad_ignore_norm_` (0 when ignored).
    """

    max_norm: float
    kept: tuple[bool, ...]
    returned: tuple[float, ...]
    clip_update: tuple[float, ...]
    ignore_update: tuple[float, ...]

    @property
    def n_kept(self) -> int:
        return sum(self.kept)

    @property
    def n_ignored(self) -> int:
        return len(self.kept) - self.n_kept


def norm_decisions(stream: GradientStream, max_norm: float) -> NormDecisions:
    """Run :func:`gradlab.clip_grad_norm_` and :func:`gradlab.grad_ignore_norm_`
    on a copy of every step of ``stream`` with threshold ``max_norm``."""
    kept, returned, clip_update, ignore_update = [], [], [], []
    for step in stream.grads:
        clipped = demos.grad_holders(step)
        gradlab.clip_grad_norm_(clipped, max_norm)
        clip_update.append(float(gradlab.get_total_norm([p.grad for p in clipped])))

        ignored = demos.grad_holders(step)
        total = gradlab.grad_ignore_norm_(ignored, max_norm)
        after = [p.grad for p in ignored]
        returned.append(float(total))
        ignore_update.append(float(gradlab.get_total_norm(after)))
        kept.append(all(torch.equal(a, b) for a, b in zip(after, step, strict=True)))
    return NormDecisions(
        max_norm=float(max_norm),
        kept=tuple(kept),
        returned=tuple(returned),
        clip_update=tuple(clip_update),
        ignore_update=tuple(ignore_update),
    )


@dataclass(frozen=True)
class ValueNormDecisions:
    """Ignoring by value and by 2-norm, thresholds at the same multiple of clean.

    Attributes:
        margin: the multiple: ``clip_value = margin * reference_largest`` and
            ``max_norm = margin * reference_norm`` of the stream.
        clip_value, max_norm: the two thresholds.
        by_value: per step, True when :func:`gradlab.grad_ignore_value_` zeroed it
            (the effect: an all-zero gradient never counts as zeroed).
        by_norm: per step, True when :func:`gradlab.grad_ignore_norm_` zeroed it.
        largest_ratio: per step, ``||g||_inf / reference_largest``.
        norm_ratio: per step, ``||g||_2 / reference_norm``.
    """

    margin: float
    clip_value: float
    max_norm: float
    by_value: tuple[bool, ...]
    by_norm: tuple[bool, ...]
    largest_ratio: tuple[float, ...]
    norm_ratio: tuple[float, ...]

    @property
    def disagreements(self) -> tuple[int, ...]:
        return tuple(
            t for t, (v, n) in enumerate(zip(self.by_value, self.by_norm, strict=True)) if v != n
        )


def _zeroed(step: Sequence[Tensor], after: Sequence[Tensor]) -> bool:
    """True when the call changed the gradient (it can only have zeroed it)."""
    return not all(torch.equal(a, b) for a, b in zip(after, step, strict=True))


def _ratio(value: float, reference: float) -> float:
    if math.isnan(value):
        return math.nan
    if reference > 0:
        return value / reference
    return 0.0 if value == 0 else math.inf


def value_norm_decisions(stream: GradientStream, margin: float) -> ValueNormDecisions:
    """Ignore each step by value and by 2-norm, both at ``margin`` times the
    largest value its statistic takes on the clean steps of ``stream``."""
    margin = float(margin)
    if math.isnan(margin) or margin < 0:
        raise ValueError(f"margin must be a non-negative number, got {margin!r}")
    # inf * 0 would be NaN: an infinite margin means an infinite threshold.
    clip_value = math.inf if margin == math.inf else margin * stream.reference_largest
    max_norm = math.inf if margin == math.inf else margin * stream.reference_norm
    by_value, by_norm = [], []
    for step in stream.grads:
        valued = demos.grad_holders(step)
        gradlab.grad_ignore_value_(valued, clip_value)
        by_value.append(_zeroed(step, [p.grad for p in valued]))
        normed = demos.grad_holders(step)
        gradlab.grad_ignore_norm_(normed, max_norm)
        by_norm.append(_zeroed(step, [p.grad for p in normed]))
    return ValueNormDecisions(
        margin=margin,
        clip_value=clip_value,
        max_norm=max_norm,
        by_value=tuple(by_value),
        by_norm=tuple(by_norm),
        largest_ratio=tuple(_ratio(v, stream.reference_largest) for v in stream.largest),
        norm_ratio=tuple(_ratio(v, stream.reference_norm) for v in stream.norms),
    )


def corrupted_batches_table(stream: GradientStream, margin: float) -> str:
    """The corrupted steps of ``stream``, one line each: what went wrong, the two
    statistics as multiples of their clean maxima, and whether each rule (both at
    ``margin``, :func:`value_norm_decisions`) ignores the step."""
    d = value_norm_decisions(stream, margin)
    verdict = {True: "ignored", False: "kept"}
    row = "{:>5}  {:<28}{:>10}{:>12}   {:<12}{}"
    header = ("batch", "what went wrong", "max/clean", "norm/clean", "value rule", "norm rule")
    lines = [row.format(*header)]
    for t, kind in enumerate(stream.kinds):
        if kind == "clean":
            continue
        ratios = (f"{d.largest_ratio[t]:.2f}", f"{d.norm_ratio[t]:.2f}")
        lines.append(
            row.format(t, KINDS[kind], *ratios, verdict[d.by_value[t]], verdict[d.by_norm[t]])
        )
    lines = [line.rstrip() for line in lines]
    return "\n".join(lines)


# --------------------------------------------------------------------- drawing


def _finite_max(values: Sequence[float], default: float = 1.0) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite and max(finite) > 0 else default


def _mark_events(ax, kinds: Sequence[str], heights: Sequence[float]) -> None:
    """A letter above each corrupted step: g(litch), l(abels), n(an)."""
    for t, (kind, height) in enumerate(zip(kinds, heights, strict=True)):
        if kind != "clean":
            ax.text(t, height, kind[0], ha="center", va="bottom", fontsize=7, color="#444444")


def ignore_norm_stream_figure(max_norm: float, stream: GradientStream | None = None) -> Figure:
    """Top: each step's gradient norm against ``max_norm`` (kept or ignored).
    Bottom: the length of the update it would make under clipping and ignoring."""
    stream = minibatch_stream() if stream is None else stream
    d = norm_decisions(stream, max_norm)
    steps = np.arange(stream.steps)
    norms = np.array(stream.norms, dtype=float)
    top_value = _finite_max(norms)
    if 0 < max_norm < math.inf:
        top_value = max(top_value, float(max_norm))
    positive = norms[np.isfinite(norms) & (norms > 0)]
    floor = 0.5 * min(positive.min() if positive.size else 1.0, top_value)
    floor = max(floor, 1e-12)

    fig = new_figure(6.4, 3.6)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[1.1, 1.0])

    colours = [KEEP if k else IGNORE for k in d.kept]
    heights = np.where(np.isfinite(norms), np.maximum(norms, floor), top_value * 2.0)
    top.bar(steps, heights - floor, bottom=floor, color=colours, width=0.8)
    for t in np.flatnonzero(~np.isfinite(norms)):
        label = "NaN" if np.isnan(norms[t]) else "inf"
        top.text(t, top_value * 2.0, label, ha="center", va="bottom", fontsize=7, color=IGNORE)
    if 0 < max_norm < math.inf:
        top.axhline(max_norm, color=THRESHOLD, ls="--", lw=1)
    top.set_yscale("log")
    top.set_ylim(floor, top_value * 8.0)
    top.set_ylabel(r"$\|g_t\|_2$")
    top.set_title(
        f"max_norm = {max_norm:.3g}: kept {d.n_kept}, ignored {d.n_ignored} of {stream.steps}",
        fontsize=10,
    )
    top.legend(
        handles=[Patch(color=KEEP, label="kept"), Patch(color=IGNORE, label="ignored")],
        loc="upper left",
        ncols=2,
        fontsize=8,
    )

    clip = np.array(d.clip_update, dtype=float)
    ignore = np.array(d.ignore_update, dtype=float)
    kept = np.array(d.kept, dtype=bool)
    ceiling = 1.1 * max(_finite_max(clip), _finite_max(ignore))
    # A kept step makes the same update under both: one blue bar. Otherwise clipping
    # makes a step of length max_norm (orange dash) and ignoring makes none (red x).
    bottom.bar(steps, np.where(kept, ignore, 0.0), width=0.8, color=KEEP, label="kept (both)")
    clipped = ~kept & np.isfinite(clip)
    bottom.plot(steps[clipped], clip[clipped], "_", color=CLIP, ms=9, mew=2.5, label="clipped")
    bottom.plot(
        steps[~kept],
        np.zeros(int((~kept).sum())),
        "x",
        color=IGNORE,
        ms=5,
        mew=1.5,
        label="ignored (0)",
    )
    for t in np.flatnonzero(~np.isfinite(clip)):
        bottom.text(t, ceiling, "NaN", ha="center", va="bottom", fontsize=7, color=CLIP)
    bottom.set_ylim(-0.05 * ceiling, ceiling * 2.0)
    bottom.set_ylabel("update length")
    bottom.set_xlabel("step")
    finite = np.isfinite(clip)
    bottom.legend(
        loc="upper left",
        ncols=3,
        fontsize=8,
        title=(
            f"summed update length: clipping {clip[finite].sum():.3g}, ignoring {ignore.sum():.3g}"
            + ("" if finite.all() else f"; clipping leaves NaN on {int((~finite).sum())} step(s)")
        ),
        title_fontsize=8,
    )
    _mark_events(
        top,
        stream.kinds,
        [h * 1.15 if k != "nan" else h * 2.5 for h, k in zip(heights, stream.kinds, strict=True)],
    )
    return fig


def value_vs_norm_figure(margin: float, stream: GradientStream | None = None) -> Figure:
    """Top: each step's largest entry and total norm, each divided by what clean
    steps reach, against ``margin``. Bottom: which steps each rule ignores."""
    stream = minibatch_stream() if stream is None else stream
    d = value_norm_decisions(stream, margin)
    steps = np.arange(stream.steps)
    largest = np.array(d.largest_ratio, dtype=float)
    norm = np.array(d.norm_ratio, dtype=float)
    finite = np.concatenate([largest[np.isfinite(largest)], norm[np.isfinite(norm)]])
    positive = finite[finite > 0]
    low = max(min(positive.min() if positive.size else 1.0, margin or 1.0) / 2, 1e-12)
    high = max(positive.max() if positive.size else 1.0, margin if margin < math.inf else 1.0)
    high *= 2.0

    fig = new_figure(6.4, 3.6)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2.2, 1.0])
    for values, flags, marker, label, dx in (
        (largest, d.by_value, "s", r"$\|g\|_\infty$ / clean max", -0.15),
        (norm, d.by_norm, "o", r"$\|g\|_2$ / clean max", 0.15),
    ):
        drawn = np.where(np.isfinite(values), np.clip(values, low, None), high)
        colours = [IGNORE if f else KEEP for f in flags]
        top.scatter(steps + dx, drawn, c=colours, marker=marker, s=16, label=label, zorder=3)
    for t in np.flatnonzero(~np.isfinite(norm)):
        top.text(
            t,
            high,
            "NaN" if np.isnan(norm[t]) else "inf",
            ha="center",
            va="bottom",
            fontsize=7,
            color=IGNORE,
        )
    if 0 < margin < math.inf:
        top.axhline(margin, color=THRESHOLD, ls="--", lw=1)
    top.set_yscale("log")
    top.set_ylim(low, high * 3.0)
    top.set_ylabel("multiple of clean max")
    top.legend(loc="upper left", fontsize=8, ncols=2, markerscale=1.0)
    top.set_title(
        f"margin {margin:.3g}: value ignores {sum(d.by_value)}, norm ignores {sum(d.by_norm)},"
        f" they disagree on {len(d.disagreements)}",
        fontsize=10,
    )

    for row, flags in enumerate((d.by_norm, d.by_value)):
        for t, flag in enumerate(flags):
            bottom.add_patch(
                Rectangle((t - 0.45, row - 0.4), 0.9, 0.8, color=IGNORE if flag else KEEP)
            )
    for t in d.disagreements:
        bottom.add_patch(
            Rectangle((t - 0.5, -0.5), 1.0, 2.0, fill=False, edgecolor=THRESHOLD, lw=1.2)
        )
    _mark_events(bottom, stream.kinds, [1.45] * stream.steps)
    bottom.set_yticks([0, 1], ["by norm", "by value"])
    bottom.set_ylim(-0.6, 2.0)
    bottom.set_xlim(-1, max(stream.steps, 1))
    bottom.grid(False)
    bottom.set_xlabel("step (boxed: the two rules disagree)")
    return fig
