r"""Part IV: choosing and monitoring a threshold (book/adaptive/choosing_threshold).

*A logged run.* The book's two-layer MLP (:func:`gradlab_book.demos.small_mlp`, 8 inputs,
32 hidden units) fits a noisy linear teacher (:func:`gradlab_book.demos.regression_data`,
512 samples, label noise 0.5) by SGD with momentum 0.9, on minibatches of 32 drawn with
replacement. :func:`batches` can make some batches bad (targets ``BAD_SCALE`` times too
large) or non-finite (a NaN input). :func:`train` runs it under a
:class:`gradlab.StepGuard` in ``"clip"`` mode at a fixed threshold and returns every
step's norm and decision; :func:`lr_sweep` does so over learning rates.

*The stored sweep.* Above a learning rate of about 0.05 these runs are chaotic: a change
in the last bit of one gradient (another CPU's float kernels) gives another run within a
few dozen steps, with another clip rate and another final loss. The chapter's sweep is
therefore recorded over :data:`SWEEP` ``["seeds"]`` by ``experiments/threshold_sweep.py``
(:func:`record_sweep`) into ``threshold_sweep.json`` (:mod:`gradlab_book.stored`), each
seed repeating the whole procedure: its own warm-up threshold (:func:`calibrate`), then
:func:`lr_sweep` at it. :func:`load_sweep` reads it and :func:`sweep_table` gives the
medians, smallest and largest values over the seeds.

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
import json
import math
import numbers
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from gradlab import StepGuard
from gradlab_book import demos, stored
from gradlab_book.figures.adaptive import PANEL_WIDTH, TEXT_PT, TRACES
from gradlab_book.plots import CLIP, KEEP, NONE, SKIP, THRESHOLD, new_figure

__all__ = [
    "BAD_SCALE",
    "DIVERGED",
    "EPS",
    "OPTIMIZERS",
    "RUN",
    "SWEEP",
    "SWEEP_PATH",
    "batches",
    "calibrate",
    "drift_figure",
    "drift_rates",
    "early_threshold",
    "final_loss",
    "load_sweep",
    "log_figure",
    "lr_sweep",
    "lr_sweep_figure",
    "make_data",
    "new_run",
    "over",
    "record_sweep",
    "rolling_rate",
    "silent_stretch",
    "sweep_table",
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

#: The optimizers :func:`new_run` builds: SGD with momentum (the chapter's), and Adam at
#: torch's defaults (betas 0.9, 0.999, eps 1e-8), for the cell on clipping under Adam.
OPTIMIZERS = ("sgd", "adam")

#: The stored sweep (``experiments/threshold_sweep.py``): the learning rates of the
#: chapter's table and of the re-tuning exercise, the seeds, the steps after which clip
#: rates are counted and the own threshold is taken (``settle``), the logged run's bad and
#: NaN batches and the warm-up window the threshold is set from (steps 51 to 100, 1-based),
#: and how many norms of each fixed-threshold run are kept for the prefix test.
SWEEP = {
    "lrs": [0.005, 0.01, 0.02, 0.05, 0.1, 0.2],
    "exercise_lrs": [0.015, 0.15],
    "seeds": [0, 1, 2, 3, 4],
    "settle": 100,
    "percentile": 90.0,
    "calibrate": [50, 100],
    "calibrate_lr": 0.01,
    "bad": [160, 240],
    "nan": [80, 220],
    "prefix": 20,
}

SWEEP_PATH = stored.path("threshold_sweep.json")

#: A final training loss above this counts as diverged (the untrained MLP starts near 3,
#: the re-tuned runs at the highest learning rates end near 15, diverged ones above 1e20).
DIVERGED = 1e3


# ----------------------------------------------------------------------- the run


def make_data() -> tuple[Tensor, Tensor]:
    """The training set: ``RUN["n"]`` samples of a noisy linear teacher."""
    return demos.regression_data(
        RUN["n"], d_in=RUN["d_in"], d_out=1, noise=RUN["noise"], seed=RUN["data_seed"]
    )


def new_run(
    lr: float, seed: int = 0, momentum: float = RUN["momentum"], optimizer: str = "sgd"
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh seeded MLP and its optimizer: SGD with ``momentum`` (0.9 unless told), or
    ``optimizer="adam"``, :class:`torch.optim.Adam` at its defaults (``momentum`` unused)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    model = demos.small_mlp(RUN["d_in"], RUN["hidden"], 1, seed=seed)
    if optimizer == "adam":
        return model, torch.optim.Adam(model.parameters(), lr=lr)
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
    optimizer: str = "sgd",
) -> dict[str, Any]:
    """Train under ``StepGuard(mode="clip", threshold=threshold, history=steps)``, with
    SGD (momentum ``momentum``) or Adam (``optimizer="adam"``, see :func:`new_run`).

    Returns every step's total norm (before clipping) and decision, the final
    training loss and the trained model.
    """
    x, y = make_data()
    model, optimizer = new_run(lr, seed, momentum, optimizer)
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
    lrs: Sequence[float],
    threshold: float,
    settle: int = 100,
    steps: int = RUN["steps"],
    seed: int = 0,
    prefix: int = 0,
) -> list[dict[str, Any]]:
    """Per learning rate: three runs of :func:`train` at ``seed``.

    * ``fixed``: clipped at ``threshold``;
    * ``own``: clipped at the 90th percentile of the fixed run's norms after step
      ``settle`` (the threshold re-tuned to this learning rate);
    * ``none``: no threshold (``inf``: only non-finite steps are skipped).

    Each row holds the learning rate, the own threshold, and for each run its final
    loss and its clip and skip rates over the steps from ``settle`` on; with ``prefix``,
    also the fixed run's first ``prefix`` norms (``fixed["prefix"]``), for a prefix test.
    """
    rows = []
    for lr in lrs:
        row: dict[str, Any] = {"lr": float(lr)}
        fixed = train(lr, threshold, steps, seed)
        own = float(np.percentile(fixed["norms"][settle:], 90))
        runs = {
            "fixed": fixed,
            "own": train(lr, own, steps, seed),
            "none": train(lr, math.inf, steps, seed),
        }
        row["own_threshold"] = own
        for name, run in runs.items():
            late = run["decisions"][settle:]
            row[name] = {
                "loss": run["loss"],
                "clip": float(np.mean(late == "clipped")),
                "skip": float(np.mean(late == "skipped")),
            }
        if prefix:
            row["fixed"]["prefix"] = [float(v) for v in fixed["norms"][:prefix]]
        rows.append(row)
    return rows


# -------------------------------------------------------------------- stored sweep


def calibrate(seed: int = 0, settings: dict[str, Any] = SWEEP) -> float:
    """The warm-up threshold of the chapter's logged run at ``seed``: the ``percentile``
    of the finite norms of the ``calibrate`` window (steps 51 to 100) of a run at
    ``calibrate_lr`` with no threshold (non-finite steps skipped), with the bad and NaN
    batches of the log. The same number as the chapter's cell, which sets the threshold
    at step 101 and so runs the first 100 steps with none."""
    start, end = settings["calibrate"]
    run = train(
        settings["calibrate_lr"], math.inf, end, seed, bad=settings["bad"], nan=settings["nan"]
    )
    window = run["norms"][start:end]
    return float(np.percentile(window[np.isfinite(window)], settings["percentile"]))


def record_sweep(settings: dict[str, Any] = SWEEP, steps: int = RUN["steps"]) -> dict[str, Any]:
    """The stored sweep: per seed of ``settings``, its :func:`calibrate` threshold and
    :func:`lr_sweep` at it over ``lrs`` and ``exercise_lrs`` (``steps`` shortens every
    run: a prefix, for the test), with the numeric platform
    (:func:`gradlab_book.stored.platform`)."""
    seeds = []
    for seed in settings["seeds"]:
        tau = calibrate(seed, settings)
        lrs = list(settings["lrs"]) + list(settings["exercise_lrs"])
        rows = lr_sweep(lrs, tau, settings["settle"], steps, seed, settings["prefix"])
        for row in rows:  # JSON has no inf: a diverged run's loss is stored as null
            for name in ("fixed", "own", "none"):
                if not math.isfinite(row[name]["loss"]):
                    row[name]["loss"] = None
        seeds.append({"seed": seed, "threshold": tau, "rows": rows})
    return {
        "description": "clip rates and final losses of the chapter's MLP at fixed, re-tuned "
        "and no thresholds, over learning rates and seeds; written by "
        "experiments/threshold_sweep.py",
        "settings": {**settings, "steps": steps},
        "platform": stored.platform(),
        "seeds": seeds,
    }


def load_sweep(path: Path | str = SWEEP_PATH) -> dict[str, Any]:
    """The stored sweep of :func:`record_sweep`, as written (JSON has no inf: a diverged
    run's loss is ``None`` there and ``inf`` here)."""
    data = json.loads(Path(path).read_text())
    for entry in data["seeds"]:
        for row in entry["rows"]:
            for name in ("fixed", "own", "none"):
                if row[name]["loss"] is None:
                    row[name]["loss"] = math.inf
    return data


def sweep_table(data: dict[str, Any], lrs: Sequence[float] | None = None) -> list[dict[str, Any]]:
    """Per learning rate (the table's, ``settings["lrs"]``, unless told): for each run
    (``fixed``, ``own``, ``none``) the per-seed losses and clip rates in seed order, their
    medians, and how many seeds diverged (a loss above :data:`DIVERGED`, or not finite);
    the per-seed own thresholds and their median. A diverged loss enters the median as
    ``inf``, so that the median says "diverged" once half the seeds have."""
    lrs = list(data["settings"]["lrs"] if lrs is None else lrs)
    table = []
    for lr in lrs:
        rows = [_row_at(entry, lr) for entry in data["seeds"]]
        line: dict[str, Any] = {"lr": float(lr), "seeds": [e["seed"] for e in data["seeds"]]}
        own = [r["own_threshold"] for r in rows]
        line["own_threshold"] = {"seeds": own, "median": float(np.median(own))}
        for name in ("fixed", "own", "none"):
            losses = [_finite_loss(float(r[name]["loss"])) for r in rows]
            clips = [float(r[name]["clip"]) for r in rows]
            line[name] = {
                "loss": losses,
                "clip": clips,
                "median_loss": float(np.median(losses)),
                "median_clip": float(np.median(clips)),
                "diverged": sum(math.isinf(v) for v in losses),
            }
        table.append(line)
    return table


def _finite_loss(loss: float) -> float:
    return loss if loss <= DIVERGED else math.inf  # NaN compares false: inf


def _row_at(entry: dict[str, Any], lr: float) -> dict[str, Any]:
    for row in entry["rows"]:
        if math.isclose(row["lr"], lr, rel_tol=1e-12):
            return row
    raise ValueError(f"the stored sweep has no learning rate {lr!r} at seed {entry['seed']}")


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
    (``numpy.percentile``, linear interpolation); ``inf`` if there is none.

    Raises:
        ValueError: ``percentile`` is not in [0, 100], or ``warmup`` is not an integer
            ``>= 0`` (a negative one would silently take all but the last steps).
    """
    _check_warmup(percentile, warmup)
    window = np.asarray(norms, dtype=float)[:warmup]
    finite = window[np.isfinite(window)]
    return float(np.percentile(finite, percentile)) if finite.size else math.inf


def _check_warmup(percentile: Any, warmup: Any) -> None:
    if not (isinstance(percentile, numbers.Real) and 0.0 <= percentile <= 100.0):
        raise ValueError(f"percentile must be a number in [0, 100], got {percentile!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, numbers.Integral) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")


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


def lr_sweep_figure(table: list[dict[str, Any]]) -> Figure:
    """The stored sweep over seeds (:func:`sweep_table`): left, the clip rate of the fixed
    and of the re-tuned threshold against the learning rate; right, the final loss of
    the three runs. Markers are the medians over the seeds, bars the smallest to the
    largest seed; a run whose median diverged is named in the title instead."""
    fig = new_figure(6.8, 3.1)
    left, right = fig.subplots(1, 2)
    lrs = np.array([line["lr"] for line in table])
    for key, label, colour, style in (
        ("fixed", "fixed threshold", CLIP, "o-"),
        ("own", "re-tuned (own p90)", KEEP, "s--"),
    ):
        clips = np.array([[100 * c for c in line[key]["clip"]] for line in table])
        mid = np.median(clips, axis=1)
        err = [mid - clips.min(axis=1), clips.max(axis=1) - mid]
        left.errorbar(lrs, mid, yerr=err, fmt=style, color=colour, capsize=3, label=label)
    left.axhline(50, color=THRESHOLD, lw=0.8, ls=":")
    left.annotate("half the steps", (lrs[0], 50), xytext=(0, 3), textcoords="offset points",
                  fontsize=8)  # fmt: skip
    left.set_xscale("log")
    left.set_ylim(0, 105)
    left.set_xlabel("learning rate")
    left.set_ylabel("% clipped after step 100")
    left.legend(fontsize=8, loc="upper left")
    diverged: dict[str, list[float]] = {}
    for key, label, colour, style in (
        ("none", "no threshold", NONE, "^:"),
        ("own", "re-tuned threshold", KEEP, "s--"),
        ("fixed", "fixed threshold", CLIP, "o-"),
    ):
        losses = np.array([line[key]["loss"] for line in table], dtype=float)
        mid = np.median(losses, axis=1)
        ok = np.isfinite(mid)
        if ok.any():
            low = np.where(np.isfinite(losses), losses, np.nan).min(axis=1, initial=np.inf)
            high = np.where(np.isfinite(losses), losses, -np.inf).max(axis=1)
            err = [np.maximum(mid - low, 0)[ok], np.maximum(high - mid, 0)[ok]]
            right.errorbar(lrs[ok], mid[ok], yerr=err, fmt=style, color=colour, capsize=3,
                           label=label)  # fmt: skip
        if not ok.all():
            diverged[label] = [float(lr) for lr in lrs[~ok]]
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("learning rate")
    right.set_ylabel("final training loss")
    right.legend(fontsize=8, loc="upper left")
    if diverged:
        words = "; ".join(
            f"{label}: diverged at lr {', '.join(f'{lr:g}' for lr in values)}"
            for label, values in diverged.items()
        )
        right.set_title(words, fontsize=8)
    return fig


def drift_figure(percentile: float, warmup: int, traces: dict[str, Any], span: int = 100) -> Figure:
    """Each recorded trace with the threshold set at ``percentile`` of its first
    ``warmup`` steps (shaded); under each, the share of the last 50 steps over it, against
    the ``100 - percentile`` % that the threshold was meant to give. Drawn for a phone
    (:data:`gradlab_book.figures.adaptive.PANEL_WIDTH`, one panel under the other). A
    warm-up longer than a trace leaves that trace without a threshold, and says so.

    Raises:
        ValueError: as :func:`early_threshold`, before anything is drawn.
    """
    _check_warmup(percentile, warmup)  # before anything is drawn
    fig = new_figure(PANEL_WIDTH, 7.2)
    axes = fig.subplots(2 * len(TRACES), 1, height_ratios=[2, 1] * len(TRACES))
    target = 100 - percentile
    for row, (name, label) in enumerate(TRACES.items()):
        top, bottom = axes[2 * row], axes[2 * row + 1]
        norms = np.asarray(traces[name]["norms"], dtype=float)
        steps = np.arange(1, len(norms) + 1)
        tau = early_threshold(norms, percentile, warmup)
        flags = over(norms, tau)
        top.plot(steps, norms, color=NONE, lw=0.7, zorder=1, label="norm")
        top.scatter(steps[flags], norms[flags], s=16, marker="x", color=CLIP, label="over",
                    zorder=3)  # fmt: skip
        if math.isfinite(tau):
            top.axhline(tau, color=THRESHOLD, ls="--", lw=1.0, label="threshold")
        top.axvspan(0, min(warmup, len(norms)), color=NONE, alpha=0.15, lw=0)
        top.set_yscale("log")
        after = flags[warmup : warmup + span]
        if after.size and math.isfinite(tau):
            late = flags[-span:]
            words = (
                f"over it: {100 * after.mean():.0f}% of steps {warmup + 1}-{warmup + after.size},"
                f"\n{100 * late.mean():.0f}% of the last {late.size}"
            )
        else:
            words = "no threshold: the warm-up is\nthe whole trace"
        top.set_title(f"{label}\n{words}", fontsize=TEXT_PT)
        top.set_ylabel("gradient norm")
        rolling = 100 * rolling_rate(flags, 50)
        bottom.plot(steps, rolling, color=CLIP, lw=1.2)
        bottom.axhline(target, color=THRESHOLD, ls=":", lw=0.9)
        bottom.annotate(f"{target:g}%", (len(norms), target), xytext=(2, 2),
                        textcoords="offset points", fontsize=TEXT_PT, ha="right")  # fmt: skip
        bottom.set_ylim(-3, 103)
        bottom.set_ylabel("% over,\nlast 50")
        for ax in (top, bottom):
            ax.tick_params(labelsize=TEXT_PT)
            ax.yaxis.label.set_size(TEXT_PT)
    axes[-1].set_xlabel("step", fontsize=TEXT_PT)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize=TEXT_PT,
               markerscale=1.3)  # fmt: skip
    fig.suptitle(
        f"threshold: percentile {percentile:g}\nof the first {warmup} steps (shaded)",
        fontsize=TEXT_PT,
    )
    return fig
