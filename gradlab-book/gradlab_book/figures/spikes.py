r"""Loss spikes in a small character language model (book/adaptive/loss_spikes).

The runs come from ``experiments/char_lm_spikes.py``, which trains a small GPT-style
character model with AdamW at a learning rate where its loss spikes, under seven
ways of controlling the step, and writes three files of :mod:`gradlab_book.stored`:
``spikes_runs.json`` (every step of every run), ``spikes_table.csv`` (one row per
method and seed) and ``spikes_costs.json`` (that machine's timings). This module
reads them back, computes what the chapter shows from them, and draws it; it holds
no model and trains nothing.

It also holds the arithmetic of Adam's second moment after a gradient spike
(:func:`adam_after_spike`, the float64 recursion, and :func:`suppression`, its
closed form), and a tiny AdamW run to check both against (:func:`adamw_after_spike`).

Spikes are counted by :func:`spike_starts`: a step whose training loss is more than
``ratio`` times the median of the ``window`` losses before it starts a spike, unless
one started in the ``window`` steps before it.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure

from gradlab_book import stored
from gradlab_book.plots import CLIP, KEEP, NONE, SKIP, THRESHOLD, new_figure

__all__ = [
    "COSTS_PATH",
    "PREFIX_PATH",
    "RECIPE_PATH",
    "RUNS_PATH",
    "TABLE_PATH",
    "adam_after_spike",
    "adam_figure",
    "adamw_after_spike",
    "costs_figure",
    "costs_lines",
    "load_costs",
    "load_prefix",
    "load_recipe",
    "load_runs",
    "load_table",
    "method_summary",
    "moving_average",
    "recovery_steps",
    "run_figure",
    "run_of",
    "spike_starts",
    "stale_from",
    "summary_figure",
    "suppression",
    "table_lines",
]

RUNS_PATH = stored.path("spikes_runs.json")
TABLE_PATH = stored.path("spikes_table.csv")
COSTS_PATH = stored.path("spikes_costs.json")
PREFIX_PATH = stored.path("spikes_prefix.json")
RECIPE_PATH = stored.path("spikes_recipe.json")

#: Colours of the methods (the book's decision colours where a method has one).
COLOURS = {
    "none": NONE,
    "clip": CLIP,
    "skip": SKIP,
    "clip+skip": "#8B4A9C",
    "zclip": "#009E73",
    "autoclip": "#56B4E9",
    "sigmaskip": "#D55E00",
}


# ------------------------------------------------------------------------ loading


def load_runs(path: Path | str = RUNS_PATH) -> dict[str, Any]:
    """The stored runs, as written by ``experiments/char_lm_spikes.py``: the file at
    ``path`` and the files it names in ``more_files`` (beside it), which hold more runs
    so that each file stays small."""
    path = Path(path)
    data = json.loads(path.read_text())
    for name in data.get("more_files", []):
        data["runs"] += json.loads((path.parent / name).read_text())["runs"]
    return data


def load_prefix(path: Path | str = PREFIX_PATH) -> dict[str, Any]:
    """The first steps of two runs in full precision, with the numeric platform that
    computed them (``stored.platform()``), for the prefix test."""
    return json.loads(Path(path).read_text())


def load_recipe(path: Path | str = RECIPE_PATH) -> dict[str, Any]:
    """The runs with a limit on skips that takes the step (``on_skip_limit="take"``)."""
    return json.loads(Path(path).read_text())


def load_table(path: Path | str = TABLE_PATH) -> list[dict[str, Any]]:
    """The per-seed table: one dict per (method, seed), numbers as numbers."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            out: dict[str, Any] = {}
            for key, value in row.items():
                if key == "method":
                    out[key] = value
                elif value == "":
                    out[key] = None
                elif key in ("seed", "spikes", "clipped", "skipped", "last_taken_step"):
                    out[key] = int(value)
                else:
                    out[key] = float(value)
            rows.append(out)
    return rows


def load_costs(path: Path | str = COSTS_PATH) -> dict[str, Any]:
    """The timings of the machine that ran the experiment."""
    return json.loads(Path(path).read_text())


