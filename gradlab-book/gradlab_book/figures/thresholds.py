r"""Part IV: choosing and monitoring a threshold (book/adaptive/choosing_threshold).

*A logged run.* The book's two-layer MLP (:func:`gradlab_book.demos.small_mlp`, 8 inputs,
32 hidden units) fits a noisy linear teacher (:func:`gradlab_book.demos.regression_data`,
512 samples, label noise 0.5) by SGD with momentum 0.9, on minibatches of 32 drawn with
replacement. :func:`batches` can make some batches bad (targets ``BAD_SCALE`` times too
large) or non-finite (a NaN input). :func:`train` runs it under a
:class:`gradlab.StepGuard` in ``"clip"`` mode at a fixed threshold and returns every
step's norm and decision; :func:`lr_sweep` does so over learning rates.

*Recorded traces.* The norm traces of ``norm_traces.json`` (:mod:`gradlab_book.stored`; see
:mod:`gradlab_book.figures.adaptive`): :func:`early_threshold` sets a threshold from
the first steps of a trace, :func:`drift_rates` measures how often the trace is over it
right after that warm-up and at the end, :func:`drift_figure` draws it.

A step is *over* a threshold :math:`\tau` by the rule of :class:`gradlab.StepGuard` and
:func:`gradlab.grad_ignore_norm_`: :math:`\tau / (s + 10^{-6}) < 1`, NaN always over
(:func:`over`).

Compute functions return plain numbers, lists and numpy arrays; figure functions draw them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from gradlab import StepGuard
from gradlab_book import demos
from gradlab_book.figures.adaptive import TRACES
from gradlab_book.plots import CLIP, KEEP, NONE, SKIP, THRESHOLD, new_figure

__all__ = [
    "BAD_SCALE",
    "EPS",
    "RUN",
    "batches",
    "drift_figure",
    "drift_rates",
    "early_threshold",
    "final_loss",
    "log_figure",
    "lr_sweep",
    "lr_sweep_figure",
    "make_data",
    "new_run",
    "over",
    "rolling_rate",
    "silent_stretch",
    "train",
    "window_rows",
]

#: The epsilon of the guard's test ``tau / (s + EPS) < 1``.
EPS = 1e-6

#: The settings of every run of the logged model.
RUN = {
    "n": 512,
    "d_in": 8,
    "hidden": 32,
    "noise": 0.5,
    "batch": 32,
    "momentum": 0.9,
    "steps": 300,
    "data_seed": 0,
}

#: A bad batch's targets are this many times too large.
BAD_SCALE = 30.0


# ----------------------------------------------------------------------- the run


def make_data() -> tuple[Tensor, Tensor]:
    """The training set: ``RUN["n"]`` samples of a noisy linear teacher."""
    return demos.regression_data(
        RUN["n"], d_in=RUN["d_in"], d_out=1, noise=RUN["noise"], seed=RUN["data_seed"]
    )


def new_run(
    lr: float, seed: int = 0, momentum: float = RUN["momentum"]
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh seeded MLP and its SGD optimizer (momentum 0.9 unless told)."""
    model = demos.small_mlp(RUN["d_in"], RUN["hidden"], 1, seed=seed)
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def batches(
    x: Tensor,
    y: Tensor,
    steps: int,
    seed: int = 0,
    bad: Sequence[int] = (),
    nan: Sequence[int] = (),
) -> Iterator[tuple[int, Tensor, Tensor]]:
    """``(step, inputs, targets)`` for ``steps`` minibatches drawn with replacement.

    At the steps in ``bad`` the targets are ``BAD_SCALE`` times too large; at the steps in
    ``nan`` one input is NaN, so the loss and every gradient are NaN.
    """
    g = torch.Generator().manual_seed(1 + seed)
    for step in range(steps):
        index = torch.randint(0, len(x), (RUN["batch"],), generator=g)
        xb, yb = x[index], y[index]
        if step in bad:
            yb = yb * BAD_SCALE
        if step in nan:
            xb = xb.clone()
            xb[0, 0] = math.nan
        yield step, xb, yb


#: The mean-squared error on the whole training set (inf when not finite).
final_loss = demos.mse_or_inf


