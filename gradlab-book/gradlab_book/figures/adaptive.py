r"""Part IV: adaptive thresholds (book/adaptive/adaptive_thresholds) and AGC (book/adaptive/agc).

*Adaptive thresholds.* Two recorded gradient-norm traces from real runs of the book's
models, written by ``experiments/record_norm_traces.py`` into
``norm_traces.json`` (stored in the package, :mod:`gradlab_book.stored`):

``mlp``   the small MLP of book/training/clip_vs_ignore, uncontrolled, with 5% corrupted
          batches (:func:`gradlab_book.figures.training.train_run`), 600 steps;
``tanh``  a 16-layer tanh chain (:func:`gradlab_book.demos.tanh_chain`, weights at twice
          the classic scale) fitting a teacher chain with plain SGD at a high learning
          rate, 600 steps: its typical norm falls about ninefold and it spikes on its own.

:func:`replay` runs a threshold policy of :mod:`gradlab.adaptive` over a trace, as
:class:`gradlab.StepGuard` would call it (``threshold``, then ``update``), and returns
every threshold and decision. The replay is open-loop: a decision does not change the
norms that follow, as it would in a real run.

*AGC.* :func:`rescaled_mlp` builds a three-layer ReLU MLP and a copy that computes the
same function with its first hidden layer scaled by ``scale`` and the next layer by
``1/scale``; :func:`unit_ratios` gives every unit's ``‖G_i‖/‖W_i‖``, and
:func:`train_agc` trains either with no control, global clipping or :func:`gradlab.agc_`.

Compute functions return plain numbers, lists and numpy arrays; figure functions draw them.
"""

from __future__ import annotations

import itertools
import json
import math
import numbers
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

import gradlab
from gradlab.adaptive import AutoClip, SigmaSkip, ZClip, agc_
from gradlab_book import demos, stored
from gradlab_book.figures import training
from gradlab_book.plots import CLIP, KEEP, NONE, SKIP, THRESHOLD, new_figure

__all__ = [
    "DATA_PATH",
    "POLICIES",
    "PREFIX_PATH",
    "PREFIX_STEPS",
    "TRACES",
    "agc_curves_figure",
    "agc_data",
    "agc_figure",
    "autoclip_figure",
    "clone_model",
    "fixed_threshold_rates",
    "grid_rows",
    "load_traces",
    "mlp_trace",
    "policy_grid",
    "record_traces",
    "replay",
    "rescaled_mlp",
    "sigma_skip_figure",
    "stale_threshold_figure",
    "tanh_trace",
    "train_agc",
    "unit_ratios",
    "zclip_boundary",
    "zclip_figure",
]

DATA_PATH = stored.path("norm_traces.json")
#: The first :data:`PREFIX_STEPS` steps of both traces in full precision, with the
#: platform that computed them, for the prefix test (``norm_traces.json`` has none).
PREFIX_PATH = stored.path("norm_traces_prefix.json")
PREFIX_STEPS = 40

#: The recorded traces, in the order they are drawn, with their titles.
TRACES = {
    "mlp": "MLP, 5% corrupted batches",
    "tanh": "16-layer tanh chain, high learning rate",
}

#: Settings of the two recorded runs (the script and the test use the same).
MLP_RUN = {"seed": 0, "rate": 0.05, "steps": 600}
TANH_RUN = {
    "seed": 0,
    "steps": 600,
    "depth": 16,
    "width": 16,
    "weight_scale": 2.0,
    "lr": 0.3,
    "batch": 32,
    "n_train": 512,
}

_DIGITS = 6  # significant digits kept in the JSON


def _round(value: float) -> float | None:
    """``value`` to 6 significant digits, ``None`` for a non-finite one (JSON has no NaN)."""
    return float(f"{value:.{_DIGITS}g}") if math.isfinite(value) else None


# --------------------------------------------------------------------------- traces


def mlp_trace(seed: int = 0, rate: float = 0.05, steps: int = 600) -> dict[str, Any]:
    """The chapter-7 MLP, uncontrolled: each step's total norm and whether it was corrupted."""
    setup = training.Setup(steps=steps)
    run = training.train_run("none", seed, rate, None, setup)
    return {
        "norms": [_round(float(v)) for v in run.total_norm],
        "corrupted": [bool(c) for c in run.corrupted],
    }