def run_of(data: dict[str, Any], method: str, seed: int) -> dict[str, Any]:
    """The stored run of ``method`` and ``seed``."""
    for run in data["runs"]:
        if run["method"] == method and run["seed"] == seed:
            return run
    raise KeyError(f"no run of method {method!r} and seed {seed!r}")


# ------------------------------------------------------------------ computations


def spike_starts(
    losses: Sequence[float | None], window: int = 50, ratio: float = 1.25
) -> list[int]:
    """The steps where a spike starts.

    Step ``t`` (``t >= window``) starts a spike when its loss is more than ``ratio``
    times the median of the ``window`` losses before it (``None``, a non-finite
    loss, always is; ``None`` values are left out of the median), unless a spike
    started in the ``window`` steps before ``t``.
    """
    starts: list[int] = []
    for t in range(window, len(losses)):
        if starts and t - starts[-1] <= window:
            continue
        before = [v for v in losses[t - window : t] if v is not None]
        loss = losses[t]
        if loss is None or (bool(before) and loss > ratio * statistics.median(before)):
            starts.append(t)
    return starts


def stale_from(decisions: str, min_length: int = 100) -> int | None:
    """The first step of the final run of skipped steps, if that run reaches the end
    and is at least ``min_length`` steps long (a threshold gone stale); else None."""
    tail = len(decisions) - len(decisions.rstrip("s"))
    return len(decisions) - tail if tail >= min_length else None


def moving_average(values: Sequence[float | None], k: int) -> np.ndarray:
    """The mean of each window of ``k`` values ending at each step (NaN for None),
    shorter windows at the start."""
    x = np.array([np.nan if v is None else v for v in values], dtype=float)
    out = np.empty_like(x)
    for t in range(len(x)):
        out[t] = np.mean(x[max(0, t - k + 1) : t + 1])
    return out


def method_summary(rows: Sequence[dict[str, Any]], methods: Sequence[str]) -> list[dict]:
    """Per method, over its seeds: median and range of the held-out loss, spikes,
    clipped and skipped steps in total, and how many seeds went stale."""
    out = []
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        held = [r["held_out_loss"] for r in mine if r["held_out_loss"] is not None]
        out.append(
            {
                "method": method,
                "seeds": len(mine),
                "held_out_median": statistics.median(held) if held else None,
                "held_out_min": min(held, default=None),
                "held_out_max": max(held, default=None),
                "spikes": sum(r["spikes"] for r in mine),
                "seeds_with_spike": sum(r["spikes"] > 0 for r in mine),
                "clipped": sum(r["clipped"] for r in mine),
                "skipped": sum(r["skipped"] for r in mine),
            }
        )
    return out


def table_lines(rows: Sequence[dict[str, Any]], labels: dict[str, str]) -> list[str]:
    """The per-seed table as lines of text."""
    head = (
        f"{'method':28}{'seed':>5}{'train':>8}{'held-out':>9}{'best':>7}"
        f"{'spikes':>7}{'clipped':>8}{'skipped':>8}"
    )
    lines = [head]
    for r in rows:
        held = "-" if r["held_out_loss"] is None else f"{r['held_out_loss']:.3f}"
        train = "-" if r["final_train_loss"] is None else f"{r['final_train_loss']:.3f}"
        lines.append(
            f"{labels[r['method']]:28}{r['seed']:>5}{train:>8}{held:>9}"
            f"{r['best_held_out_loss']:>7.3f}{r['spikes']:>7}{r['clipped']:>8}"
            f"{r['skipped']:>8}"
        )
    return lines


def costs_lines(costs: dict[str, Any], labels: dict[str, str]) -> list[str]:
    """The timings as lines of text: the control and optimizer step, the whole step,
    and the control's extra time over a bare ``optimizer.step()``."""
    methods = costs["methods"]
    base = methods["none"]["control_ms"]
    lines = [f"{'method':28}{'guard+step ms':>14}{'extra ms':>9}{'whole step ms':>14}"]
    for method, c in methods.items():
        lines.append(
            f"{labels[method]:28}{c['control_ms']:>14.3f}"
            f"{c['control_ms'] - base:>9.3f}{c['step_ms']:>14.2f}"
        )
    return lines