def train(
    lr: float,
    threshold: float,
    steps: int = RUN["steps"],
    seed: int = 0,
    momentum: float = RUN["momentum"],
    bad: Sequence[int] = (),
    nan: Sequence[int] = (),
) -> dict[str, Any]:
    """Train under ``StepGuard(mode="clip", threshold=threshold, history=steps)``.

    Returns every step's total norm (before clipping) and decision, the final
    training loss and the trained model.
    """
    x, y = make_data()
    model, optimizer = new_run(lr, seed, momentum)
    guard = StepGuard(
        optimizer, mode="clip", threshold=threshold, history=steps, max_consecutive_skips=None
    )
    for _, xb, yb in batches(x, y, steps, seed, bad, nan):
        demos.backward(model, xb, yb)
        guard.step()
        optimizer.zero_grad()
    records = guard.history
    return {
        "norms": np.array([r.total_norm for r in records]),
        "decisions": np.array([r.decision for r in records]),
        "loss": final_loss(model, x, y),
        "model": model,
    }


def lr_sweep(
    lrs: Sequence[float], threshold: float, settle: int = 100, steps: int = RUN["steps"]
) -> list[dict[str, Any]]:
    """Per learning rate: three runs of :func:`train`.

    * ``fixed``: clipped at ``threshold``;
    * ``own``: clipped at the 90th percentile of the fixed run's norms after step
      ``settle`` (the threshold re-tuned to this learning rate);
    * ``none``: no threshold (``inf``: only non-finite steps are skipped).

    Each row holds the learning rate, the own threshold, and for each run its final
    loss and its clip and skip rates over the steps from ``settle`` on.
    """
    rows = []
    for lr in lrs:
        row: dict[str, Any] = {"lr": float(lr)}
        fixed = train(lr, threshold, steps)
        own = float(np.percentile(fixed["norms"][settle:], 90))
        runs = {"fixed": fixed, "own": train(lr, own, steps), "none": train(lr, math.inf, steps)}
        row["own_threshold"] = own
        for name, run in runs.items():
            late = run["decisions"][settle:]
            row[name] = {
                "loss": run["loss"],
                "clip": float(np.mean(late == "clipped")),
                "skip": float(np.mean(late == "skipped")),
            }
        rows.append(row)
    return rows


# ---------------------------------------------------------------- logging helpers


def over(norms: Sequence[float] | np.ndarray, threshold: float) -> np.ndarray:
    """Where a norm is over ``threshold`` by the guard's rule (NaN always over)."""
    norms = np.asarray(norms, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):  # inf / inf is NaN: over
        return ~(threshold / (norms + EPS) >= 1.0)


def window_rows(
    norms: Sequence[float], decisions: Sequence[str], every: int = 50
) -> list[dict[str, Any]]:
    """Per block of ``every`` steps: its last step (1-based), the median and largest
    finite norm, and the shares of steps clipped and skipped."""
    norms = np.asarray(norms, dtype=float)
    decisions = np.asarray(decisions)
    rows = []
    for start in range(0, len(norms), every):
        n = norms[start : start + every]
        d = decisions[start : start + every]
        finite = n[np.isfinite(n)]
        rows.append(
            {
                "last": start + len(n),
                "median": float(np.median(finite)) if finite.size else math.nan,
                "largest": float(finite.max()) if finite.size else math.nan,
                "clip": float(np.mean(d == "clipped")),
                "skip": float(np.mean(d == "skipped")),
            }
        )
    return rows


def rolling_rate(flags: Sequence[bool] | np.ndarray, width: int = 50) -> np.ndarray:
    """The share of ``True`` in the trailing ``width`` steps, ending at each step
    (NaN for the first ``width - 1`` steps)."""
    flags = np.asarray(flags, dtype=float)
    out = np.full(len(flags), math.nan)
    if len(flags) >= width:
        sums = np.convolve(flags, np.ones(width), mode="valid")
        out[width - 1 :] = sums / width
    return out