def tanh_trace(
    seed: int = 0,
    steps: int = 600,
    depth: int = 16,
    width: int = 16,
    weight_scale: float = 2.0,
    lr: float = 0.3,
    batch: int = 32,
    n_train: int = 512,
) -> dict[str, Any]:
    """A deep tanh chain fitting a teacher chain by plain SGD: each step's norm and loss.

    The student starts at ``weight_scale`` times the classic initialisation (its
    Jacobians expand), the teacher is a chain of the same depth at scale 1, seed 99.
    Batches are drawn with replacement from ``n_train`` fixed inputs.
    """
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(n_train, width, generator=g)
    teacher = demos.tanh_chain(depth, width, 1.0, seed=99)
    with torch.no_grad():
        y = teacher(x) + 0.05 * torch.randn(n_train, width, generator=g)
    model = demos.tanh_chain(depth, width, weight_scale, seed=seed)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=lr)
    norms, losses = [], []
    for _ in range(steps):
        index = torch.randint(0, n_train, (batch,), generator=g)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x[index]), y[index])
        loss.backward()
        norms.append(_round(gradlab.get_total_norm([p.grad for p in params]).item()))
        losses.append(_round(loss.item()))
        optimizer.step()
    return {"norms": norms, "losses": losses}


def record_traces(steps: int | None = None) -> dict[str, Any]:
    """Both traces (``steps`` overrides their length: a prefix, for the test), with the
    numeric platform (:func:`gradlab_book.stored.platform`).

    The tanh run is chaotic: a difference in the last bit of its first gradient (another
    CPU's float kernels) grows about tenfold a step, so on another machine its trace
    differs from the stored one by 1e-4 after three steps and entirely after ten. The
    chapters replay the stored traces, which are the same data on every machine; the
    stored file was recorded before data files carried a platform (it has none), so
    its first steps are also stored with one, in :data:`PREFIX_PATH`."""
    mlp = dict(MLP_RUN, **({} if steps is None else {"steps": steps}))
    tanh = dict(TANH_RUN, **({} if steps is None else {"steps": steps}))
    return {
        "description": "total gradient norms of two uncontrolled runs; written by "
        "experiments/record_norm_traces.py",
        "platform": stored.platform(),
        "settings": {"mlp": mlp, "tanh": tanh},
        "mlp": mlp_trace(**mlp),
        "tanh": tanh_trace(**tanh),
    }


def load_traces(path: Path | str = DATA_PATH) -> dict[str, Any]:
    """The recorded traces, norms as float arrays (NaN where the file has ``null``)."""
    data = json.loads(Path(path).read_text())
    for name in TRACES:
        trace = data[name]
        trace["norms"] = np.array([math.nan if v is None else v for v in trace["norms"]])
        if "corrupted" in trace:
            trace["corrupted"] = np.array(trace["corrupted"], dtype=bool)
    return data


# --------------------------------------------------------------------------- replay


def replay(
    policy: Any,
    norms: Sequence[float],
    mode: str = "clip",
    boundary: Callable[[Any], float] | None = None,
) -> dict[str, np.ndarray]:
    """Run ``policy`` over a norm trace as ``StepGuard(mode=mode, threshold=policy)`` does.

    At each step: ``tau = policy.threshold(x)``; the step is *within* when
    ``tau / x >= 1``, rounded as torch rounds its clip coefficient
    (:func:`gradlab.keep_by_norm` with ``eps=0``, as the guard compares a policy's
    threshold, called here; False for NaN).
    In ``"clip"`` mode a step that is not within is clipped and still accepted unless
    ``x`` is not finite (then it is skipped); in ``"skip"`` mode it is skipped.
    Then ``policy.update(x, accepted)``.

    Args:
        boundary: optional, called with the policy before each step; its value is
            recorded as ``boundary`` (for ZClip, the norm above which it clips).

    Returns:
        ``threshold`` (inf where none), ``acted`` (clipped or skipped), ``accepted``,
        and ``boundary`` (the threshold itself when no ``boundary`` is given).
    """
    if mode not in ("clip", "skip"):
        raise ValueError(f"mode must be 'clip' or 'skip', got {mode!r}")
    n = len(norms)
    taus, edges = np.empty(n), np.empty(n)
    acted, accepted = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    for t, value in enumerate(norms):
        x = torch.tensor(float(value), dtype=policy.dtype)
        edges[t] = math.nan if boundary is None else boundary(policy)
        tau = policy.threshold(x)
        within = bool(gradlab.keep_by_norm(x, tau, eps=0.0))
        ok = within if mode == "skip" else math.isfinite(float(value))
        policy.update(x, torch.tensor(ok))
        taus[t], acted[t], accepted[t] = float(tau), not within, ok
    if boundary is None:
        edges = taus.copy()
    return {"threshold": taus, "acted": acted, "accepted": accepted, "boundary": edges}