# ------------------------------------------------------------- Adam after a spike


def adam_after_spike(
    ratio: float, steps: int, beta1: float = 0.9, beta2: float = 0.999
) -> dict[str, np.ndarray]:
    r"""Adam's moments after one gradient spike, in float64, in the steady state.

    A coordinate whose gradient has been :math:`g = 1` for ever (so :math:`m = v = 1`
    and the bias corrections are 1) receives :math:`g = \rho` (``ratio``) at step 0
    and :math:`g = 1` again from step 1 on. Returns, for steps ``0 .. steps - 1``,
    ``m``, ``v`` and ``step`` :math:`= m/\sqrt v`, the step relative to the steady
    one (1), by the recursions :math:`m \leftarrow \beta_1 m + (1-\beta_1) g`,
    :math:`v \leftarrow \beta_2 v + (1-\beta_2) g^2`.
    """
    m_prev = v_prev = 1.0
    m, v = np.empty(steps), np.empty(steps)
    for t in range(steps):
        g = ratio if t == 0 else 1.0
        m_prev = beta1 * m_prev + (1 - beta1) * g
        v_prev = beta2 * v_prev + (1 - beta2) * g * g
        m[t], v[t] = m_prev, v_prev
    return {"m": m, "v": v, "step": m / np.sqrt(v)}


def suppression(
    ratio: float, t: np.ndarray | float, beta1: float = 0.9, beta2: float = 0.999
) -> np.ndarray | float:
    r"""The closed form of :func:`adam_after_spike`'s ``step`` at step ``t``:

    .. math::
        \frac{m_t}{\sqrt{v_t}} = \frac{1 + (1-\beta_1)(\rho - 1)\beta_1^t}
            {\sqrt{1 + (1-\beta_2)(\rho^2 - 1)\beta_2^t}} .
    """
    t = np.asarray(t, dtype=float)
    m = 1 + (1 - beta1) * (ratio - 1) * beta1**t
    v = 1 + (1 - beta2) * (ratio**2 - 1) * beta2**t
    out = m / np.sqrt(v)
    return float(out) if out.ndim == 0 else out


def recovery_steps(ratio: float, level: float, beta2: float = 0.999) -> float:
    r"""How long after the spike :math:`1/\sqrt{v_t}` stays below ``level`` (in
    (0, 1)): the :math:`t` solving :math:`1 + (1-\beta_2)(\rho^2-1)\beta_2^t =
    1/\text{level}^2`, a real number (0 when it is never below)."""
    excess = (1 - beta2) * (ratio**2 - 1)
    need = 1 / level**2 - 1
    if excess <= need:
        return 0.0
    return math.log(need / excess) / math.log(beta2)


def adamw_after_spike(
    ratio: float,
    steps: int,
    *,
    beta1: float = 0.9,
    beta2: float = 0.999,
    lr: float = 1e-3,
) -> dict[str, np.ndarray]:
    r"""A tiny problem trained by :class:`torch.optim.AdamW`: two coordinates of a
    linear loss :math:`L(\theta) = \theta_0 + \theta_1` (gradient 1, 1), in float64.

    AdamW starts in the steady state of that gradient, loaded with
    :meth:`~torch.optim.Optimizer.load_state_dict`: :math:`m = v = 1` and a step
    count of :math:`10^6`, so that both bias corrections are 1 to double precision.
    The first batch has gradient :math:`(\rho, 1)`, the ``steps - 1`` after it
    :math:`(1, 1)`. No weight decay, ``eps = 1e-12``.

    Returns each coordinate's step :math:`|\Delta\theta_i| / \eta` for the
    ``steps`` steps from the spike on (index 0 is the spike's step): coordinate 0
    took the spike, coordinate 1 is the control.
    """
    theta = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.AdamW(
        [theta], lr=lr, betas=(beta1, beta2), eps=1e-12, weight_decay=0.0, foreach=False
    )
    steady = {
        "step": torch.tensor(1e6, dtype=torch.float64),
        "exp_avg": torch.ones(2, dtype=torch.float64),
        "exp_avg_sq": torch.ones(2, dtype=torch.float64),
    }
    state = opt.state_dict()
    state["state"] = {0: steady}
    opt.load_state_dict(state)
    normal = torch.ones(2, dtype=torch.float64)
    spike = torch.tensor([ratio, 1.0], dtype=torch.float64)
    moves = np.empty((steps, 2))
    for t in range(steps):
        theta.grad = spike.clone() if t == 0 else normal.clone()
        before = theta.detach().clone()
        opt.step()
        moves[t] = ((before - theta.detach()).abs() / lr).numpy()
    return {"spiked": moves[:, 0], "control": moves[:, 1]}


