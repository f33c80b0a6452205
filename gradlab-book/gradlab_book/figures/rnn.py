r"""Vanilla tanh RNNs on the addition problem (book/training/rnn_long_dependency).

The addition problem of Hochreiter and Schmidhuber (1997), as used by Pascanu, Mikolov
and Bengio (2013): each input step carries a number drawn uniformly from [0, 1] and a
marker bit. Two steps are marked, one in the first 10% of the sequence and one in the
rest of its first half, so the first marked number must be carried through at least
90% of the sequence; the target, read from the last hidden state, is the sum of the two
marked numbers. Predicting the mean, 1, scores a mean squared error of 1/6; a run
*solves* the task when its MSE on held-out sequences falls below ``Setup.success_mse``.

Plain SGD (no momentum), as in the paper, at several learning rates, with five ways of
handling its gradient (:data:`CONTROLS`):

``none``        no control;
``clip_norm``   :func:`gradlab.clip_grad_norm_` at ``tau`` (median of calm norms);
``clip_value``  :func:`gradlab.clip_grad_value_` at ``c`` (median of calm largest entries);
``zero``        :func:`gradlab.grad_ignore_norm_` at ``zero`` (a high percentile of calm
                norms), then ``optimizer.step()``;
``skip``        :class:`gradlab.StepGuard` with ``mode="skip"`` at ``skip`` (a higher one).

:func:`train_group` trains many such runs of one length at once, as one batched
computation (one ``torch.bmm`` per time step for all of them), and controls each run's
gradient with gradlab's functions on that run's own parameters. The sweep comes from
``experiments/rnn_long_dependency.py``, which writes ``rnn_long_dependency.json``
(:mod:`gradlab_book.stored`); :func:`load_results` reads it back. Compute functions
return plain numbers and lists; figure functions draw them.
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
    "CONTROLS",
    "DATA_PATH",
    "LABELS",
    "AdditionRNN",
    "Setup",
    "addition_batch",
    "best_rates",
    "calibrate",
    "cliff_figure",
    "direction_stats",
    "forward",
    "jacobian_check",
    "load_results",
    "make_model",
    "runs_of",
    "setup_dict",
    "setup_from",
    "summary",
    "sweep_figure",
    "sweep_lines",
    "test_set",
    "train_group",
]

CONTROLS = ("none", "clip_norm", "clip_value", "zero", "skip")
LABELS = {
    "none": "no control",
    "clip_norm": "clip by norm",
    "clip_value": "clip by value",
    "zero": "zero by norm",
    "skip": "skip (StepGuard)",
}
COLOURS = {
    "none": NONE,
    "clip_norm": CLIP,
    "clip_value": KEEP,
    "zero": IGNORE,
    "skip": SKIP,
}
STYLES = {"none": "-", "clip_norm": "-", "clip_value": "--", "zero": "-", "skip": ":"}
#: The controls whose runs store the direction probes (see :func:`train_group`).
PROBED = ("none", "clip_norm")

DATA_PATH = stored.path("rnn_long_dependency.json")


@dataclass(frozen=True)
class Setup:
    """Everything about a run except the length, the learning rate, the control and the seed."""

    hidden: int = 32
    batch: int = 20
    steps: int = 500  # the budget; a run stops early once solved or diverged
    spectral_radius: float = 1.0  # of the recurrent matrix at initialisation
    input_std: float = 0.1
    n_test: int = 256
    eval_every: int = 50
    stride: int = 25  # gradient norms are stored as the largest of each window
    success_mse: float = 0.01
    calibration_lr: float = 0.01
    calibration_steps: int = 200
    calibration_seeds: tuple[int, ...] = (900, 901, 902)
    calm_ratio: float = 10.0  # a calm calibration run never exceeds this x its median norm
    zero_percentile: float = 99.0
    skip_percentile: float = 99.9
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


# ------------------------------------------------------------------------ training


def _round(value: float, digits: int = 7) -> float | None:
    """``digits`` significant digits; ``None`` for a non-finite value."""
    return float(f"{value:.{digits}g}") if math.isfinite(value) else None


def forward(params: Sequence[Tensor], x: Tensor) -> Tensor:
    r"""The outputs of ``M`` RNNs at once: ``params`` are the six parameters of
    :class:`AdditionRNN`, each stacked over the models (``weight_hh`` is ``(M, H, H)``),
    ``x`` is ``(M, n, T, 2)`` or ``(n, T, 2)`` (the same sequences for every model).

    Returns:
        Tensor: ``(M, n)``, model ``m``'s prediction for its sequence ``i``; the same
        maths as ``model(x)`` of each :class:`AdditionRNN` (checked in the tests).
    """
    w_ih, w_hh, b_ih, b_hh, v, b_y = params
    pre = torch.matmul(x if x.dim() == 4 else x.unsqueeze(0), w_ih.transpose(1, 2).unsqueeze(1))
    # Each bias added on its own: (b_ih + b_hh) would give both one gradient storage.
    pre = pre + b_ih[:, None, None, :] + b_hh[:, None, None, :]
    w_t = w_hh.transpose(1, 2)
    h = torch.zeros(pre.shape[0], pre.shape[1], pre.shape[3], dtype=pre.dtype)
    for t in range(pre.shape[2]):
        h = torch.tanh(pre[:, :, t] + torch.bmm(h, w_t))
    return torch.bmm(h, v.transpose(1, 2)).squeeze(-1) + b_y


def _stack(models: Sequence[AdditionRNN]) -> list[Tensor]:
    return [torch.stack(ps) for ps in zip(*(list(m.parameters()) for m in models), strict=True)]


def _mse(params: Sequence[Tensor], x: Tensor, y: Tensor) -> list[float]:
    with torch.no_grad():
        mse = ((forward(params, x) - y.view(1, -1)) ** 2).mean(1)
    return [v if math.isfinite(v) else math.inf for v in mse.tolist()]


def train_group(
    length: int,
    runs: Sequence[tuple[float, str, int]],
    thresholds: dict[str, float] | None = None,
    setup: Setup = Setup(),
    steps: int | None = None,
    record: bool = False,
) -> list[dict[str, Any]]:
    """Train several runs of one sequence length, each ``(lr, control, seed)``, at once.

    Each run is its own :class:`AdditionRNN` (:func:`make_model` of its seed) with its own
    :class:`torch.optim.SGD` and, for ``skip``, its own :class:`gradlab.StepGuard`; its
    batches come from ``10_000 + seed``, so runs of one seed see the same data. The
    forward and backward passes of all runs are one batched computation (:func:`forward`);
    each run's gradient is controlled with gradlab on that run's own parameters.

    **The direction probe.** At every evaluation before the last, the runs of
    :data:`PROBED` also measure where their current gradient ``g`` points: the held-out
    MSE after a step of length ``lr * tau`` along ``-g / ||g||`` (the clipped step) and
    along a random unit direction, against the MSE before it.

    Args:
        length (int): the sequence length T.
        runs (sequence of (float, str, int)): learning rate, one of :data:`CONTROLS`, seed.
        thresholds (dict): ``norm``, ``value``, ``zero``, ``skip`` (:func:`calibrate`);
            ``None`` only if every control is ``none``.
        setup (Setup): sizes and settings. Default: ``Setup()``
        steps (int): stop after this many steps: a prefix. Default: ``setup.steps``
        record (bool): also return every step's norm (for calibration). Default: False

    Returns:
        list[dict]: per run, plain numbers: ``eval_steps`` and ``test_mse`` (``None`` once
        non-finite); ``norm_max`` (the largest total gradient norm before any control in
        each window of ``stride`` steps, ``None`` if non-finite) and ``acted`` (how many
        steps of the window were clipped, zeroed or skipped); ``steps_run``;
        ``solved_at`` (the first evaluated step with MSE below ``success_mse``, where the
        run stops); ``diverged``; ``probe`` for :data:`PROBED` runs (``norm``, ``mse``,
        ``along``, ``random``: four lists, one entry per probe).
    """
    for _, control, _ in runs:
        if control not in CONTROLS:
            raise ValueError(f"control must be one of {CONTROLS}, got {control!r}")
    if thresholds is None and any(c != "none" for _, c, _ in runs):
        raise ValueError("thresholds are needed for a control other than 'none'")
    budget = setup.steps if steps is None else int(steps)
    th = thresholds or {}
    models = [make_model(seed, setup) for _, _, seed in runs]
    params = [list(m.parameters()) for m in models]
    optimizers = [torch.optim.SGD(p, lr=lr) for p, (lr, _, _) in zip(params, runs, strict=True)]
    guards = [
        gradlab.StepGuard(opt, mode="skip", threshold=th["skip"], max_consecutive_skips=None)
        if control == "skip"
        else None
        for opt, (_, control, _) in zip(optimizers, runs, strict=True)
    ]
    seeds = sorted({seed for _, _, seed in runs})
    streams = {s: torch.Generator().manual_seed(10_000 + s) for s in seeds}
    row = torch.tensor([seeds.index(seed) for _, _, seed in runs])
    x_test, y_test = test_set(length, setup)
    out = [
        {
            "length": int(length),
            "lr": float(lr),
            "control": control,
            "seed": int(seed),
            "eval_steps": [],
            "test_mse": [],
            "norm_max": [],
            "acted": [],
            "steps_run": 0,
            "solved_at": None,
            "diverged": False,
            **(
                {"probe": {"norm": [], "mse": [], "along": [], "random": []}}
                if control in PROBED
                else {}
            ),
            **({"step_norms": [], "step_max_abs": []} if record else {}),
        }
        for lr, control, seed in runs
    ]
    active = [True] * len(runs)
    window_norm, window_acted = [0.0] * len(runs), [0] * len(runs)
    for step in range(budget + 1):
        if step < budget:
            batches = [addition_batch(setup.batch, length, streams[s]) for s in seeds]
            x = torch.stack([b[0] for b in batches])[row]
            y = torch.stack([b[1] for b in batches])[row].squeeze(-1)
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            stacks = _stack(models)
            loss = ((forward(stacks, x) - y) ** 2).mean(1)
            loss.sum().backward()
        if step % setup.eval_every == 0 or step == budget:
            stacks = [s.detach() for s in _stack(models)]
            mse = _mse(stacks, x_test, y_test)
            probing = step < budget and any(
                a and r["control"] in PROBED for a, r in zip(active, out, strict=True)
            )
            if probing:
                along, rand, norms = _probe(step, runs, params, stacks, th, x_test, y_test)
            for k, run in enumerate(out):
                if not active[k]:
                    continue
                run["eval_steps"].append(step)
                run["test_mse"].append(_round(mse[k]))
                if probing and run["control"] in PROBED:
                    for key, value in (
                        ("norm", norms[k]),
                        ("mse", mse[k]),
                        ("along", along[k]),
                        ("random", rand[k]),
                    ):
                        run["probe"][key].append(_round(value, 5))
                if mse[k] < setup.success_mse or not math.isfinite(mse[k]):
                    run["solved_at"] = step if math.isfinite(mse[k]) else None
                    run["diverged"] = not math.isfinite(mse[k])
                    active[k] = False
                    _close_window(run, window_norm, window_acted, k, step, setup)
            if step == budget:
                break
        norms, acted = [], []
        for k, (_, control, _) in enumerate(runs):
            if not active[k]:
                norms.append(torch.tensor(math.nan))
                acted.append(torch.tensor(False))
                continue
            grads = [p.grad for p in params[k]]
            if control == "clip_norm":
                norm = gradlab.clip_grad_norm_(params[k], th["norm"])
                did = ~gradlab.keep_by_norm(norm, th["norm"])
            elif control == "clip_value":
                norm = gradlab.get_total_norm(grads)
                did = ~gradlab.keep_by_value(gradlab.get_total_norm(grads, math.inf), th["value"])
                gradlab.clip_grad_value_(params[k], th["value"])
            elif control == "zero":
                norm = gradlab.grad_ignore_norm_(params[k], th["zero"])
                did = ~gradlab.keep_by_norm(norm, th["zero"])
            elif control == "skip":
                record_ = guards[k].step()
                norm = torch.tensor(float(record_.total_norm))
                did = torch.tensor(record_.decision == "skipped")
            else:
                norm = gradlab.get_total_norm(grads)
                did = torch.tensor(False)
            if record:
                out[k]["step_max_abs"].append(
                    _round(gradlab.get_total_norm(grads, math.inf).item())
                )
            if control != "skip":
                optimizers[k].step()
            norms.append(norm.float())
            acted.append(did)
        norms_host = torch.stack(norms).tolist()
        acted_host = torch.stack(acted).tolist()
        for k, run in enumerate(out):
            if not active[k]:
                continue
            norm = norms_host[k]
            run["steps_run"] = step + 1
            if record:
                run["step_norms"].append(_round(norm))
            window_norm[k] = max(window_norm[k], norm) if math.isfinite(norm) else math.inf
            window_acted[k] += int(acted_host[k])
            if (step + 1) % setup.stride == 0:
                run["norm_max"].append(_round(window_norm[k], 5))
                run["acted"].append(window_acted[k])
                window_norm[k], window_acted[k] = 0.0, 0
    for k, run in enumerate(out):
        if active[k]:
            _close_window(run, window_norm, window_acted, k, run["steps_run"], setup)
    return out


def _close_window(run, window_norm, window_acted, k, step, setup) -> None:
    """Store a window that a stop (solved, diverged, budget) cut short."""
    if step % setup.stride != 0:
        run["norm_max"].append(_round(window_norm[k], 5))
        run["acted"].append(window_acted[k])
    window_norm[k], window_acted[k] = 0.0, 0


def _probe(step, runs, params, stacks, th, x_test, y_test):
    """Held-out MSE after a step of ``lr * tau`` along ``-g/||g||`` and along a random
    unit direction (seeded by the run's seed and the step), for every run."""
    along, rand, norms = [], [], []
    for k, (lr, _, seed) in enumerate(runs):
        grads = [p.grad.detach() for p in params[k]]
        norm = gradlab.get_total_norm(grads).item()
        g = torch.Generator().manual_seed(1_000_003 * seed + step)
        noise = [torch.randn(p.shape, generator=g) for p in grads]
        scale = lr * th.get("norm", 1.0)
        along.append([-scale * d / (norm + 1e-12) for d in grads])
        r_norm = gradlab.get_total_norm(noise).item()
        rand.append([-scale * d / r_norm for d in noise])
        norms.append(norm)
    moved = []
    for deltas in (along, rand):
        shifted = [
            s + torch.stack(d) for s, d in zip(stacks, zip(*deltas, strict=True), strict=True)
        ]
        moved.append(_mse(shifted, x_test, y_test))
    return moved[0], moved[1], norms


def calibrate(length: int, setup: Setup = Setup()) -> dict[str, Any]:
    """The thresholds of one length, from uncontrolled runs at ``calibration_lr`` on seeds
    the sweep never uses, and only from the *calm* ones.

    A calibration run is calm when every one of its ``calibration_steps`` norms is finite
    and none exceeds ``calm_ratio`` times its own median. Pooled over the calm runs:
    ``norm`` (clip by norm) is the median total 2-norm, as Pascanu et al. suggest a
    threshold near the typical norm; ``value`` (clip by value) the median largest
    |entry|; ``zero`` and ``skip`` the ``zero_percentile`` and ``skip_percentile`` of the
    norms, so that they act only on steps larger than calm training makes.

    Returns:
        dict: the four thresholds, and ``seeds``: per calibration seed its median and
        largest norm and whether it was calm.

    Raises:
        RuntimeError: if no calibration run is calm.
    """
    runs = [(setup.calibration_lr, "none", s) for s in setup.calibration_seeds]
    done = train_group(length, runs, None, setup, setup.calibration_steps, record=True)
    norms, maxes, report = [], [], []
    for run in done:
        values = [math.inf if v is None else v for v in run["step_norms"]]
        median = float(np.median(values))
        calm = all(math.isfinite(v) for v in values) and max(values) <= setup.calm_ratio * median
        report.append({"seed": run["seed"], "median": median, "max": max(values), "calm": calm})
        if calm:
            norms += values
            maxes += run["step_max_abs"]
    if not norms:
        raise RuntimeError(f"no calm calibration run at length {length}")
    return {
        "norm": float(np.median(norms)),
        "value": float(np.median(maxes)),
        "zero": float(np.percentile(norms, setup.zero_percentile)),
        "skip": float(np.percentile(norms, setup.skip_percentile)),
        "seeds": report,
    }


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
    """The stored sweep: ``setup`` (a :class:`Setup`), ``lengths``, ``lrs``, ``controls``,
    ``seeds``, ``thresholds`` (by length, as a string key), ``platform`` and ``runs``."""
    data = json.loads(Path(path).read_text())
    data["setup"] = setup_from(data["setup"])
    return data


def runs_of(data: dict[str, Any], length: int, control: str, lr: float) -> list[dict[str, Any]]:
    """The stored runs of one (length, control, lr), in seed order."""
    runs = [
        r
        for r in data["runs"]
        if r["length"] == length and r["control"] == control and r["lr"] == lr
    ]
    return sorted(runs, key=lambda r: r["seed"])


def _last_mse(run: dict[str, Any]) -> float:
    """The held-out MSE a run ended with: ``inf`` if it diverged."""
    return math.inf if run["diverged"] else run["test_mse"][-1]


def summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The seeds of one cell: how many solved, diverged or ran out of steps, the median
    last MSE (``inf`` counts a divergence), every seed's last MSE, and the share of steps
    the control acted on."""
    last = [_last_mse(r) for r in runs]
    solved = sum(r["solved_at"] is not None for r in runs)
    diverged = sum(r["diverged"] for r in runs)
    steps = sum(r["steps_run"] for r in runs)
    return {
        "runs": len(runs),
        "solved": solved,
        "diverged": diverged,
        "stalled": len(runs) - solved - diverged,
        "median_mse": float(np.median(last)) if last else math.nan,
        "last_mse": last,
        "acted_share": sum(sum(r["acted"]) for r in runs) / max(1, steps),
    }


def best_rates(data: dict[str, Any], length: int) -> dict[str, float]:
    """Each control's best learning rate at one length: the most seeds solved, then the
    lowest median last MSE (a divergence counts as infinite), then the smaller rate."""
    best = {}
    for control in data["controls"]:
        cells = [(lr, summary(runs_of(data, length, control, lr))) for lr in data["lrs"]]
        best[control] = min(cells, key=lambda c: (-c[1]["solved"], c[1]["median_mse"], c[0]))[0]
    return best


def direction_stats(
    data: dict[str, Any], length: int, control: str = "clip_norm", above: str = "zero"
) -> dict[str, Any]:
    """The direction probes of one length's ``control`` runs (every rate and seed) at
    gradients above the ``above`` threshold: how many, the share whose clipped step
    lowered the held-out MSE, against the share of random steps that did, and the median
    MSE change of each."""
    limit = data["thresholds"][str(length)][above]
    along, rand = [], []
    for run in data["runs"]:
        if run["length"] != length or run["control"] != control:
            continue
        p = run["probe"]
        for norm, mse, a, r in zip(p["norm"], p["mse"], p["along"], p["random"], strict=True):
            if None in (norm, mse, a, r) or norm <= limit:
                continue
            along.append(a - mse)
            rand.append(r - mse)
    n = len(along)
    return {
        "n": n,
        "along_lower": sum(d < 0 for d in along) / n if n else math.nan,
        "random_lower": sum(d < 0 for d in rand) / n if n else math.nan,
        "along_median": float(np.median(along)) if n else math.nan,
        "random_median": float(np.median(rand)) if n else math.nan,
    }


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


SHORT = {
    "none": "none",
    "clip_norm": "clip norm",
    "clip_value": "clip value",
    "zero": "zero",
    "skip": "skip",
}


def sweep_lines(data: dict[str, Any], length: int) -> list[str]:
    """The sweep of one length as text: one row per learning rate, one column per
    control; each cell is ``solved/seeds`` and the number of diverged seeds (``d``),
    then a row of each control's best rate (:func:`best_rates`)."""
    controls = data["controls"]
    lines = [f"{'lr':<7}" + "".join(f"{SHORT[c]:>12}" for c in controls)]
    for lr in data["lrs"]:
        cells = []
        for control in controls:
            s = summary(runs_of(data, length, control, lr))
            cells.append(f"{s['solved']}/{s['runs']} {s['diverged']}d")
        lines.append(f"{lr:<7g}" + "".join(f"{c:>12}" for c in cells))
    best = best_rates(data, length)
    lines.append(f"{'best':<7}" + "".join(f"{best[c]:>12g}" for c in controls))
    return lines


def sweep_figure(data: dict[str, Any]) -> Figure:
    """Per length (one panel each), the median last held-out MSE against the learning
    rate, one line per control; every seed is a dot, a divergence an x at the top."""
    lengths = data["lengths"]
    fig = new_figure(6.4, 3.0)
    axes = np.atleast_1d(fig.subplots(1, len(lengths), sharey=True))
    top = 2.0
    lrs = np.array(data["lrs"], dtype=float)
    offsets = np.linspace(-0.08, 0.08, len(data["controls"]))
    for ax, length in zip(axes, lengths, strict=True):
        for offset, control in zip(offsets, data["controls"], strict=True):
            medians = []
            for lr in data["lrs"]:
                s = summary(runs_of(data, length, control, lr))
                medians.append(min(s["median_mse"], top))
                xs = lr * 2**offset
                finite = [v for v in s["last_mse"] if math.isfinite(v)]
                ax.plot([xs] * len(finite), finite, ".", color=COLOURS[control], ms=3, alpha=0.6)
                if s["diverged"]:
                    ax.plot(xs, top, "x", color=COLOURS[control], ms=5)
            ax.plot(
                lrs * 2**offset,
                medians,
                STYLES[control],
                color=COLOURS[control],
                lw=1.3,
                label=LABELS[control],
            )
        ax.axhline(data["setup"].success_mse, color=THRESHOLD, ls="--", lw=0.8)
        ax.axhline(1 / 6, color=THRESHOLD, ls=":", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(3e-3, top * 1.3)
        ax.set_xticks(lrs, [f"{v:g}" for v in lrs])
        ax.minorticks_off()
        ax.set_xlabel("learning rate")
        ax.set_title(f"T = {length}", fontsize=9)
    axes[0].set_ylabel("last held-out MSE (x: diverged)")
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return fig


def cliff_figure(
    data: dict[str, Any],
    length: int,
    lr: float,
    seed: int,
    controls: Sequence[str] = ("none", "clip_norm"),
) -> Figure:
    """One seed at one (length, lr) under several controls: held-out MSE (top) and the
    largest total gradient norm of each window of steps (bottom), log scales."""
    setup = data["setup"]
    tau = data["thresholds"][str(length)]["norm"]
    fig = new_figure(6.4, 4.2)
    top, bottom = fig.subplots(2, 1, sharex=True)
    for control in controls:
        run = next(r for r in runs_of(data, length, control, lr) if r["seed"] == seed)
        colour, style = COLOURS[control], STYLES[control]
        top.plot(run["eval_steps"], _none_to_nan(run["test_mse"]), style, color=colour, lw=1.4)
        norms = _none_to_nan(run["norm_max"])
        windows = np.minimum(setup.stride * np.arange(1, len(norms) + 1), run["steps_run"])
        bottom.plot(windows, norms, style, color=colour, lw=1.0, label=LABELS[control])
        if run["diverged"]:
            for ax in (top, bottom):
                ax.axvline(run["steps_run"], color=colour, lw=0.8, ls=":")
    top.axhline(setup.success_mse, color=THRESHOLD, ls="--", lw=1)
    top.axhline(1 / 6, color=THRESHOLD, ls=":", lw=1)
    top.set_yscale("log")
    top.set_ylabel("held-out MSE")
    bottom.axhline(tau, color=THRESHOLD, ls="--", lw=1, label=rf"$\tau$ = {tau:.2g}")
    bottom.set_yscale("log")
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"largest norm per {setup.stride} steps")
    bottom.legend(fontsize=7, loc="upper right", ncol=2)
    fig.suptitle(
        f"T = {length}, learning rate {lr:g}, seed {seed} (dotted vertical line: diverged)",
        fontsize=9,
    )
    return fig