def zclip_boundary(policy: ZClip) -> float:
    """The norm above which ``policy`` clips now, ``x_bar + z_t (sigma + eps)`` (inf in warm-up)."""
    state = policy.state_dict()["state"]
    if int(state["count"]) < policy.warmup:
        return math.inf
    return float(state["mean"]) + policy.z_thresh * (math.sqrt(float(state["var"])) + policy.eps)


#: How each kind of policy is built from its explorable's parameters, and its mode.
#: AutoClip's ``window="all"`` is the paper's whole history (``window=None``); SigmaSkip
#: starts at OLMo-core's count (its default ``min_count``) and takes ``steps``.
POLICIES: dict[str, tuple[Callable[..., Any], str]] = {
    "autoclip": (
        lambda percentile, window: AutoClip(
            percentile=percentile, window=_window(window), dtype=torch.float64
        ),
        "clip",
    ),
    "zclip": (lambda alpha, z_thresh: ZClip(alpha, z_thresh, dtype=torch.float64), "clip"),
    "sigma": (
        lambda k, window, steps="all": SigmaSkip(k, window, steps=steps, dtype=torch.float64),
        "skip",
    ),
}


def _window(window: int | str | None) -> int | None:
    """AutoClip's window from an explorable's value: ``"all"`` (or None) is the whole history."""
    return None if window in ("all", None) else int(window)


def policy_grid(
    kind: str, traces: dict[str, Any], **values: Sequence[Any]
) -> dict[tuple, dict[str, dict[str, np.ndarray]]]:
    """:func:`replay` of policy ``kind`` over every trace, at every combination of
    ``values`` (keyword: the grid of one parameter, in the order of the key tuples)."""
    if kind not in POLICIES:
        raise ValueError(f"kind must be one of {sorted(POLICIES)}, got {kind!r}")
    names = list(values)
    return {
        combo: _replay_all(kind, traces, dict(zip(names, combo, strict=True)))
        for combo in itertools.product(*values.values())
    }


