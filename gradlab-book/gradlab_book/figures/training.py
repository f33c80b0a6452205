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
``skip``          :class:`gradlab.StepGuard` in ``mode="skip"``: the step is not taken;
``skip_limit``    the skip with a limit: after ``skip_limit`` skips in a row, the next
                  step is taken clipped to ``tau_norm`` (``max_consecutive_skips``,
                  ``on_skip_limit="take"``);
``clip_skip``     the hybrid, ``StepGuard(mode="clip", threshold=tau_norm,
                  skip_above=skip_factor * tau_norm)``: clip the ordinary large steps,
                  skip the far larger ones, and after ``skip_limit`` skips in a row take
                  the next step clipped (``on_skip_limit="take"``).

Thresholds are *matched* by calibration: ``tau_norm`` and ``tau_value`` are the same
percentile of the total 2-norm and of the largest absolute entry, measured on clean
batches along uncorrupted training runs with seeds that the experiment never uses. At
percentile ``q`` each rule therefore rejects about ``100 - q`` percent of clean batches:
the two kinds of threshold make the same number of false alarms.

Compute functions return plain numbers and numpy arrays; figure functions draw them.

The chapter's data (every method at seven thresholds, three corruption rates and five
seeds, the calibration, and the runs its threshold exercise is scored on) are computed
by ``experiments/clip_vs_ignore_grid.py`` and stored in ``clip_vs_ignore_grid.json``
(:mod:`gradlab_book.stored`, with the numeric platform that wrote them);
:func:`load_grid` and :func:`load_data` read them back.
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
    "best_percentile",
    "bits_from_hex",
    "bits_to_hex",
    "clean_statistics",
    "clipped_displacement",
    "corrupt_labels",
    "corruption_schedule",
    "eval_steps_of",
    "experiment_grid",
    "float32_text",
    "grid_figure",
    "grid_from_dict",
    "grid_to_dict",
    "load_data",
    "load_grid",
    "loss_curves_figure",
    "make_data",
    "norm_trace_figure",
    "percentiles_of",
    "run_experiment",
    "seed_table",
    "stall_table",
    "stored_trace",
    "summary_rows",
    "sweep_figure",
    "sweep_table",
    "thresholds_at",
    "train_run",
    "tuned_table",
]

METHODS = (
    "none",
    "clip_norm",
    "clip_value",
    "ignore_norm",
    "ignore_value",
    "skip",
    "skip_limit",
    "clip_skip",
)