def silent_stretch(flags: Sequence[bool] | np.ndarray, width: int = 100) -> int | None:
    """The first step (0-based) that ends ``width`` steps in a row with no ``True``,
    or ``None``."""
    rate = rolling_rate(flags, width)
    hits = np.flatnonzero(rate == 0.0)
    return int(hits[0]) if hits.size else None


# ------------------------------------------------------------------ drift on traces


def early_threshold(
    norms: Sequence[float] | np.ndarray, percentile: float = 90.0, warmup: int = 50
) -> float:
    """The ``percentile`` of the finite norms among the first ``warmup`` steps
    (``numpy.percentile``, linear interpolation); ``inf`` if there is none."""
    window = np.asarray(norms, dtype=float)[:warmup]
    finite = window[np.isfinite(window)]
    return float(np.percentile(finite, percentile)) if finite.size else math.inf


def drift_rates(
    norms: Sequence[float] | np.ndarray,
    percentile: float = 90.0,
    warmup: int = 50,
    span: int = 100,
) -> dict[str, float]:
    """The threshold of :func:`early_threshold` and the share of steps over it in the
    ``span`` steps right after the warm-up (``early``) and in the last ``span`` steps
    of the trace (``late``)."""
    norms = np.asarray(norms, dtype=float)
    tau = early_threshold(norms, percentile, warmup)
    flags = over(norms, tau)
    return {
        "threshold": tau,
        "early": float(flags[warmup : warmup + span].mean()),
        "late": float(flags[-span:].mean()),
    }


# -------------------------------------------------------------------------- figures


def _decision_panel(ax, norms: np.ndarray, decisions: np.ndarray) -> None:
    steps = np.arange(1, len(norms) + 1)
    shown = np.where(np.isfinite(norms), norms, np.nan)
    ax.plot(steps, shown, color=NONE, lw=0.6, zorder=1)
    for name, colour, marker, size in (
        ("kept", KEEP, "o", 4),
        ("clipped", CLIP, "x", 14),
    ):
        mask = decisions == name
        ax.scatter(steps[mask], norms[mask], s=size, color=colour, marker=marker, label=name)
    skipped = np.flatnonzero(decisions == "skipped")
    for i, step in enumerate(skipped + 1):
        ax.axvline(step, color=SKIP, lw=1.2, ls=":", label="skipped (NaN)" if i == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("total gradient norm")


def log_figure(
    norms: Sequence[float], decisions: Sequence[str], thresholds: Sequence[float], every: int = 50
) -> Figure:
    """Top: a logged run's norms, each step's decision and the threshold in force;
    bottom: the clip and skip rates of each block of ``every`` steps."""
    norms = np.asarray(norms, dtype=float)
    decisions = np.asarray(decisions)
    fig = new_figure(6.8, 4.2)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    _decision_panel(top, norms, decisions)
    steps = np.arange(1, len(norms) + 1)
    taus = np.asarray(thresholds, dtype=float)
    top.plot(steps, np.where(np.isfinite(taus), taus, np.nan), color=THRESHOLD, ls="--", lw=1.0,
             label="threshold")  # fmt: skip
    top.set_xlabel("")
    top.legend(fontsize=7, loc="upper left", ncols=2)
    rows = window_rows(norms, decisions, every)
    edges = [0] + [r["last"] for r in rows]
    mids = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
    width = 0.4 * every
    bottom.bar([m - width / 2 for m in mids], [100 * r["clip"] for r in rows], width, color=CLIP,
               label="clipped")  # fmt: skip
    bottom.bar([m + width / 2 for m in mids], [100 * r["skip"] for r in rows], width, color=SKIP,
               label="skipped")  # fmt: skip
    bottom.set_ylabel(f"% of {every} steps")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=7, loc="upper left")
    return fig


