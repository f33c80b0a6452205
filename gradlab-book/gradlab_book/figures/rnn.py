r"""Vanilla tanh RNNs on the addition problem (book/training/rnn_long_dependency).

The addition problem of Hochreiter and Schmidhuber (1997), as used by Pascanu, Mikolov
and Bengio (2013): each input step carries a number drawn uniformly from [0, 1] and a
marker bit. Two steps are marked, one in the first 10% of the sequence and one in the
first half; the target, read from the last hidden state, is the sum of the two marked
numbers. Predicting the mean, 1, scores a mean squared error of 1/6; a run *solves*
the task when its MSE on held-out sequences falls below ``Setup.success_mse`` (0.01).

Plain SGD (no momentum), as in the paper, with five ways of handling its gradient:

``none``        no control;
``clip_norm``   :func:`gradlab.clip_grad_norm_` at ``tau_norm``;
``clip_value``  :func:`gradlab.clip_grad_value_` at ``tau_value``;
``zero``        :func:`gradlab.grad_ignore_norm_` at ``tau_norm``, then ``optimizer.step()``;
``skip``        :class:`gradlab.StepGuard` with ``mode="skip"`` at ``skip_factor * tau_norm``;
``none_low_lr`` no control at ``low_lr``, half the learning rate, as a reference.

The long runs come from ``experiments/rnn_long_dependency.py``, which calls
:func:`train_run` for every (length, method, seed) and writes
``rnn_long_dependency.json`` (:mod:`gradlab_book.stored`); :func:`load_results` reads it back.
Compute functions return plain numbers and lists; figure functions draw them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

import gradlab
from gradlab_book import stored
from gradlab_book.plots import CLIP, IGNORE, KEEP, NONE, SKIP, THRESHOLD, new_figure

__all__ = [
    "DATA_PATH",
    "LABELS",
    "METHODS",
    "AdditionRNN",
    "Setup",
    "addition_batch",
    "calibrate",
    "cliff_figure",
    "curves_figure",
    "jacobian_check",
    "load_results",
    "make_model",
    "run_stats",
    "runs_of",
    "setup_dict",
    "setup_from",
    "success_figure",
    "success_lines",
    "success_table",
    "test_set",
    "train_run",
]

METHODS = ("none", "clip_norm", "clip_value", "zero", "skip", "none_low_lr")
LABELS = {
    "none": "no control",
    "none_low_lr": "no control, half the lr",
    "clip_norm": "clip by norm",
    "clip_value": "clip by value",
    "zero": "zero by norm",
    "skip": "skip (StepGuard)",
}
COLOURS = {
    "none": NONE,
    "none_low_lr": KEEP,
    "clip_norm": CLIP,
    "clip_value": CLIP,
    "zero": IGNORE,
    "skip": SKIP,
}
STYLES = {
    "none": "-",
    "none_low_lr": "-.",
    "clip_norm": "-",
    "clip_value": "--",
    "zero": "-",
    "skip": ":",
}

DATA_PATH = stored.path("rnn_long_dependency.json")


@dataclass(frozen=True)
class Setup:
    """Everything about a run except the sequence length, the method and the seed."""

    hidden: int = 32
    batch: int = 20
    steps: int = 3000  # the budget; a run stops early once solved or diverged
    lr: float = 0.2
    low_lr: float = 0.1  # the learning rate of the ``none_low_lr`` reference
    spectral_radius: float = 1.0  # of the recurrent matrix at initialisation
    input_std: float = 0.1
    n_test: int = 1000
    eval_every: int = 100
    stride: int = 25  # gradient norms are stored as the largest of each window
    success_mse: float = 0.01
    skip_factor: float = 10.0  # StepGuard skips only steps over skip_factor * tau_norm
    calibration_steps: int = 100
    calibration_seeds: tuple[int, ...] = (900, 901)
    test_seed: int = 12345


# ---------------------------------------------------------------------------- data


def addition_batch(n: int, length: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``n`` sequences of the addition problem: inputs ``(n, length, 2)``, targets ``(n, 1)``.

    Channel 0 holds the numbers, U[0, 1]; channel 1 marks two steps, one drawn from the
    first ``max(1, length // 10)`` steps and one from the rest of the first half.
    """
    if length < 4:
        raise ValueError(f"length must be at least 4, got {length}")
    values = torch.rand(n, length, generator=generator)
    first_end = max(1, length // 10)
    first = torch.randint(0, first_end, (n,), generator=generator)
    second = torch.randint(first_end, max(first_end + 1, length // 2), (n,), generator=generator)
    marks = torch.zeros(n, length)
    rows = torch.arange(n)
    marks[rows, first] = 1.0
    marks[rows, second] = 1.0
    target = (values * marks).sum(1, keepdim=True)
    return torch.stack([values, marks], dim=-1), target


def test_set(length: int, setup: Setup = Setup()) -> tuple[Tensor, Tensor]:
    """The held-out sequences of one length (the same for every method and seed)."""
    g = torch.Generator().manual_seed(setup.test_seed + length)
    return addition_batch(setup.n_test, length, g)


# --------------------------------------------------------------------------- model


class AdditionRNN(nn.Module):
    r"""A vanilla RNN, :math:`h_t = \tanh(W_{hh} h_{t-1} + W_{xh} x_t + b)`, read out linearly at
    the last step. ``rnn`` is a :class:`torch.nn.RNN` (its loop runs in C++)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.rnn = nn.RNN(2, hidden, nonlinearity="tanh", batch_first=True)
        self.readout = nn.Linear(hidden, 1)

    def states(self, x: Tensor) -> Tensor:
        """Hidden states :math:`h_1, \\dots, h_T`, shape ``(n, T, hidden)``."""
        return self.rnn(x)[0]

    def forward(self, x: Tensor) -> Tensor:
        return self.readout(self.states(x)[:, -1])


def make_model(seed: int, setup: Setup = Setup()) -> AdditionRNN:
    """The model of one seed: Gaussian recurrent matrix rescaled to spectral radius
    ``setup.spectral_radius``, input and readout weights N(0, ``input_std``^2), zero
    biases."""
    g = torch.Generator().manual_seed(seed)
    model = AdditionRNN(setup.hidden)
    with torch.no_grad():
        w = torch.randn(setup.hidden, setup.hidden, generator=g, dtype=torch.float64)
        w *= setup.spectral_radius / torch.linalg.eigvals(w).abs().max()
        model.rnn.weight_hh_l0.copy_(w)
        model.rnn.weight_ih_l0.normal_(0.0, setup.input_std, generator=g)
        model.readout.weight.normal_(0.0, setup.input_std, generator=g)
        for bias in (model.rnn.bias_ih_l0, model.rnn.bias_hh_l0, model.readout.bias):
            bias.zero_()
    return model


def _mse(model: nn.Module, x: Tensor, y: Tensor) -> float:
    with torch.no_grad():
        value = nn.functional.mse_loss(model(x), y).item()
    return value if math.isfinite(value) else math.inf


def _round(value: float) -> float | None:
    """Seven significant digits (float32 precision); ``None`` for a non-finite value."""
    return float(f"{value:.7g}") if math.isfinite(value) else None


# ------------------------------------------------------------------------ training


def calibrate(length: int, setup: Setup = Setup()) -> dict[str, float]:
    """The thresholds for one length: the median total 2-norm (``norm``) and the median
    largest |entry| (``value``) of the gradients of the first ``calibration_steps``
    uncontrolled steps, on seeds the experiment never uses.

    Pascanu et al. suggest a threshold near the average norm over many updates; the
    median ignores the spikes. Each rule acts on about half of those steps.
    """
    norms, maxes = [], []
    for seed in setup.calibration_seeds:
        run = train_run(length, "none", seed, setup, steps=setup.calibration_steps, record=True)
        norms += [v for v in run["step_norms"] if v is not None]
        maxes += [v for v in run["step_max_abs"] if v is not None]
    return {"norm": float(np.median(norms)), "value": float(np.median(maxes))}


def train_run(
    length: int,
    method: str,
    seed: int,
    setup: Setup = Setup(),
    thresholds: dict[str, float] | None = None,
    steps: int | None = None,
    record: bool = False,
) -> dict[str, Any]:
    """Train one model on the addition problem with one gradient control.

    Args:
        length: the sequence length T.
        method: one of :data:`METHODS`.
        seed: the initialisation (``seed``) and the training batches (``10_000 + seed``).
        setup: sizes and optimiser settings.
        thresholds: ``{"norm": tau, "value": c}``; ``None`` means infinite (never act).
        steps: stop after this many steps (default ``setup.steps``): a prefix of the run.
        record: also return every step's norm and largest entry (for calibration).

    Returns:
        A dict of plain numbers and lists: ``eval_steps`` and ``test_mse`` (every
        ``eval_every`` steps, ``None`` once non-finite); ``norm_max`` (the largest total
        gradient norm, before any control, in each window of ``stride`` steps) and
        ``acted`` (how many steps of the window the control clipped, zeroed or skipped);
        ``steps_run``; ``solved_at`` (the first evaluated step with test MSE below
        ``success_mse``, or ``None``); ``diverged``. The run stops at ``solved_at``.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    budget = setup.steps if steps is None else int(steps)
    tau = math.inf if thresholds is None else float(thresholds["norm"])
    c = math.inf if thresholds is None else float(thresholds["value"])
    model = make_model(seed, setup)
    params = list(model.parameters())
    lr = setup.low_lr if method == "none_low_lr" else setup.lr
    optimizer = torch.optim.SGD(params, lr=lr)
    guard = None
    if method == "skip":  # a stall is a result here, not an error: no skip limit
        guard = gradlab.StepGuard(
            optimizer,
            mode="skip",
            threshold=setup.skip_factor * tau,
            max_consecutive_skips=None,
        )
    x_test, y_test = test_set(length, setup)
    batches = torch.Generator().manual_seed(10_000 + seed)

    eval_steps, test_mse = [0], [_round(_mse(model, x_test, y_test))]
    norm_max, acted, step_norms, step_max_abs = [], [], [], []
    window_norm, window_acted = 0.0, 0
    solved_at, diverged, step = None, False, 0
    while step < budget:
        x, y = addition_batch(setup.batch, length, batches)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad for p in params]
        norm = gradlab.get_total_norm(grads).item()
        if record:
            step_norms.append(_round(norm))
            step_max_abs.append(_round(gradlab.get_total_norm(grads, math.inf).item()))
        over_norm = not tau / (norm + 1e-6) >= 1  # the library's rule, NaN is over
        if method == "clip_norm":
            gradlab.clip_grad_norm_(params, tau)
            did = over_norm
        elif method == "clip_value":
            did = not gradlab.get_total_norm(grads, math.inf).item() <= c
            gradlab.clip_grad_value_(params, c)
        elif method == "zero":
            gradlab.grad_ignore_norm_(params, tau)
            did = over_norm
        else:
            did = False
        if guard is not None:
            did = guard.step().decision != "kept"
        else:
            optimizer.step()
        step += 1
        window_norm = max(window_norm, norm) if math.isfinite(norm) else math.inf
        window_acted += int(did)
        if step % setup.stride == 0 or step == budget:
            norm_max.append(_round(window_norm))
            acted.append(window_acted)
            window_norm, window_acted = 0.0, 0
        if step % setup.eval_every == 0 or step == budget:
            mse = _mse(model, x_test, y_test)
            eval_steps.append(step)
            test_mse.append(_round(mse))
            if mse < setup.success_mse:
                solved_at = step
                break
            if not math.isfinite(mse):
                diverged = True
                break
    if step % setup.stride != 0 and step != budget:  # a run stopped inside a window
        norm_max.append(_round(window_norm))
        acted.append(window_acted)
    result = {
        "length": int(length),
        "method": method,
        "seed": int(seed),
        "eval_steps": eval_steps,
        "test_mse": test_mse,
        "norm_max": norm_max,
        "acted": acted,
        "steps_run": step,
        "solved_at": solved_at,
        "diverged": diverged,
    }
    if record:
        result["step_norms"] = step_norms
        result["step_max_abs"] = step_max_abs
    return result


def setup_dict(setup: Setup) -> dict[str, Any]:
    """``setup`` as JSON-ready plain values."""
    values = asdict(setup)
    values["calibration_seeds"] = list(setup.calibration_seeds)
    return values


def setup_from(values: dict[str, Any]) -> Setup:
    """The :class:`Setup` stored in a results file."""
    values = dict(values)
    values["calibration_seeds"] = tuple(values["calibration_seeds"])
    return Setup(**values)


def load_results(path: Path | str = DATA_PATH) -> dict[str, Any]:
    """The stored experiment: ``setup`` (a :class:`Setup`), ``lengths``, ``methods``,
    ``seeds``, ``thresholds`` (by length, as a string key) and ``runs``."""
    data = json.loads(Path(path).read_text())
    data["setup"] = setup_from(data["setup"])
    return data


def runs_of(data: dict[str, Any], length: int, method: str) -> list[dict[str, Any]]:
    """The stored runs of one (length, method), in seed order."""
    runs = [r for r in data["runs"] if r["length"] == length and r["method"] == method]
    return sorted(runs, key=lambda r: r["seed"])


def success_table(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (length, method): how many seeds solved the task, diverged or ran
    out of steps, which seeds solved it, and the median number of steps they took."""
    rows = []
    for length in data["lengths"]:
        for method in data["methods"]:
            runs = runs_of(data, length, method)
            solved = [r for r in runs if r["solved_at"] is not None]
            steps = [r["solved_at"] for r in solved]
            rows.append(
                {
                    "length": length,
                    "method": method,
                    "runs": len(runs),
                    "solved": len(solved),
                    "diverged": sum(r["diverged"] for r in runs),
                    "stalled": len(runs) - len(solved) - sum(r["diverged"] for r in runs),
                    "solved_seeds": [r["seed"] for r in solved],
                    "median_steps": float(np.median(steps)) if steps else math.nan,
                }
            )
    return rows


# -------------------------------------------------------------------- derivation


def jacobian_check(length: int = 20, seed: int = 0, setup: Setup = Setup()) -> dict[str, float]:
    r"""Check :math:`\partial h_T/\partial h_0 = \prod_{t=T}^{1} \mathrm{diag}(1 - h_t^2)\,W_{hh}`
    on one sequence of the model of ``seed``, in float64, and bound its norm.

    Returns the spectral norm of the product of Jacobians, the largest difference to
    autograd's Jacobian, :math:`\|W_{hh}\|_2`, the bound :math:`\|W_{hh}\|_2^T` (each tanh factor
    has norm at most 1) and the spectral radius of :math:`W_{hh}`.
    """
    model = make_model(seed, setup).double()
    x, _ = addition_batch(1, length, torch.Generator().manual_seed(seed))
    x = x.double()
    w = model.rnn.weight_hh_l0.detach()
    u, b = model.rnn.weight_ih_l0.detach(), (model.rnn.bias_ih_l0 + model.rnn.bias_hh_l0).detach()

    def last_state(h0: Tensor) -> Tensor:
        return model.rnn(x, h0.view(1, 1, -1))[0][0, -1]

    h0 = torch.zeros(setup.hidden, dtype=torch.float64)
    autograd = torch.autograd.functional.jacobian(last_state, h0)
    product = torch.eye(setup.hidden, dtype=torch.float64)
    h = h0
    for t in range(length):
        h = torch.tanh(w @ h + u @ x[0, t] + b)
        product = torch.diag(1 - h**2) @ w @ product
    w_norm = torch.linalg.matrix_norm(w, 2).item()
    return {
        "length": length,
        "product_norm": torch.linalg.matrix_norm(product, 2).item(),
        "max_difference": (product - autograd).abs().max().item(),
        "w_norm": w_norm,
        "bound": w_norm**length,
        "spectral_radius": torch.linalg.eigvals(w).abs().max().item(),
    }


# ------------------------------------------------------------------------- figures


def _none_to_nan(values: Sequence[float | None]) -> np.ndarray:
    return np.array([math.nan if v is None else v for v in values], dtype=float)


def success_figure(data: dict[str, Any]) -> Figure:
    """Share of seeds that solved the task, against sequence length, per method."""
    fig = new_figure(6.4, 3.2)
    ax = fig.subplots()
    rows = success_table(data)
    lengths = data["lengths"]
    offsets = np.linspace(-0.06, 0.06, len(data["methods"]))
    for offset, method in zip(offsets, data["methods"], strict=True):
        share = [
            next(r for r in rows if r["length"] == t and r["method"] == method)["solved"]
            / max(1, len(data["seeds"]))
            for t in lengths
        ]
        ax.plot(
            np.log2(lengths) + offset,
            share,
            STYLES[method],
            marker="o",
            color=COLOURS[method],
            label=LABELS[method],
        )
    ax.set_xticks(np.log2(lengths), [str(t) for t in lengths])
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("share of seeds solved")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return fig


def curves_figure(data: dict[str, Any], length: int, method: str) -> Figure:
    """Every seed of one (length, method): held-out MSE (left) and the largest total
    gradient norm of each window of steps (right), with the success level and the norm
    threshold."""
    setup = data["setup"]
    runs = runs_of(data, length, method)
    tau = data["thresholds"][str(length)]["norm"]
    fig = new_figure(6.4, 3.2)
    left, right = fig.subplots(1, 2)
    colour = COLOURS[method]
    for k, run in enumerate(runs):
        shade = 0.35 + 0.65 * (k + 1) / len(runs)
        mse = _none_to_nan(run["test_mse"])
        left.plot(run["eval_steps"], mse, color=colour, alpha=shade, lw=1.2)
        if run["diverged"]:
            left.plot(run["eval_steps"][-1], 1.0, "x", color=colour, ms=6)
        norms = _none_to_nan(run["norm_max"])
        windows = setup.stride * np.arange(1, len(norms) + 1)
        right.plot(windows, norms, color=colour, alpha=shade, lw=0.9)
    left.axhline(setup.success_mse, color=THRESHOLD, ls="--", lw=1, label="solved")
    left.axhline(1 / 6, color=KEEP, ls=":", lw=1, label="predict 1 (MSE 1/6)")
    finite = [v for run in runs for v in run["test_mse"] if v is not None]
    left.set_yscale("log")
    left.set_ylim(3e-3, max(2.0, 1.5 * max(finite, default=1.0)))
    left.set_xlim(0, setup.steps)
    left.set_xlabel("step")
    left.set_ylabel("held-out MSE")
    left.legend(fontsize=7, loc="lower left")
    right.axhline(tau, color=THRESHOLD, ls="--", lw=1, label=rf"$\tau$ = {tau:.2g}")
    if method == "skip":
        skip_at = setup.skip_factor * tau
        right.axhline(skip_at, color=SKIP, ls="--", lw=1, label=f"skip at {skip_at:.2g}")
    right.set_yscale("log")
    right.set_xlim(0, setup.steps)
    right.set_xlabel("step")
    right.set_ylabel(f"largest norm per {setup.stride} steps")
    right.legend(fontsize=7, loc="upper right")
    solved = sum(r["solved_at"] is not None for r in runs)
    fig.suptitle(
        f"T = {length}, {LABELS[method]}: {solved} of {len(runs)} seeds solved "
        "(x: diverged, at its last step)",
        fontsize=9,
    )
    return fig


SHORT = {
    "none": "none",
    "clip_norm": "clip norm",
    "clip_value": "clip value",
    "zero": "zero",
    "skip": "skip 10x",
    "none_low_lr": "none lr/2",
}


def success_lines(data: dict[str, Any]) -> list[str]:
    """The success table as text, one column per method, in four blocks: seeds solved
    out of seeds; failures (``d``: diverged, ``s``: not solved in the budget); which
    seeds solved it; the median number of steps the solved runs took."""
    rows = {(r["length"], r["method"]): r for r in success_table(data)}
    methods = data["methods"]

    def block(title: str, cell) -> list[str]:
        lines = [f"{title:<8}" + "".join(f"{SHORT[m]:>11}" for m in methods)]
        for length in data["lengths"]:
            cells = "".join(f"{cell(rows[(length, m)]):>11}" for m in methods)
            lines.append(f"T = {length:<4}" + cells)
        return lines

    return [
        *block("solved", lambda r: f"{r['solved']}/{r['runs']}"),
        "",
        *block("failed", lambda r: f"{r['diverged']}d {r['stalled']}s"),
        "",
        *block("seeds", lambda r: ",".join(map(str, r["solved_seeds"])) or "-"),
        "",
        *block(
            "steps", lambda r: "-" if math.isnan(r["median_steps"]) else f"{r['median_steps']:g}"
        ),
    ]


def cliff_figure(
    data: dict[str, Any], length: int, seed: int, methods: Sequence[str] = ("none", "clip_norm")
) -> Figure:
    """One seed at one length under several controls: held-out MSE (top) and the
    largest total gradient norm of each window of steps (bottom), log scales."""
    setup = data["setup"]
    tau = data["thresholds"][str(length)]["norm"]
    fig = new_figure(6.4, 4.2)
    top, bottom = fig.subplots(2, 1, sharex=True)
    for method in methods:
        run = next(r for r in runs_of(data, length, method) if r["seed"] == seed)
        colour, style = COLOURS[method], STYLES[method]
        top.plot(run["eval_steps"], _none_to_nan(run["test_mse"]), style, color=colour, lw=1.4)
        norms = _none_to_nan(run["norm_max"])
        windows = setup.stride * np.arange(1, len(norms) + 1)
        bottom.plot(windows, norms, style, color=colour, lw=1.0, label=LABELS[method])
        if run["diverged"]:
            top.axvline(run["steps_run"], color=colour, lw=0.8, ls=":")
            bottom.axvline(run["steps_run"], color=colour, lw=0.8, ls=":")
    top.axhline(setup.success_mse, color=THRESHOLD, ls="--", lw=1)
    top.set_yscale("log")
    top.set_ylabel("held-out MSE")
    bottom.axhline(tau, color=THRESHOLD, ls="--", lw=1, label=rf"$\tau$ = {tau:.2g}")
    if "skip" in methods:
        skip_at = setup.skip_factor * tau
        bottom.axhline(skip_at, color=SKIP, ls="--", lw=1, label=f"skip at {skip_at:.2g}")
    bottom.set_yscale("log")
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"largest norm per {setup.stride} steps")
    bottom.legend(fontsize=7, loc="upper right", ncol=2)
    fig.suptitle(f"T = {length}, seed {seed} (dotted vertical line: diverged)", fontsize=9)
    return fig


def run_stats(run: dict[str, Any]) -> dict[str, Any]:
    """What one stored run did: the share of its steps the control acted on, its last
    finite held-out MSE, the largest and the median of its windowed gradient norms."""
    norms = [v for v in run["norm_max"] if v is not None]
    finite_mse = [v for v in run["test_mse"] if v is not None]
    return {
        "steps_run": run["steps_run"],
        "acted_share": sum(run["acted"]) / max(1, run["steps_run"]),
        "last_mse": finite_mse[-1] if finite_mse else math.nan,
        "peak_norm": max(norms) if norms else math.nan,
        "median_norm": float(np.median(norms)) if norms else math.nan,
    }
