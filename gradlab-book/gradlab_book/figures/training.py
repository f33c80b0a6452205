r"""Clip versus ignore in a small, reproducible training experiment (book/training/clip_vs_ignore).

A two-layer MLP learns a noisy linear teacher with SGD and momentum. At every step a
seeded coin decides whether the batch is *corrupted*: its labels get Gaussian noise
``corruption_scale`` times larger than the signal, the kind of batch a broken data
shard, a mislabelled chunk or a numerical glitch produces. Six ways of handling the
gradient are compared on the *same* batches (paired by seed):

``none``          no control;
``clip_norm``     :func:`gradlab.clip_grad_norm_` at ``tau_norm``;
``clip_value``    :func:`gradlab.clip_grad_value_` at ``tau_value``;
``ignore_norm``   :func:`gradlab.grad_ignore_norm_` at ``tau_norm``, then ``optimizer.step()``
                  (the gradient is zeroed, the momentum buffer still moves the weights);
``ignore_value``  :func:`gradlab.grad_ignore_value_` at ``tau_value``, then the step;
``skip``          :class:`gradlab.StepGuard` in ``mode="skip"``: the step is not taken.

Thresholds are *matched* by calibration: ``tau_norm`` and ``tau_value`` are the same
percentile of the total 2-norm and of the largest absolute entry, measured on clean
batches along uncorrupted training runs with seeds that the experiment never uses. At
percentile ``q`` each rule therefore rejects about ``100 - q`` percent of clean batches:
the two kinds of threshold make the same number of false alarms.

Compute functions return plain numbers and numpy arrays; figure functions draw them.

The grid of the chapter's explorable (every method at three thresholds and three
corruption rates) is computed by ``experiments/clip_vs_ignore_grid.py`` and stored in
``clip_vs_ignore_grid.json`` (:mod:`gradlab_book.stored`); :func:`load_grid` reads it back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

import gradlab
from gradlab.guard import StepGuard
from gradlab_book import stored
from gradlab_book.demos import mse_or_inf, regression_data, small_mlp
from gradlab_book.plots import CLIP, IGNORE, KEEP, NONE, SKIP, THRESHOLD, new_figure

__all__ = [
    "FAIL_FACTOR",
    "GRID_PATH",
    "METHODS",
    "Experiment",
    "RunResult",
    "Setup",
    "Thresholds",
    "acted_table",
    "band",
    "clean_statistics",
    "clipped_displacement",
    "corrupt_labels",
    "corruption_schedule",
    "experiment_grid",
    "grid_figure",
    "grid_from_dict",
    "grid_to_dict",
    "load_grid",
    "loss_curves_figure",
    "make_data",
    "norm_trace_figure",
    "run_experiment",
    "seed_table",
    "stall_table",
    "summary_rows",
    "thresholds_at",
    "train_run",
]

METHODS = ("none", "clip_norm", "clip_value", "ignore_norm", "ignore_value", "skip")

LABELS = {
    "none": "no control",
    "clip_norm": "clip by norm",
    "clip_value": "clip by value",
    "ignore_norm": "ignore by norm (zero grads)",
    "ignore_value": "ignore by value (zero grads)",
    "skip": "skip the step (StepGuard)",
}
COLOURS = {
    "none": NONE,
    "clip_norm": CLIP,
    "clip_value": CLIP,
    "ignore_norm": IGNORE,
    "ignore_value": IGNORE,
    "skip": SKIP,
}
STYLES = {
    "none": "-",
    "clip_norm": "-",
    "clip_value": "--",
    "ignore_norm": "-",
    "ignore_value": "--",
    "skip": ":",
}

#: Losses above this are drawn at the top edge of the plots (a diverged run is inf).
LOSS_CEILING = 1e3


@dataclass(frozen=True)
class Setup:
    """Everything about one training run except the seed, the method and the thresholds."""

    n_train: int = 512
    n_test: int = 256
    d_in: int = 8
    hidden: int = 16
    batch: int = 16
    steps: int = 150
    lr: float = 0.01
    momentum: float = 0.9
    label_noise: float = 0.5
    corruption_scale: float = 15.0
    eval_every: int = 10
    data_seed: int = 0


@dataclass(frozen=True)
class Thresholds:
    """Matched thresholds: the same percentile of clean-batch statistics."""

    percentile: float
    norm: float
    value: float


@dataclass
class RunResult:
    """The record of one training run."""

    method: str
    seed: int
    eval_steps: np.ndarray  # steps at which the test loss was measured
    test_loss: np.ndarray  # inf once the run has diverged
    total_norm: np.ndarray  # total 2-norm of each step's gradient, before any control
    max_abs: np.ndarray  # largest |entry| of each step's gradient, before any control
    acted: np.ndarray  # True where the control clipped, zeroed or skipped
    corrupted: np.ndarray  # True where the batch was corrupted

    @property
    def final_test_loss(self) -> float:
        return float(self.test_loss[-1])

    @property
    def diverged(self) -> bool:
        return not math.isfinite(self.final_test_loss)


@dataclass
class Experiment:
    """Runs of every method over several seeds at one (thresholds, corruption rate)."""

    rate: float
    thresholds: Thresholds
    setup: Setup
    runs: dict[str, list[RunResult]] = field(default_factory=dict)


# ----------------------------------------------------------------------------- data


def make_data(setup: Setup = Setup()) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Train and test sets drawn from one noisy linear teacher: ``x_tr, y_tr, x_te, y_te``."""
    x, y = regression_data(
        setup.n_train + setup.n_test, setup.d_in, 1, setup.label_noise, setup.data_seed
    )
    return x[: setup.n_train], y[: setup.n_train], x[setup.n_train :], y[setup.n_train :]