# ----------------------------------------------------------------------- figures


def adam_figure(ratio: float = 100.0, beta2: float = 0.999, steps: int = 3000) -> Figure:
    """Adam's relative step after a spike of ``ratio`` times the usual gradient:
    the float64 recursion and the closed form, for beta1 = 0.9 and ``beta2``."""
    fig = new_figure(6.4, 3.0)
    ax = fig.subplots()
    t = np.arange(steps)
    rec = adam_after_spike(ratio, steps, 0.9, beta2)
    ax.plot(t, rec["step"], color=KEEP, lw=1.6, label=r"$m_t/\sqrt{v_t}$ (recursion)")
    ax.plot(t, suppression(ratio, t, 0.9, beta2), "--", color=THRESHOLD, lw=1, label="closed form")
    floor = 1 / np.sqrt(1 + (1 - beta2) * (ratio**2 - 1) * beta2**t)
    ax.plot(t, floor, ":", color=SKIP, lw=1.4, label=r"$1/\sqrt{v_t}$ (m forgotten)")
    ax.axhline(1.0, color=NONE, lw=0.8)
    tau = -1 / math.log(beta2)
    ax.axvline(tau, color=NONE, ls="--", lw=0.8)
    ax.text(tau, 0.02, rf" $-1/\ln\beta_2$ = {tau:.0f}", fontsize=8, color=NONE)
    ax.set_xscale("symlog", linthresh=10)
    ax.set_ylim(0, max(1.2, 1.05 * float(rec["step"][0])))
    ax.set_xlim(0, steps)
    ax.set_xlabel("steps after the spike (symlog)")
    ax.set_ylabel("step / usual step")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(
        rf"one gradient {ratio:g}$\times$ the usual, $\beta_1$ = 0.9, $\beta_2$ = {beta2:g}",
        fontsize=10,
    )
    return fig