def _replay_all(kind: str, traces: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    make, mode = POLICIES[kind]
    edge = zclip_boundary if kind == "zclip" else None
    return {name: replay(make(**params), traces[name]["norms"], mode, edge) for name in TRACES}


def _results(
    kind: str, grid: dict[tuple, Any], traces: dict[str, Any], **params: Any
) -> dict[str, Any]:
    """The grid's replays at ``params`` (in the grid's key order), or, for a point the
    grid does not hold (a value just outside an explorable's slider), replayed now."""
    key = tuple(params.values())
    if key in grid:
        return grid[key]
    return _replay_all(kind, traces, params)


def grid_rows(
    grid: dict[tuple, dict[str, dict[str, np.ndarray]]], traces: dict[str, Any], late: int = 200
) -> list[dict[str, Any]]:
    """Per grid point: the share of steps acted on in each trace (``<name>``) and after
    step ``late`` (``<name>_late``), and on the MLP the corrupted batches caught and the
    healthy steps acted on."""
    corrupted = traces["mlp"]["corrupted"]
    rows = []
    for combo, results in grid.items():
        acted = results["mlp"]["acted"]
        row: dict[str, Any] = {"params": combo}
        for name in TRACES:
            row[name] = float(results[name]["acted"].mean())
            row[f"{name}_late"] = float(results[name]["acted"][late:].mean())
        row["caught"] = int((acted & corrupted).sum())
        row["healthy"] = int((acted & ~corrupted).sum())
        rows.append(row)
    return rows


def fixed_threshold_rates(
    norms: Sequence[float], calibrate: int = 50, percentile: float = 90.0, parts: int = 3
) -> tuple[float, list[float]]:
    """A fixed threshold at ``percentile`` of the first ``calibrate`` norms, and the share
    of the steps it acts on in each of ``parts`` equal stretches of the trace."""
    norms = np.asarray(norms, dtype=float)
    tau = float(np.percentile(norms[:calibrate], percentile))
    over = ~(tau / (norms + 1e-6) >= 1.0)
    return tau, [float(chunk.mean()) for chunk in np.array_split(over, parts)]


# -------------------------------------------------------------------------- figures

#: The explorables of Part IV are drawn for a phone: this many inches wide, one panel under
#: the other, every text at least :data:`TEXT_PT` points, rendered at :data:`FRAME_DPI`.
#: On a 375-px phone the page gives a figure about 340 px, so a frame of
#: ``PANEL_WIDTH * FRAME_DPI`` = 360 px is shown at 0.94 of its size and 10-point text is
#: 11.8 px high (``tests/book/test_figures_adaptive.py`` checks every text of every frame).
PANEL_WIDTH = 4.0
FRAME_DPI = 90
TEXT_PT = 10.0


def _style_axes(ax) -> None:
    ax.tick_params(labelsize=TEXT_PT)
    ax.xaxis.label.set_size(TEXT_PT)
    ax.yaxis.label.set_size(TEXT_PT)


def _trace_panel(ax, norms: np.ndarray, result: dict[str, np.ndarray], colour: str, verb: str):
    """One trace: the norms (a grey line), the threshold (dashed) and the steps acted on
    (crosses; a clipped one with a line down to what it is clipped to)."""
    steps = np.arange(1, len(norms) + 1)
    shown = np.where(np.isfinite(norms), norms, np.nan)
    ax.plot(steps, shown, color=NONE, lw=0.7, zorder=1, label="norm")
    edge = np.where(np.isfinite(result["boundary"]), result["boundary"], np.nan)
    ax.plot(steps, edge, color=THRESHOLD, lw=1.0, ls="--", label="threshold", zorder=2)
    acted = np.asarray(result["acted"], dtype=bool) & np.isfinite(norms)
    ax.scatter(steps[acted], norms[acted], s=16, color=colour, marker="x", label=verb, zorder=4)
    if verb == "clipped":  # a line from each clipped norm down to what it is clipped to
        tau = np.asarray(result["threshold"])[acted]
        low = np.where(np.isfinite(tau), tau, norms[acted])
        ax.vlines(steps[acted], low, norms[acted], color=colour, lw=0.8, zorder=3)
    ax.set_yscale("log")
    _style_axes(ax)


def _stacked_figure(
    traces: dict[str, Any], results: dict[str, dict[str, np.ndarray]], mode: str, title: str
) -> Figure:
    """One panel per trace, one under the other, a shared legend at the bottom."""
    fig = new_figure(PANEL_WIDTH, 2.25 * len(TRACES) + 0.9)
    axes = fig.subplots(len(TRACES), 1)
    colour, verb = (SKIP, "skipped") if mode == "skip" else (CLIP, "clipped")
    for ax, (name, label) in zip(axes, TRACES.items(), strict=True):
        norms = np.asarray(traces[name]["norms"], dtype=float)
        result = results[name]
        _trace_panel(ax, norms, result, colour, verb)
        acted = np.asarray(result["acted"], dtype=bool)
        share = 100 * acted.mean() if acted.size else 0.0
        extra = ""
        if "corrupted" in traces[name]:
            corrupted = np.asarray(traces[name]["corrupted"], dtype=bool)
            extra = f", {int((acted & corrupted).sum())} of {int(corrupted.sum())} corrupted"
        ax.set_title(f"{label}\n{verb} {share:.0f}%{extra}", fontsize=TEXT_PT)
        ax.set_ylabel("gradient norm")
    axes[-1].set_xlabel("step")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize=TEXT_PT,
               markerscale=1.3, handlelength=1.6, columnspacing=1.0)  # fmt: skip
    fig.suptitle(title, fontsize=TEXT_PT)
    return fig