LABELS = {
    "none": "no control",
    "clip_norm": "clip by norm",
    "clip_value": "clip by value",
    "ignore_norm": "ignore by norm (zero grads)",
    "ignore_value": "ignore by value (zero grads)",
    "skip": "skip the step (StepGuard)",
    "skip_limit": "skip, take the 11th in a row",
    "clip_skip": "clip, skip above 2τ",
}
COLOURS = {
    "none": NONE,
    "clip_norm": CLIP,
    "clip_value": CLIP,
    "ignore_norm": IGNORE,
    "ignore_value": IGNORE,
    "skip": SKIP,
    "skip_limit": SKIP,
    "clip_skip": SKIP,
}
STYLES = {
    "none": "-",
    "clip_norm": "-",
    "clip_value": "--",
    "ignore_norm": "-",
    "ignore_value": "--",
    "skip": ":",
    "skip_limit": "--",
    "clip_skip": "-.",
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
    skip_factor: float = 2.0  # clip_skip: skip_above = skip_factor * tau_norm
    skip_limit: int = 10  # skip_limit, clip_skip: after this many skips in a row, take one


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
    skipped: np.ndarray | None = None  # skip, clip_skip: True where the step was skipped
    limited: np.ndarray | None = None  # clip_skip: taken clipped by the skip limit

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
    # A step beyond skip_above that is still taken (clipped) was taken by the skip limit.
    skip_above = tau_norm
    if method == "skip":
        # No limit on consecutive skips: the book's sweeps include thresholds that skip
        # (nearly) every step, and skip_limit is the same rule with one.
        guard = StepGuard(optimizer, mode="skip", by="norm", threshold=tau_norm)
    elif method == "skip_limit":
        guard = StepGuard(
            optimizer,
            mode="skip",
            by="norm",
            threshold=tau_norm,
            max_consecutive_skips=setup.skip_limit,
            on_skip_limit="take",
        )
    elif method == "clip_skip":
        skip_above = setup.skip_factor * tau_norm
        guard = StepGuard(
            optimizer,
            mode="clip",
            by="norm",
            threshold=tau_norm,
            skip_above=skip_above,
            max_consecutive_skips=setup.skip_limit,
            on_skip_limit="take",
        )

    schedule = corruption_schedule(setup.steps, rate, seed)
    order = _batch_order(setup, seed)
    noise = torch.Generator().manual_seed(20_000 + seed)
    norms = np.full(setup.steps, np.nan)
    maxes = np.full(setup.steps, np.nan)
    acted = np.zeros(setup.steps, dtype=bool)
    skipped = np.zeros(setup.steps, dtype=bool) if guard is not None else None
    limited = np.zeros(setup.steps, dtype=bool) if method in ("skip_limit", "clip_skip") else None
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
            decision = guard.step().decision
            acted[step] = decision != "kept"
            skipped[step] = decision == "skipped"
            if limited is not None:
                # keep_by_norm's rule, as the guard's
                beyond = not skip_above / (norms[step] + 1e-6) >= 1
                limited[step] = decision == "clipped" and beyond
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
        skipped=skipped,
        limited=limited,
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


def bits_to_hex(mask: np.ndarray) -> str:
    """A boolean array as hexadecimal text, 8 entries a byte (the length is stored apart)."""
    return np.packbits(np.asarray(mask, dtype=bool)).tobytes().hex()


def bits_from_hex(text: str, n: int) -> np.ndarray:
    """The first ``n`` entries of :func:`bits_to_hex`'s array, as booleans."""
    bits = np.unpackbits(np.frombuffer(bytes.fromhex(text), dtype=np.uint8))
    if len(bits) < n:
        raise ValueError(f"{text!r} holds {len(bits)} bits, fewer than {n}")
    return bits[:n].astype(bool)


def float32_text(value: float) -> float | None:
    """A float32 value (a loss, a norm) as the shortest decimal that reads back to it.

    JSON has no inf or NaN: they are stored as null. ``float(np.float32(x))`` of the
    result is ``value`` again, bit for bit.
    """
    if not math.isfinite(value):
        return None
    single = np.float32(value)
    if float(single) != value:
        raise ValueError(f"{value!r} is not a float32 value")
    return float(str(single))


def _from_float32_text(value: float | None) -> float:
    return math.inf if value is None else float(np.float32(value))


def eval_steps_of(setup: Setup) -> np.ndarray:
    """The steps at which a run of ``setup`` measures its test loss (0 first)."""
    steps = [0] + [
        s for s in range(1, setup.steps + 1) if s % setup.eval_every == 0 or s == setup.steps
    ]
    return np.asarray(steps)


def _run_to_dict(run: RunResult) -> dict[str, Any]:
    values: dict[str, Any] = {
        "seed": run.seed,
        "test_loss": [float32_text(float(v)) for v in run.test_loss],
        "acted": bits_to_hex(run.acted),
    }
    for name in ("skipped", "limited"):
        if getattr(run, name) is not None:
            values[name] = bits_to_hex(getattr(run, name))
    return values


def _run_from_dict(
    method: str, values: dict[str, Any], setup: Setup, corrupted: np.ndarray
) -> RunResult:
    steps = setup.steps
    optional = {
        name: bits_from_hex(values[name], steps) if name in values else None
        for name in ("skipped", "limited")
    }
    return RunResult(
        method=method,
        seed=values["seed"],
        eval_steps=eval_steps_of(setup),
        test_loss=np.array([_from_float32_text(v) for v in values["test_loss"]]),
        total_norm=np.full(steps, np.nan),  # not stored: the figures do not use them
        max_abs=np.full(steps, np.nan),
        acted=bits_from_hex(values["acted"], steps),
        corrupted=corrupted,
        **optional,
    )


def grid_to_dict(grid: dict[tuple[float, float], Experiment]) -> dict[str, Any]:
    """:func:`experiment_grid`'s result as JSON-ready plain values, compactly.

    Kept per run: the test-loss curve (float32 values as their shortest decimals) and
    which steps were acted on, skipped and taken by the skip limit (as hexadecimal
    bits); the corruption schedule once per (rate, seed). The per-step norms are not
    kept. Every stored number reads back bit for bit (:func:`grid_from_dict`).
    """
    cells, corrupted = [], {}
    for (q, r), experiment in grid.items():
        for runs in experiment.runs.values():
            for run in runs:
                corrupted.setdefault(repr(float(r)), {})[str(run.seed)] = bits_to_hex(run.corrupted)
        cells.append(
            {
                "percentile": q,
                "rate": r,
                "thresholds": asdict(experiment.thresholds),
                "runs": {m: [_run_to_dict(x) for x in runs] for m, runs in experiment.runs.items()},
            }
        )
    setup = next(iter(grid.values())).setup if grid else Setup()
    return {"setup": asdict(setup), "corrupted": corrupted, "cells": cells}


def grid_from_dict(data: dict[str, Any]) -> dict[tuple[float, float], Experiment]:
    """The grid stored by :func:`grid_to_dict`, as :class:`Experiment` objects.

    The runs' ``total_norm`` and ``max_abs`` are NaN: they are not stored.
    """
    setup = Setup(**data["setup"])
    grid = {}
    for cell in data["cells"]:
        schedules = data["corrupted"][repr(float(cell["rate"]))]
        experiment = Experiment(
            rate=cell["rate"], thresholds=Thresholds(**cell["thresholds"]), setup=setup
        )
        experiment.runs = {
            m: [
                _run_from_dict(m, x, setup, bits_from_hex(schedules[str(x["seed"])], setup.steps))
                for x in runs
            ]
            for m, runs in cell["runs"].items()
        }
        grid[(cell["percentile"], cell["rate"])] = experiment
    return grid


def load_data(path: Path | str = GRID_PATH) -> dict[str, Any]:
    """Everything ``experiments/clip_vs_ignore_grid.py`` stored, as plain JSON values.

    Beside the grid's ``"setup"``, ``"corrupted"`` and ``"cells"`` (read them with
    :func:`load_grid`): ``"platform"`` (:func:`gradlab_book.stored.platform` of the
    machine that wrote them), ``"percentiles"``, ``"rates"``, ``"seeds"``,
    ``"calibration"`` (the clean runs' seeds, the norms of their first steps and their
    drift) and ``"threshold_runs"`` (the recorded runs the threshold exercise is scored
    on).
    """
    return json.loads(Path(path).read_text())


def load_grid(path: Path | str = GRID_PATH) -> dict[tuple[float, float], Experiment]:
    """The stored grid of the chapter (see :func:`grid_from_dict`)."""
    return grid_from_dict(load_data(path))


def stored_trace(
    data: dict[str, Any], grid: dict[tuple[float, float], Experiment], name: str = "seen"
) -> RunResult:
    """The stored skip run ``data["threshold_runs"][name]``, with its per-step norms.

    The grid keeps no norms; the threshold exercise's runs keep them, so that a norm
    trace (:func:`norm_trace_figure`) can be drawn from stored data.
    """
    stored_run = data["threshold_runs"][name]
    experiment = _cell(grid, stored_run["percentile"], stored_run["rate"])
    run = next(r for r in experiment.runs["skip"] if r.seed == stored_run["seed"])
    norms = np.array([_from_float32_text(v) for v in stored_run["total_norm"]])
    return RunResult(**{**run.__dict__, "total_norm": norms})


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
    left = [m for m in ("none", "clip_norm", "clip_value", "clip_skip") if m in methods]
    right = [
        m for m in ("none", "ignore_norm", "ignore_value", "skip", "skip_limit") if m in methods
    ]
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
    """One cell of :func:`experiment_grid`: median loss curves and final-loss bars.

    Raises:
        ValueError: ``(percentile, rate)`` is not a cell of ``grid`` (the message lists
            the cells there are).
    """
    experiment = _cell(grid, percentile, rate)
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


def _cell(grid: dict[tuple[float, float], Experiment], percentile: float, rate: float):
    try:
        return grid[(percentile, rate)]
    except (KeyError, TypeError):
        cells = ", ".join(f"({q:g}, {r:g})" for q, r in sorted(grid))
        raise ValueError(
            f"no stored cell at percentile {percentile!r}, rate {rate!r}; the grid has {cells}"
        ) from None


def _clean_limit(grid: dict[tuple[float, float], Experiment], fail_factor: float) -> float:
    """``fail_factor`` times the median final loss of the uncontrolled runs on clean data."""
    clean = [e for (_, r), e in grid.items() if r == 0.0 and "none" in e.runs]
    if not clean:
        raise ValueError("the grid has no uncontrolled runs on clean data (rate 0) to compare with")
    finals = [run.final_test_loss for run in clean[0].runs["none"]]
    return fail_factor * float(np.median(finals))


def _rates_of(grid: dict[tuple[float, float], Experiment], rates: Sequence[float] | None):
    stored = sorted({r for _, r in grid})
    rates = stored if rates is None else list(rates)
    missing = [r for r in rates if r not in stored]
    if missing:
        raise ValueError(f"no stored cells at rates {missing}; the grid has rates {stored}")
    return rates


def sweep_table(
    grid: dict[tuple[float, float], Experiment],
    rate: float,
    methods: Sequence[str] = METHODS,
    fail_factor: float | None = None,
) -> str:
    """Every method's median final test loss at each stored percentile, at one rate.

    Each cell is ``median (failed)``: the median over the seeds, and how many seeds
    failed (a final test loss above ``fail_factor`` times the median of the
    uncontrolled runs on clean data, :data:`FAIL_FACTOR` by default).

    Raises:
        ValueError: ``rate`` is not stored, or the grid has no clean reference.
    """
    (rate,) = _rates_of(grid, [rate])
    limit = _clean_limit(grid, FAIL_FACTOR if fail_factor is None else fail_factor)
    percentiles = sorted(q for q, r in grid if r == rate)
    n = len(next(iter(grid[(percentiles[0], rate)].runs.values())))
    head = f"{f'{100 * rate:.0f}% corrupted':22}" + "".join(
        f"{f'q={q:g}':>10}" for q in percentiles
    )
    lines = [head]
    for method in methods:
        cells = ""
        for q in percentiles:
            runs = grid[(q, rate)].runs.get(method)
            if not runs:
                cells += f"{'':>10}"
                continue
            finals = np.array([r.final_test_loss for r in runs])
            failed = int(np.sum(~(finals <= limit)))
            cells += f"{f'{np.median(finals):.2g} ({failed})':>10}"
        lines.append(f"{_label(method)[:22]:22}{cells}")
    lines.append(
        f"(median final test loss of {n} seeds; in brackets the seeds that failed: "
        f"above {limit:.2g})"
    )
    return "\n".join(lines)


def sweep_figure(
    grid: dict[tuple[float, float], Experiment],
    rates: Sequence[float] | None = None,
    methods: Sequence[str] = METHODS,
) -> Figure:
    """Median final test loss against the threshold percentile, one panel per rate.

    The whiskers span the best and the worst seed; a diverged run is drawn at the
    top edge (:data:`LOSS_CEILING`).

    Raises:
        ValueError: a rate of ``rates`` is not stored.
    """
    rates = _rates_of(grid, rates)
    fig = new_figure(6.4, 3.6)
    axes = np.atleast_1d(fig.subplots(1, len(rates), sharey=True, squeeze=False)[0])
    for ax, rate in zip(axes, rates, strict=True):
        percentiles = sorted(q for q, r in grid if r == rate)
        x = np.arange(len(percentiles))
        for k, method in enumerate(methods):
            finals = [
                [run.final_test_loss for run in grid[(q, rate)].runs.get(method, [])]
                for q in percentiles
            ]
            if not all(finals):
                continue
            finals = np.minimum(np.array(finals, dtype=float), LOSS_CEILING)
            median = np.median(finals, axis=1)
            offset = (k - (len(methods) - 1) / 2) * 0.06  # keep the whiskers apart
            ax.errorbar(
                x + offset,
                median,
                yerr=[median - finals.min(1), finals.max(1) - median],
                color=COLOURS[method],
                ls=STYLES[method],
                marker="o",
                ms=3,
                lw=1.2,
                elinewidth=0.6,
                label=LABELS[method].split(" (")[0],
            )
        ax.set_yscale("log")
        ax.set_xticks(x, [f"{q:g}" for q in percentiles], fontsize=7)
        ax.set_xlabel("threshold: percentile of clean norms")
        ax.set_title(f"{100 * rate:.0f}% corrupted batches", fontsize=9)
    axes[0].set_ylabel("final test loss (median, min-max)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=7)
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


def best_percentile(
    grid: dict[tuple[float, float], Experiment],
    rate: float,
    method: str,
    fail_factor: float | None = None,
) -> float:
    """The stored percentile at which ``method`` did best at ``rate``: fewest failed
    seeds, then the lowest median final test loss, then the lower percentile.

    This is tuning on the test runs themselves (the best a user could hope for with one
    fixed threshold), the same for every method, so the comparison stays fair.

    Raises:
        ValueError: ``rate`` is not stored, or the grid has no clean reference.
    """
    (rate,) = _rates_of(grid, [rate])
    limit = _clean_limit(grid, FAIL_FACTOR if fail_factor is None else fail_factor)

    def score(q: float) -> tuple[int, float, float]:
        finals = np.array([r.final_test_loss for r in grid[(q, rate)].runs[method]])
        return int(np.sum(~(finals <= limit))), float(np.median(finals)), q

    return min((q for q, r in grid if r == rate), key=score)


def tuned_table(
    grid: dict[tuple[float, float], Experiment],
    rate: float,
    methods: Sequence[str] = METHODS,
    fail_factor: float | None = None,
) -> str:
    """Each method at its own best stored percentile (:func:`best_percentile`): every
    seed's final test loss, the mean, the median and the failed seeds, with the
    uncontrolled runs on clean data first as the reference.

    Raises:
        ValueError: ``rate`` is not stored, or the grid has no clean reference.
    """
    (rate,) = _rates_of(grid, [rate])
    factor = FAIL_FACTOR if fail_factor is None else fail_factor
    limit = _clean_limit(grid, factor)
    clean_cell = next(e for (_, r), e in grid.items() if r == 0.0 and "none" in e.runs)
    seeds = [r.seed for r in clean_cell.runs["none"]]
    head = f"{f'{100 * rate:.0f}% corrupted, tuned':24}{'q':>6}"
    head += "".join(f"{f's{s}':>6}" for s in seeds)
    lines = [head + f"{'mean':>7}{'median':>7}{'failed':>7}"]
    rows = [("clean data, no control", "", clean_cell.runs["none"])]
    for method in methods:
        q = "" if method == "none" else best_percentile(grid, rate, method, fail_factor)
        cell = grid[(percentiles_of(grid, rate)[0] if q == "" else q, rate)]
        rows.append((_label(method), q, cell.runs[method]))
    for label, q, runs in rows:
        finals = np.array([r.final_test_loss for r in runs])
        cells = "".join(f"{v:>6.2g}" for v in finals)
        failed = f"{int(np.sum(~(finals <= limit)))}/{len(finals)}"
        stats = f"{np.mean(finals):>7.3g}{np.median(finals):>7.3g}{failed:>7}"
        lines.append(f"{label[:24]:24}{q!s:>6}{cells}{stats}")
    lines.append(
        f"(q: the percentile each method did best at; failed: above {factor:g} x the "
        f"clean median, {limit:.2g})"
    )
    return "\n".join(lines)


def percentiles_of(grid: dict[tuple[float, float], Experiment], rate: float) -> list[float]:
    """The stored percentiles at ``rate``, in ascending order."""
    return sorted(q for q, r in grid if r == rate)


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