def run_figure(data: dict[str, Any], method: str, seed: int, smooth: int = 10) -> Figure:
    """One stored run: training loss (top, a moving average of ``smooth`` steps,
    with the uncontrolled run of the same seed in grey and the held-out loss as
    dots) and the total gradient norm (bottom, log scale), clipped steps in orange,
    skipped steps in purple, spike starts marked by triangles."""
    run, base = run_of(data, method, seed), run_of(data, "none", seed)
    rule = data["spike_rule"]
    colour = COLOURS[method]
    fig = new_figure(6.4, 4.4)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    steps = np.arange(len(run["loss"]))
    if method != "none":
        top.plot(steps, moving_average(base["loss"], smooth), color=NONE, lw=1, alpha=0.7)
        top.plot([], [], color=NONE, lw=1, label="no control")
    top.plot(steps, moving_average(run["loss"], smooth), color=colour, lw=1.4)
    top.plot([], [], color=colour, lw=1.4, label=data["labels"][method])
    top.plot(run["eval_steps"], run["eval_loss"], "o", color=colour, ms=3, label="held-out")
    loss = moving_average(run["loss"], smooth)
    for s in spike_starts(run["loss"], rule["window"], rule["ratio"]):
        top.plot(s, np.nanmax(loss[s : s + smooth]) + 0.08, "v", color=THRESHOLD, ms=6)
    top.set_ylim(1.4, 4.6)
    top.set_ylabel(f"training loss (mean of {smooth})")
    top.legend(fontsize=7, loc="upper right", ncol=3)
    norms = np.array([np.nan if v is None else v for v in run["norm"]])
    bottom.plot(steps, norms, color=KEEP, lw=0.7)
    for code, c, name in (("c", CLIP, "clipped"), ("s", SKIP, "skipped")):
        at = [t for t, d in enumerate(run["decision"]) if d == code]
        if at:
            bottom.plot(at, norms[at], ".", color=c, ms=3, label=f"{name} ({len(at)})")
    th = data["thresholds"]
    fixed = {
        "clip": [("clip", th["clip"])],
        "skip": [("skip", th["skip"])],
        "clip+skip": [("clip", th["clip"]), ("skip", th["skip_above"])],
    }.get(method, [])
    for name, value in fixed:
        bottom.axhline(value, color=CLIP if name == "clip" else SKIP, ls="--", lw=0.9)
    bottom.set_yscale("log")
    bottom.set_ylim(0.08, 20)
    bottom.set_xlim(0, len(steps))
    bottom.set_xlabel("step")
    bottom.set_ylabel("gradient norm")
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(fontsize=7, loc="upper left", ncol=2)
    counts = f"{len(spike_starts(run['loss'], rule['window'], rule['ratio']))} spike(s)"
    stale = stale_from(run["decision"])
    if stale is not None:
        counts += f", every step skipped from step {stale} on"
    fig.suptitle(f"{data['labels'][method]}, seed {seed}: {counts}", fontsize=10)
    return fig


def summary_figure(
    rows: Sequence[dict[str, Any]],
    methods: Sequence[str],
    labels: dict[str, str],
    reference: Sequence[float] | None = None,
) -> Figure:
    """The final held-out loss of every seed, one column per method; ``reference``
    (the held-out losses of the reference runs) as a band."""
    fig = new_figure(6.4, 3.0)
    ax = fig.subplots()
    if reference:
        ax.axhspan(min(reference), max(reference), color=KEEP, alpha=0.15, lw=0)
        ax.axhline(
            statistics.median(reference),
            color=KEEP,
            ls="--",
            lw=1,
            label="no control at the lower learning rate (band: its seeds)",
        )
        ax.legend(fontsize=7, loc="upper center")
    for i, method in enumerate(methods):
        mine = [r for r in rows if r["method"] == method]
        held = [r["held_out_loss"] for r in mine]
        x = i + np.linspace(-0.15, 0.15, len(held))
        ax.plot(x, held, "o", color=COLOURS[method], ms=5)
        ax.hlines(statistics.median(held), i - 0.3, i + 0.3, color=COLOURS[method], lw=1.5)
    values = [r["held_out_loss"] for r in rows if r["method"] in methods]
    values += list(reference or [])
    ax.set_ylim(min(values) - 0.1, max(values) + 0.25)
    ax.set_xticks(range(len(methods)), [labels[m].replace(", ", ",\n") for m in methods])
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylabel("held-out loss at the end")
    ax.set_title("every seed (dots) and the median (bar); lower is better", fontsize=10)
    return fig


def costs_figure(costs: dict[str, Any], labels: dict[str, str]) -> Figure:
    """The median time of the control and optimizer step of each method."""
    fig = new_figure(6.4, 2.8)
    ax = fig.subplots()
    methods = list(costs["methods"])
    values = [costs["methods"][m]["control_ms"] for m in methods]
    ax.barh(range(len(methods)), values, color=[COLOURS[m] for m in methods])
    ax.set_yticks(range(len(methods)), [labels[m] for m in methods], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step: guard (if any) and optimizer.step()")
    whole = statistics.median(c["step_ms"] for c in costs["methods"].values())
    ax.set_title(f"this machine's timings; a whole training step took about {whole:.0f} ms")
    ax.title.set_fontsize(9)
    return fig