def autoclip_figure(
    percentile: float, window: int | str, grid: dict, traces: dict[str, Any]
) -> Figure:
    """AutoClip at ``percentile`` of the last ``window`` norms before each step
    (``window="all"``: of every norm so far, this one included, the paper's rule), clip
    mode. A point the grid does not hold is replayed now."""
    results = _results("autoclip", grid, traces, percentile=percentile, window=window)
    if _window(window) is None:
        title = f"AutoClip: percentile {percentile:g}\nof all norms so far (the paper)"
    else:
        title = f"AutoClip: percentile {percentile:g}\nof the last {window} norms"
    return _stacked_figure(traces, results, "clip", title)


def zclip_figure(alpha: float, z_thresh: float, grid: dict, traces: dict[str, Any]) -> Figure:
    """ZClip with EMA memory ``alpha`` and threshold ``z_thresh``, clip mode; the dashed
    line is ``x_bar + z_t sigma``, above which a norm is clipped. A point the grid does
    not hold is replayed now."""
    results = _results("zclip", grid, traces, alpha=alpha, z_thresh=z_thresh)
    title = f"ZClip: alpha {alpha:g}, z threshold {z_thresh:g}\n(warm-up 25 steps)"
    return _stacked_figure(traces, results, "clip", title)


def sigma_skip_figure(
    k: float, window: int, steps: str, grid: dict, traces: dict[str, Any]
) -> Figure:
    """SigmaSkip at ``k`` standard deviations over a window of ``window`` norms, skip
    mode: every step enters the window (``steps="all"``, OLMo-core's rule) or only the
    taken ones (``"taken"``). A point the grid does not hold is replayed now."""
    results = _results("sigma", grid, traces, k=k, window=window, steps=steps)
    which = "every step" if steps == "all" else "the taken steps"
    title = (
        f"\N{GREEK SMALL LETTER SIGMA}-rule skip: mean + {k:g} std of the last\n"
        f"{window} norms, {which} in the window"
    )
    return _stacked_figure(traces, results, "skip", title)


def stale_threshold_figure(
    traces: dict[str, Any], calibrate: int = 50, percentile: float = 90.0
) -> Figure:
    """Each trace with a fixed threshold set from its first ``calibrate`` steps (the
    guard's rule for a fixed threshold, with the 1e-6)."""
    results = {}
    for name in TRACES:
        norms = np.asarray(traces[name]["norms"], dtype=float)
        tau, _ = fixed_threshold_rates(norms, calibrate, percentile)
        taus = np.full(len(norms), tau)
        with np.errstate(invalid="ignore", divide="ignore"):
            acted = ~(tau / (norms + 1e-6) >= 1.0)
        results[name] = {"threshold": taus, "boundary": taus, "acted": acted}
    fig = _stacked_figure(
        traces,
        results,
        "clip",
        f"fixed threshold: percentile {percentile:g}\nof the first {calibrate} steps (shaded)",
    )
    for ax in fig.axes:
        ax.axvspan(0, calibrate, color=NONE, alpha=0.12, lw=0)
    return fig


# ---------------------------------------------------------------------------- AGC


def rescaled_mlp(scale: float = 100.0, seed: int = 0, d_in: int = 8, hidden: int = 16):
    """A 3-layer ReLU MLP and a copy computing the same function, layer 0 scaled.

    ``in -> Linear(d_in, hidden) -> ReLU -> Linear(hidden, hidden) -> ReLU ->
    Linear(hidden, 1)``. In the copy the first layer's weight and bias are multiplied
    by ``scale`` and the second layer's weight by ``1/scale``; since
    ``relu(c z) = c relu(z)`` for ``c > 0``, both compute the same outputs.
    """
    torch.manual_seed(seed)
    base = nn.Sequential(
        nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 1),
    )  # fmt: skip
    copy = clone_model(base)
    with torch.no_grad():
        copy[0].weight.mul_(scale)
        copy[0].bias.mul_(scale)
        copy[2].weight.div_(scale)
    return base, copy