def lr_sweep_figure(rows: list[dict[str, Any]], threshold: float) -> Figure:
    """Left: the clip rate of the fixed threshold (and of the re-tuned one) against the
    learning rate; right: the final loss of the three runs of :func:`lr_sweep`."""
    fig = new_figure(6.8, 2.9)
    left, right = fig.subplots(1, 2)
    lrs = [r["lr"] for r in rows]
    left.plot(lrs, [100 * r["fixed"]["clip"] for r in rows], "o-", color=CLIP,
              label=f"fixed threshold {threshold:.3g}")  # fmt: skip
    left.plot(lrs, [100 * r["own"]["clip"] for r in rows], "s--", color=KEEP,
              label="threshold re-tuned (own p90)")  # fmt: skip
    left.axhline(50, color=THRESHOLD, lw=0.8, ls=":")
    left.annotate("half the steps", (lrs[0], 50), xytext=(0, 3), textcoords="offset points",
                  fontsize=7)  # fmt: skip
    left.set_xscale("log")
    left.set_ylim(0, 105)
    left.set_xlabel("learning rate")
    left.set_ylabel("% of steps clipped (after step 100)")
    left.legend(fontsize=6.5, loc="upper left")
    diverged: dict[str, list[float]] = {}
    for key, label, colour, style in (
        ("none", "no threshold", NONE, "^:"),
        ("own", "re-tuned threshold", KEEP, "s--"),
        ("fixed", "fixed threshold", CLIP, "o-"),
    ):
        losses = np.array([r[key]["loss"] for r in rows])
        finite = np.isfinite(losses)
        right.plot(np.array(lrs)[finite], losses[finite], style, color=colour, label=label)
        if not finite.all():
            diverged[label] = [lr for lr, ok in zip(lrs, finite, strict=True) if not ok]
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("learning rate")
    right.set_ylabel("final training loss")
    right.legend(fontsize=6.5, loc="upper left")
    if diverged:
        words = "; ".join(
            f"{label} diverged at lr {', '.join(f'{lr:g}' for lr in values)}"
            for label, values in diverged.items()
        )
        right.set_title(words, fontsize=7)
    return fig


def drift_figure(percentile: float, warmup: int, traces: dict[str, Any], span: int = 100) -> Figure:
    """Each recorded trace with the threshold set at ``percentile`` of its first
    ``warmup`` steps (shaded); below, the share of the last 50 steps over it, against
    the ``100 - percentile`` % that the threshold was meant to give."""
    fig = new_figure(6.8, 3.9)
    axes = fig.subplots(2, len(TRACES), sharex="col", height_ratios=[2, 1])
    target = 100 - percentile
    for column, (name, label) in enumerate(TRACES.items()):
        top, bottom = axes[0, column], axes[1, column]
        norms = np.asarray(traces[name]["norms"], dtype=float)
        rates = drift_rates(norms, percentile, warmup, span)
        tau = rates["threshold"]
        flags = over(norms, tau)
        steps = np.arange(1, len(norms) + 1)
        top.plot(steps, norms, color=NONE, lw=0.6, zorder=1)
        top.scatter(steps[~flags], norms[~flags], s=3, color=KEEP, label="under", zorder=2)
        top.scatter(steps[flags], norms[flags], s=12, marker="x", color=CLIP, label="over",
                    zorder=3)  # fmt: skip
        top.axhline(tau, color=THRESHOLD, ls="--", lw=1.0, label="threshold")
        top.axvspan(0, warmup, color=NONE, alpha=0.15, lw=0)
        top.set_yscale("log")
        top.set_title(
            f"{label}\nover it: {100 * rates['early']:.0f}% of steps "
            f"{warmup + 1}-{warmup + span}, {100 * rates['late']:.0f}% of the last {span}",
            fontsize=7.5,
        )
        rolling = 100 * rolling_rate(flags, 50)
        bottom.plot(steps, rolling, color=CLIP, lw=1.2)
        bottom.axhline(target, color=THRESHOLD, ls=":", lw=0.9)
        bottom.annotate(f"{target:g}%", (len(norms), target), xytext=(2, 2),
                        textcoords="offset points", fontsize=7, ha="right")  # fmt: skip
        bottom.set_ylim(-3, 103)
        bottom.set_xlabel("step")
    axes[0, 0].set_ylabel("total gradient norm")
    axes[1, 0].set_ylabel("% over, last 50")
    axes[0, -1].legend(fontsize=6.5, loc="upper right", markerscale=1.5)
    fig.suptitle(
        f"threshold: percentile {percentile:g} of the first {warmup} steps (shaded)", fontsize=9
    )
    return fig