def corruption_schedule(steps: int, rate: float, seed: int) -> np.ndarray:
    """Which of ``steps`` batches are corrupted: independent coins of probability ``rate``.

    The same seed gives the same schedule whatever the method, so methods are compared
    on identical batches. ``rate`` is clipped into [0, 1].
    """
    rate = min(max(float(rate), 0.0), 1.0)
    coins = np.random.default_rng([seed, 7]).random(steps)
    return coins < rate


def corrupt_labels(y: Tensor, scale: float, generator: torch.Generator) -> Tensor:
    """``y`` plus Gaussian noise of standard deviation ``scale`` (a new tensor)."""
    return y + scale * torch.randn(y.shape, generator=generator)


def _batch_order(setup: Setup, seed: int) -> Tensor:
    """Indices of each step's batch: shuffled epochs, seeded."""
    g = torch.Generator().manual_seed(10_000 + seed)
    per_epoch = setup.n_train // setup.batch
    epochs = -(-setup.steps // per_epoch)
    order = torch.cat([torch.randperm(setup.n_train, generator=g) for _ in range(epochs)])
    return order[: setup.steps * setup.batch].view(setup.steps, setup.batch)


# ------------------------------------------------------------------------- training


def train_run(
    method: str,
    seed: int,
    rate: float,
    thresholds: Thresholds | None = None,
    setup: Setup = Setup(),
) -> RunResult:
    """Train one model with one gradient control; record norms, decisions and test loss.

    Args:
        method: one of :data:`METHODS`.
        seed: initialisation, batch order and corruption schedule.
        rate: probability that a batch is corrupted.
        thresholds: ``tau_norm`` / ``tau_value``; ``None`` means infinite (never act).
        setup: sizes and optimiser settings.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    tau_norm = math.inf if thresholds is None else thresholds.norm
    tau_value = math.inf if thresholds is None else thresholds.value
    x_tr, y_tr, x_te, y_te = make_data(setup)
    model = small_mlp(setup.d_in, setup.hidden, 1, seed=seed)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=setup.lr, momentum=setup.momentum)
    guard = None
    if method == "skip":
        # No limit on consecutive skips: the book's sweeps include thresholds that skip
        # (nearly) every step on purpose.
        guard = StepGuard(
            optimizer, mode="skip", by="norm", threshold=tau_norm, max_consecutive_skips=None
        )

    schedule = corruption_schedule(setup.steps, rate, seed)
    order = _batch_order(setup, seed)
    noise = torch.Generator().manual_seed(20_000 + seed)
    norms = np.full(setup.steps, np.nan)
    maxes = np.full(setup.steps, np.nan)
    acted = np.zeros(setup.steps, dtype=bool)
    eval_steps, losses = [0], [mse_or_inf(model, x_te, y_te)]

    for step in range(setup.steps):
        xb, yb = x_tr[order[step]], y_tr[order[step]]
        if schedule[step]:
            yb = corrupt_labels(yb, setup.corruption_scale, noise)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(xb), yb).backward()
        grads = [p.grad for p in params]
        norms[step] = gradlab.get_total_norm(grads, 2.0).item()
        maxes[step] = gradlab.get_total_norm(grads, math.inf).item()
        if method == "clip_norm":
            gradlab.clip_grad_norm_(params, tau_norm)
            acted[step] = not tau_norm / (norms[step] + 1e-6) >= 1
        elif method == "clip_value":
            gradlab.clip_grad_value_(params, tau_value)
            acted[step] = not maxes[step] <= tau_value
        elif method == "ignore_norm":
            gradlab.grad_ignore_norm_(params, tau_norm)
            acted[step] = not tau_norm / (norms[step] + 1e-6) >= 1
        elif method == "ignore_value":
            gradlab.grad_ignore_value_(params, tau_value)
            acted[step] = not maxes[step] < tau_value
        if guard is not None:
            acted[step] = guard.step().decision != "kept"
        else:
            optimizer.step()
        if (step + 1) % setup.eval_every == 0 or step + 1 == setup.steps:
            eval_steps.append(step + 1)
            losses.append(mse_or_inf(model, x_te, y_te))
            if not math.isfinite(losses[-1]):  # diverged: the rest is inf, stop early
                remaining = [
                    s
                    for s in range(step + 2, setup.steps + 1)
                    if s % setup.eval_every == 0 or s == setup.steps
                ]
                eval_steps += remaining
                losses += [math.inf] * len(remaining)
                break
    return RunResult(
        method=method,
        seed=seed,
        eval_steps=np.asarray(eval_steps),
        test_loss=np.asarray(losses, dtype=float),
        total_norm=norms,
        max_abs=maxes,
        acted=acted,
        corrupted=schedule,
    )


# --------------------------------------------------------------------- calibration


def clean_statistics(
    setup: Setup = Setup(), seeds: Sequence[int] = (900, 901, 902)
) -> tuple[np.ndarray, np.ndarray]:
    """Total 2-norms and largest |entries| of every gradient along clean, uncontrolled runs.

    The seeds are disjoint from the experiment's, so the thresholds never see the
    batches they will judge.
    """
    runs = [train_run("none", s, 0.0, None, setup) for s in seeds]
    norms = np.concatenate([r.total_norm for r in runs])
    maxes = np.concatenate([r.max_abs for r in runs])
    return norms[np.isfinite(norms)], maxes[np.isfinite(maxes)]


def thresholds_at(percentile: float, norms: np.ndarray, maxes: np.ndarray) -> Thresholds:
    """The matched thresholds at ``percentile`` (0 to 100) of the clean statistics.

    ``percentile >= 100`` gives infinite thresholds (never act); empty statistics too.
    """
    q = float(percentile)
    if not 0.0 <= q <= 100.0 or math.isnan(q):
        raise ValueError(f"percentile must be in [0, 100], got {percentile!r}")
    if q >= 100.0 or len(norms) == 0 or len(maxes) == 0:
        return Thresholds(q, math.inf, math.inf)
    return Thresholds(q, float(np.percentile(norms, q)), float(np.percentile(maxes, q)))


def run_experiment(
    rate: float,
    thresholds: Thresholds,
    seeds: Sequence[int] = (0, 1, 2, 3, 4),
    setup: Setup = Setup(),
    methods: Sequence[str] = METHODS,
) -> Experiment:
    """Every method on every seed, at one corruption rate and one pair of thresholds."""
    experiment = Experiment(rate=rate, thresholds=thresholds, setup=setup)
    for method in methods:
        experiment.runs[method] = [train_run(method, s, rate, thresholds, setup) for s in seeds]
    return experiment


def experiment_grid(
    percentiles: Sequence[float],
    rates: Sequence[float],
    norms: np.ndarray,
    maxes: np.ndarray,
    seeds: Sequence[int] = (0, 1, 2),
    setup: Setup = Setup(),
    methods: Sequence[str] = METHODS,
) -> dict[tuple[float, float], Experiment]:
    """:func:`run_experiment` at every (percentile, rate) pair, for the explorable figure.

    The uncontrolled runs do not depend on the thresholds, so they are trained once
    per rate and shared by every percentile.
    """
    others = [m for m in methods if m != "none"]
    uncontrolled = {
        r: [train_run("none", s, r, None, setup) for s in seeds] for r in rates if "none" in methods
    }
    grid = {}
    for q in percentiles:
        thresholds = thresholds_at(q, norms, maxes)
        for r in rates:
            experiment = run_experiment(r, thresholds, seeds, setup, others)
            if "none" in methods:
                experiment.runs = {"none": uncontrolled[r], **experiment.runs}
            grid[(q, r)] = experiment
    return grid


#: The stored grid of the chapter's explorable, written by experiments/clip_vs_ignore_grid.py.
GRID_PATH = stored.path("clip_vs_ignore_grid.json")


def _bits(mask: np.ndarray) -> str:
    return "".join("1" if b else "0" for b in mask)


def _run_to_dict(run: RunResult) -> dict[str, Any]:
    # JSON has no inf: a diverged evaluation is stored as null. Floats round-trip exactly.
    losses = [float(v) if math.isfinite(v) else None for v in run.test_loss]
    return {
        "method": run.method,
        "seed": run.seed,
        "eval_steps": [int(s) for s in run.eval_steps],
        "test_loss": losses,
        "acted": _bits(run.acted),
        "corrupted": _bits(run.corrupted),
    }


def _run_from_dict(values: dict[str, Any]) -> RunResult:
    steps = len(values["acted"])
    losses = [math.inf if v is None else v for v in values["test_loss"]]
    return RunResult(
        method=values["method"],
        seed=values["seed"],
        eval_steps=np.asarray(values["eval_steps"]),
        test_loss=np.asarray(losses, dtype=float),
        total_norm=np.full(steps, np.nan),  # not stored: the grid figure does not use them
        max_abs=np.full(steps, np.nan),
        acted=np.array([c == "1" for c in values["acted"]], dtype=bool),
        corrupted=np.array([c == "1" for c in values["corrupted"]], dtype=bool),
    )


def grid_to_dict(grid: dict[tuple[float, float], Experiment]) -> dict[str, Any]:
    """:func:`experiment_grid`'s result as JSON-ready plain values.

    Kept per run: the test-loss curve, and which steps were acted on and corrupted
    (what :func:`grid_figure` and :func:`summary_rows` use); the per-step norms are not.
    """
    cells = []
    for (q, r), experiment in grid.items():
        cells.append(
            {
                "percentile": q,
                "rate": r,
                "thresholds": asdict(experiment.thresholds),
                "runs": {m: [_run_to_dict(x) for x in runs] for m, runs in experiment.runs.items()},
            }
        )
    setup = next(iter(grid.values())).setup if grid else Setup()
    return {"setup": asdict(setup), "cells": cells}


def grid_from_dict(data: dict[str, Any]) -> dict[tuple[float, float], Experiment]:
    """The grid stored by :func:`grid_to_dict`, as :class:`Experiment` objects.

    The runs' ``total_norm`` and ``max_abs`` are NaN: they are not stored.
    """
    setup = Setup(**data["setup"])
    grid = {}
    for cell in data["cells"]:
        experiment = Experiment(
            rate=cell["rate"], thresholds=Thresholds(**cell["thresholds"]), setup=setup
        )
        experiment.runs = {m: [_run_from_dict(x) for x in runs] for m, runs in cell["runs"].items()}
        grid[(cell["percentile"], cell["rate"])] = experiment
    return grid


def load_grid(path: Path | str = GRID_PATH) -> dict[tuple[float, float], Experiment]:
    """The stored grid of the chapter's explorable (see :func:`grid_from_dict`)."""
    data = json.loads(Path(path).read_text())
    return grid_from_dict(data)


# ------------------------------------------------------------------------ summaries


def band(runs: Sequence[RunResult]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Steps, and the median, minimum and maximum test loss across runs at each step.

    A diverged run counts as an infinite loss, so it pulls the maximum (and, if it is
    half of the runs or more, the median) to infinity rather than vanishing.
    """
    if not runs:
        empty = np.zeros(0)
        return empty, empty, empty, empty
    losses = np.stack([np.where(np.isfinite(r.test_loss), r.test_loss, np.inf) for r in runs])
    return runs[0].eval_steps, np.median(losses, axis=0), losses.min(0), losses.max(0)


def summary_rows(experiment: Experiment) -> list[dict[str, object]]:
    """One row per method: final test loss (median, min, max), share of steps acted on,
    and how many of the acted-on steps were corrupted batches (precision) and how many
    corrupted batches were acted on (recall)."""
    rows = []
    for method, runs in experiment.runs.items():
        finals = np.array([r.final_test_loss for r in runs])
        acted = np.concatenate([r.acted for r in runs])
        corrupted = np.concatenate([r.corrupted for r in runs])
        hits = int(np.sum(acted & corrupted))
        rows.append(
            {
                "method": method,
                "median": float(np.median(finals)),
                "min": float(finals.min()),
                "max": float(finals.max()),
                "diverged": int(np.sum(~np.isfinite(finals))),
                "acted": float(acted.mean()) if acted.size else 0.0,
                "precision": hits / int(acted.sum()) if acted.sum() else math.nan,
                "recall": hits / int(corrupted.sum()) if corrupted.sum() else math.nan,
            }
        )
    return rows


# -------------------------------------------------------------------------- figures


def _log_if_positive(ax, axis: str, *arrays) -> None:
    """Use a log scale on ``axis`` only if some value is finite and positive."""
    values = np.concatenate([np.ravel(np.asarray(a, dtype=float)) for a in arrays] or [[]])
    if np.any(np.isfinite(values) & (values > 0)):
        getattr(ax, f"set_{axis}scale")("log")


def _draw_bands(ax, experiment: Experiment, methods: Sequence[str], fill: bool = True) -> None:
    for method in methods:
        runs = experiment.runs.get(method, [])
        if not runs:
            continue
        steps, median, lo, hi = band(runs)
        median, lo, hi = (np.minimum(a, LOSS_CEILING) for a in (median, lo, hi))
        colour = COLOURS[method]
        ax.plot(steps, median, STYLES[method], color=colour, lw=1.6, label=LABELS[method])
        if fill:
            ax.fill_between(steps, lo, hi, color=colour, alpha=0.12, lw=0)
        _log_if_positive(ax, "y", median, lo, hi)
    ax.set_xlabel("step")
    ax.set_ylabel("test loss (MSE)")


def loss_curves_figure(experiment: Experiment, methods: Sequence[str] = METHODS) -> Figure:
    """Median test loss over seeds, with the min-max band, one panel for clipping and
    one for ignoring/skipping (both with the uncontrolled run for reference)."""
    fig = new_figure(6.4, 3.4)
    axes = fig.subplots(1, 2, sharey=True)
    left = [m for m in ("none", "clip_norm", "clip_value") if m in methods]
    right = [m for m in ("none", "ignore_norm", "ignore_value", "skip") if m in methods]
    for ax, group, title in [(axes[0], left, "clip"), (axes[1], right, "ignore / skip")]:
        _draw_bands(ax, experiment, group)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7, loc="upper right")
    axes[1].set_ylabel("")
    n = len(next(iter(experiment.runs.values()), []))
    fig.suptitle(
        f"{100 * experiment.rate:.0f}% corrupted batches, thresholds at the "
        f"{experiment.thresholds.percentile:g}th percentile, {n} seeds (median, min-max)",
        fontsize=9,
    )
    return fig


def norm_trace_figure(run: RunResult, threshold: float) -> Figure:
    """The total gradient norm at every step, the threshold, and what happened."""
    fig = new_figure(6.4, 3.0)
    ax = fig.subplots()
    steps = np.arange(1, len(run.total_norm) + 1)
    norms = np.where(np.isfinite(run.total_norm), run.total_norm, np.nan)
    ax.plot(steps, norms, color=NONE, lw=0.8, zorder=1)
    kept = ~run.acted
    acted_colour = SKIP if run.method == "skip" else IGNORE if "ignore" in run.method else CLIP
    verb = {"skip": "skipped", "ignore_norm": "ignored", "ignore_value": "ignored"}.get(
        run.method, "clipped" if run.method.startswith("clip") else "acted on"
    )
    for mask, colour, label, marker in [
        (kept & ~run.corrupted, KEEP, "kept, clean batch", "o"),
        (kept & run.corrupted, KEEP, "kept, corrupted batch", "x"),
        (run.acted & ~run.corrupted, acted_colour, f"{verb}, clean batch", "o"),
        (run.acted & run.corrupted, acted_colour, f"{verb}, corrupted batch", "x"),
    ]:
        if mask.any():
            ax.scatter(steps[mask], norms[mask], s=14, color=colour, marker=marker, label=label)
    if math.isfinite(threshold) and threshold > 0:
        ax.axhline(threshold, color=THRESHOLD, lw=1, ls="--", label=f"threshold {threshold:.3g}")
    _log_if_positive(ax, "y", norms, [threshold])
    ax.set_xlabel("step")
    ax.set_ylabel("total gradient norm")
    ax.set_title(f"{LABELS.get(run.method, run.method)}, seed {run.seed}", fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    return fig


def grid_figure(
    percentile: float,
    rate: float,
    grid: dict[tuple[float, float], Experiment],
    methods: Sequence[str] = METHODS,
) -> Figure:
    """One cell of :func:`experiment_grid`: median loss curves and final-loss bars."""
    experiment = grid[(percentile, rate)]
    fig = new_figure(6.4, 3.4)
    left, right = fig.subplots(1, 2, width_ratios=[1.6, 1])
    _draw_bands(left, experiment, methods, fill=False)
    left.set_ylim(0.1, LOSS_CEILING * 1.5)
    left.legend(fontsize=6.5, loc="upper right")
    rows = {row["method"]: row for row in summary_rows(experiment)}
    shown = [m for m in methods if m in rows]
    finals = [min(rows[m]["median"], LOSS_CEILING) for m in shown]
    y = np.arange(len(shown))
    right.barh(y, finals, color=[COLOURS[m] for m in shown], alpha=0.85)
    right.set_yticks(y, [LABELS[m].split(" (")[0] for m in shown], fontsize=7)
    right.invert_yaxis()
    _log_if_positive(right, "x", finals)
    right.set_xlim(0.1, LOSS_CEILING * 1.5)
    right.set_xlabel("final test loss (median)")
    for yi, m in zip(y, shown, strict=True):
        right.text(0.12, yi, f"acted {100 * rows[m]['acted']:.0f}%", va="center", fontsize=6.5)
    t = experiment.thresholds
    fig.suptitle(
        f"{100 * rate:.0f}% corrupted, thresholds at percentile {percentile:g} "
        f"(norm {t.norm:.3g}, value {t.value:.3g})",
        fontsize=9,
    )
    return fig


# ------------------------------------------------------------------------ tables

#: A run *fails* when its final test loss is above this many times the median final
#: test loss of the uncontrolled runs on clean data.
FAIL_FACTOR = 3.0


def _label(method: str) -> str:
    return LABELS[method].replace(" (zero grads)", "").replace("the step ", "")


def seed_table(
    experiment: Experiment, reference: Experiment, fail_factor: float = FAIL_FACTOR
) -> str:
    """Every seed's final test loss, with the mean, the median and the failures.

    ``reference`` holds the uncontrolled runs on clean data (method ``"none"``); a run
    fails when its final test loss is above ``fail_factor`` times their median.
    """
    clean = np.array([r.final_test_loss for r in reference.runs["none"]])
    limit = fail_factor * float(np.median(clean))
    seeds = [r.seed for r in reference.runs["none"]]
    head = f"{'final test loss':22}" + "".join(f"{f's{s}':>6}" for s in seeds)
    lines = [head + f"{'mean':>7}{'median':>7}{'failed':>7}"]
    rows = [("clean data, no control", clean)]
    for method, runs in experiment.runs.items():
        rows.append((_label(method), np.array([r.final_test_loss for r in runs])))
    for label, finals in rows:
        cells = "".join(f"{v:>6.2g}" for v in finals)
        failed = f"{int(np.sum(~(finals <= limit)))}/{len(finals)}"
        stats = f"{np.mean(finals):>7.3g}{np.median(finals):>7.3g}{failed:>7}"
        lines.append(f"{label[:22]:22}{cells}{stats}")
    lines.append(f"(failed: final test loss above {fail_factor:g} x {np.median(clean):.2g})")
    return "\n".join(lines)


def acted_table(experiment: Experiment) -> str:
    """What each control acted on: share of steps, precision, recall, clean steps."""
    lines = [f"{'steps acted on':22}{'share':>7}{'precision':>10}{'recall':>7}{'clean':>7}"]
    for row in summary_rows(experiment):
        runs = experiment.runs[row["method"]]
        clean = np.concatenate([r.acted[~r.corrupted] for r in runs]).mean()
        precision = "" if math.isnan(row["precision"]) else f"{100 * row['precision']:.0f}%"
        recall = "" if math.isnan(row["recall"]) else f"{100 * row['recall']:.0f}%"
        lines.append(
            f"{_label(row['method'])[:22]:22}{100 * row['acted']:>6.0f}%{precision:>10}"
            f"{recall:>7}{100 * clean:>6.0f}%"
        )
    return "\n".join(lines)


def stall_table(experiments: dict[float, Experiment], method: str = "ignore_norm") -> str:
    """Seed by seed, for each threshold percentile: the final test loss, how many of
    the first 30 steps the control acted on, and the last step it kept."""
    lines = [
        f"{'q':>3} {'tau':>6} {'seed':>4} {'final':>7} {'acted, steps 1-30':>18} {'last kept':>9}"
    ]
    for q, experiment in experiments.items():
        for run in experiment.runs[method]:
            kept = np.flatnonzero(~run.acted)
            last = str(kept[-1] + 1) if kept.size else "none"
            early = int(run.acted[:30].sum())
            lines.append(
                f"{q:>3g} {experiment.thresholds.norm:>6.3g} {run.seed:>4} "
                f"{run.final_test_loss:>7.2g} {early:>18} {last:>9}"
            )
    return "\n".join(lines)


def clipped_displacement(
    tau: float, lr: float, momentum: float, steps: int = 300, repeat: bool = False
) -> tuple[float, float]:
    r"""How far ``torch.optim.SGD`` moves a parameter for a gradient of norm ``tau``.

    ``repeat=False``: one gradient of norm ``tau``, then zero gradients; returns (the
    first step's length, the total displacement after ``steps`` steps), which tends to
    :math:`\eta\tau/(1-\mu)`. ``repeat=True``: the same gradient at every step; returns
    (the first step's length, the last step's length), the steady state
    :math:`\eta\tau/(1-\mu)` per step.
    """
    theta = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([theta], lr=lr, momentum=momentum)
    g = torch.tensor([0.6, 0.8], dtype=torch.float64) * tau
    lengths = []
    for t in range(steps):
        before = theta.detach().clone()
        theta.grad = g.clone() if (repeat or t == 0) else torch.zeros_like(g)
        opt.step()
        lengths.append(float(torch.linalg.vector_norm(theta.detach() - before)))
    if repeat:
        return lengths[0], lengths[-1]
    return lengths[0], float(torch.linalg.vector_norm(theta.detach()))