def clone_model(model: nn.Module) -> nn.Module:
    """A copy of a ``nn.Sequential`` of ``Linear`` and parameter-free layers."""
    clone = type(model)(*[_clone_module(m) for m in model])
    clone.load_state_dict(model.state_dict())
    return clone


def _clone_module(m: nn.Module) -> nn.Module:
    if isinstance(m, nn.Linear):
        return nn.Linear(m.in_features, m.out_features)
    return type(m)()


def unit_ratios(model: nn.Module) -> list[dict[str, Any]]:
    """Per weight matrix: each unit's (row's) ``‖G_i‖``, ``‖W_i‖`` and their ratio.

    Biases are units too in :func:`gradlab.agc_` (one per vector); they are listed with
    one entry each.
    """
    rows = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        w, g = p.detach(), p.grad.detach()
        if w.dim() > 1:
            wn = torch.linalg.vector_norm(w, dim=tuple(range(1, w.dim())))
            gn = torch.linalg.vector_norm(g, dim=tuple(range(1, g.dim())))
        else:
            wn, gn = w.norm().reshape(1), g.norm().reshape(1)
        rows.append(
            {
                "name": name,
                "weight_norms": wn.tolist(),
                "grad_norms": gn.tolist(),
                "ratios": (gn / wn.clamp(min=1e-3)).tolist(),
            }
        )
    return rows


def agc_data(n: int = 256, d_in: int = 8, seed: int = 0) -> tuple[Tensor, Tensor]:
    """The training set of :func:`train_agc`: a noisy linear teacher."""
    return demos.regression_data(n, d_in=d_in, d_out=1, noise=0.1, seed=seed)


def train_agc(
    model: nn.Module,
    method: str,
    steps: int = 300,
    lr: float = 0.05,
    max_norm: float = 1.0,
    clip_factor: float = 0.01,
    batch: int = 32,
    seed: int = 0,
    exclude_head: bool = True,
) -> dict[str, Any]:
    """Train a copy of ``model`` by SGD with ``method``: ``"none"``, ``"clip"`` (global
    :func:`gradlab.clip_grad_norm_` at ``max_norm``) or ``"agc"`` (:func:`gradlab.agc_`
    at ``clip_factor``, the last layer excluded when ``exclude_head``).

    Returns the training loss at every step (inf once it is not finite, and the run
    stops), and the share of units AGC clipped (0 for the other methods).
    """
    if method not in ("none", "clip", "agc"):
        raise ValueError(f"method must be 'none', 'clip' or 'agc', got {method!r}")
    model = clone_model(model)
    x, y = agc_data()
    params = list(model.parameters())
    head = list(model[-1].parameters()) if exclude_head else []
    units = sum(p.shape[0] if p.dim() > 1 else 1 for p in params if not _is_in(p, head))
    optimizer = torch.optim.SGD(params, lr=lr)
    g = torch.Generator().manual_seed(1000 + seed)
    losses, clipped = [], 0
    for _ in range(steps):
        index = torch.randint(0, len(x), (batch,), generator=g)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x[index]), y[index])
        loss.backward()
        value = loss.item()
        if not math.isfinite(value):
            losses += [math.inf] * (steps - len(losses))
            break
        losses.append(value)
        if method == "clip":
            gradlab.clip_grad_norm_(params, max_norm)
        elif method == "agc":
            clipped += int(agc_(params, clip_factor, exclude=head))
        optimizer.step()
    with torch.no_grad():
        final = nn.functional.mse_loss(model(x), y).item()
    return {
        "losses": losses,
        "final": final if math.isfinite(final) else math.inf,
        "clipped_share": clipped / (units * steps) if method == "agc" else 0.0,
    }


def _is_in(p: Tensor, group: Sequence[Tensor]) -> bool:
    return any(p is q for q in group)


def _smooth(values: Sequence[float], width: int = 10) -> np.ndarray:
    v = np.minimum(np.asarray(values, dtype=float), 1e6)
    kernel = np.ones(width) / width
    return np.convolve(v, kernel, mode="valid")


def agc_curves_figure(runs: dict[str, dict[str, Any]], title: str = "") -> Figure:
    """Training-loss curves (moving average of 10 steps) of :func:`train_agc` runs."""
    fig = new_figure(6.4, 3.0)
    ax = fig.subplots()
    colours, styles = [KEEP, CLIP, NONE, SKIP], ["-", "--", ":", "-."]
    for i, (label, run) in enumerate(runs.items()):
        colour, style = colours[i % len(colours)], styles[i % len(styles)]
        ax.plot(_smooth(run["losses"]), style, color=colour, lw=1.4, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def agc_figure(
    clip_factor: float, ratios: list[dict[str, Any]], runs: dict[Any, dict[str, Any]]
) -> Figure:
    """Top: every unit's ``‖G_i‖/‖W_i‖`` (head excluded) and the bound ``ρ``; bottom: the
    training loss with AGC at ``ρ``, from ``runs`` keyed by ρ, beside ``runs["clip"]``
    (global clipping) and ``runs["reference"]`` (the unscaled network, clipped globally).
    Drawn for a phone, as the threshold explorables (:data:`PANEL_WIDTH`). A ``ρ`` with
    no run in ``runs`` (a value off the slider) draws the bound and says so.

    Raises:
        ValueError: ``clip_factor`` is not a positive, finite number.
    """
    if not (isinstance(clip_factor, numbers.Real) and 0.0 < clip_factor < math.inf):
        raise ValueError(f"clip_factor must be a positive, finite number, got {clip_factor!r}")
    fig = new_figure(PANEL_WIDTH, 6.2)
    top, bottom = fig.subplots(2, 1)
    x0 = 0
    for row in ratios[:-2]:  # the head (last weight and bias) is excluded
        r = np.asarray(row["ratios"], dtype=float)
        xs = np.arange(x0, x0 + len(r))
        over = r > clip_factor
        top.scatter(xs[~over], r[~over], s=12, color=KEEP)
        top.scatter(xs[over], r[over], s=18, color=CLIP, marker="x")
        top.annotate(row["name"], (x0, np.nanmax(r)), xytext=(0, 4), textcoords="offset points",
                     fontsize=TEXT_PT)  # fmt: skip
        x0 += len(r) + 2
    top.axhline(clip_factor, color=THRESHOLD, ls="--", lw=1, label=rf"$\rho$ = {clip_factor:g}")
    top.set_yscale("log")
    top.set_ylabel("‖G_i‖ / ‖W_i‖ at step 0")
    top.set_xticks([])
    top.set_xlabel("units (rows; a bias is one unit)")
    top.legend(fontsize=TEXT_PT, loc="center right")
    _style_axes(top)
    curves = [
        ("unscaled, global clip", runs["reference"], NONE, ":"),
        ("scaled, global clip", runs["clip"], CLIP, "-"),
    ]
    if clip_factor in runs:
        curves.append((rf"scaled, AGC $\rho$ = {clip_factor:g}", runs[clip_factor], KEEP, "-"))
        final = runs[clip_factor]["final"]
        bottom.set_title(rf"AGC at $\rho$ = {clip_factor:g}: final loss {final:.3g}",
                         fontsize=TEXT_PT)  # fmt: skip
    else:
        bottom.set_title(rf"no training run stored at $\rho$ = {clip_factor:g}", fontsize=TEXT_PT)
    for label, run, colour, style in curves:
        bottom.plot(_smooth(run["losses"]), style, color=colour, lw=1.4, label=label)
    bottom.set_yscale("log")
    bottom.set_xlabel("step")
    bottom.set_ylabel("loss (10-step mean)")
    fig.legend(*bottom.get_legend_handles_labels(), loc="outside lower center", ncols=1,
               fontsize=TEXT_PT)  # fmt: skip
    _style_axes(bottom)
    return fig
