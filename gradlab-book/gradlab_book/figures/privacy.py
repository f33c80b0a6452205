r"""Part V: per-sample clipping and differential privacy (book/scale/per_sample_dp).

*Models and data.* :func:`small_model` is the chapter's classifier (8 inputs, 16 tanh
units, 3 classes), :func:`classification_data` a seeded batch labelled by a fixed
teacher, with some samples *corrupted* (inputs scaled up, labels redrawn) so that
their gradients are large; :func:`sequence_model` applies one ``nn.Linear`` at every
position of a sequence, the case the ghost norm has cross terms for.

*References.* :func:`loop_grads` computes per-sample gradients the plainest way, one
``torch.autograd.grad`` per sample: the float64 reference the chapter checks
:func:`gradlab.per_sample.per_sample_grads` and
:class:`gradlab.per_sample.GhostClipping` against.

*Clip or ignore.* :func:`clip_ignore_sweep` runs :func:`gradlab.per_sample.clip_per_sample_`
and :func:`gradlab.per_sample.ignore_per_sample_` over a grid of thresholds on one
batch's per-sample gradients and measures each sum against the clean samples' mean
gradient; :func:`clip_ignore_figure` draws one threshold of it.

*Accounting.* :func:`epsilon_curve` and :func:`epsilon_grid` give the
:math:`(\varepsilon, \delta)` of DP-SGD (the sampled Gaussian mechanism, composed over
steps) from Opacus's RDP accountant; :func:`epsilon_figure` draws them.

*Costs.* :func:`load_costs` reads the stored run of ``benchmarks/bench_per_sample.py``
(``per_sample_costs.json``, :mod:`gradlab_book.stored`): thread CPU time, one torch
thread, one table per model (an MLP at T = 1, a sequence model at T = 128 and 512).
:func:`ghost_costs` counts, per sample and for one Linear layer, the numbers held and the
multiply-adds of the ghost norm's Gram form and of forming the gradient, with the two
break-even points.

Compute functions return plain numbers, lists and numpy arrays; figure functions draw them.
"""

# The figures are typeset for readers: σ and ε are meant.
# ruff: noqa: RUF001

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import Tensor, nn

from gradlab.per_sample import clip_per_sample_, ignore_per_sample_
from gradlab_book import stored
from gradlab_book.plots import CLIP, IGNORE, KEEP, NONE, THRESHOLD, new_figure

__all__ = [
    "COSTS_PATH",
    "classification_data",
    "clip_ignore_figure",
    "clip_ignore_sweep",
    "epsilon_curve",
    "epsilon_figure",
    "epsilon_grid",
    "ghost_costs",
    "load_costs",
    "loop_grads",
    "loss_per_sample",
    "sequence_model",
    "small_model",
    "trained_model",
]

COSTS_PATH = stored.path("per_sample_costs.json")

D_IN, HIDDEN, CLASSES = 8, 16, 3
TEACHER_SEED = 1234


# ------------------------------------------------------------------ models and data


def small_model(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Sequential:
    """The chapter's classifier: Linear(8, 16), tanh, Linear(16, 3); 195 parameters."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))
    return model.to(dtype)


def classification_data(
    n: int,
    corrupted: Sequence[int] = (),
    scale: float = 10.0,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """``n`` samples labelled by a fixed linear teacher; ``corrupted`` ones are broken.

    The teacher is the same for every ``seed`` (the seed draws the inputs).

    A corrupted sample has its input multiplied by ``scale`` and its label replaced by
    a class the teacher does not give it, so its gradient is large and points away
    from the others'.
    """
    teacher = torch.randn(
        D_IN, CLASSES, generator=torch.Generator().manual_seed(TEACHER_SEED), dtype=torch.float64
    )
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g, dtype=torch.float64)
    y = (x @ teacher).argmax(1)
    shift = torch.randint(1, CLASSES, (n,), generator=g)
    for i in corrupted:
        x[i] *= scale
        y[i] = (y[i] + shift[i]) % CLASSES
    return x.to(dtype), y


def trained_model(steps: int = 200, lr: float = 0.5) -> nn.Sequential:
    """:func:`small_model` after ``steps`` full-batch SGD steps on 512 clean samples.

    Most samples then fit well (tiny gradients) and a mislabelled one does not.
    """
    model = small_model()
    x, y = classification_data(512, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss_per_sample(model(x), y).mean().backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    return model


class _SequenceModel(nn.Module):
    """``proj`` (a Linear) at every position, tanh, the mean over positions, ``head``."""

    def __init__(self, d_in: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, d_in)
        return self.head(torch.tanh(self.proj(x)).mean(1))


def sequence_model(
    d_in: int = 5, hidden: int = 6, classes: int = CLASSES, seed: int = 0
) -> nn.Module:
    """A seeded float64 model whose first Linear sees a sequence ``(B, T, d_in)``."""
    torch.manual_seed(seed)
    return _SequenceModel(d_in, hidden, classes).double()


def loss_per_sample(out: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy, one loss per sample (``reduction="none"``)."""
    return F.cross_entropy(out, y, reduction="none")


def loop_grads(model: nn.Module, x: Tensor, y: Tensor) -> list[Tensor]:
    """Per-sample gradients by a loop: one forward and one backward per sample.

    Returns one ``(B, *param.shape)`` tensor per trainable parameter, in
    ``model.parameters()`` order.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        loss = loss_per_sample(model(x[i : i + 1]), y[i : i + 1]).sum()
        rows.append(torch.autograd.grad(loss, params))
    return [torch.stack([r[k] for r in rows]) for k in range(len(params))]


# --------------------------------------------------------------------- clip or ignore


def _flat(grad_samples: Sequence[Tensor]) -> np.ndarray:
    batch = grad_samples[0].shape[0]
    return np.concatenate([g.detach().double().reshape(batch, -1).numpy() for g in grad_samples], 1)


def _cosine(u: np.ndarray, v: np.ndarray) -> float:
    nu, nv = np.linalg.norm(u), np.linalg.norm(v)
    if not (np.isfinite(nu) and np.isfinite(nv)) or nu == 0 or nv == 0:
        return math.nan
    return float(u @ v / (nu * nv))


def clip_ignore_sweep(
    grad_samples: Sequence[Tensor], thresholds: Sequence[float], clean: Sequence[bool]
) -> dict[str, Any]:
    """Per-sample clip and ignore at every threshold, measured against the clean mean.

    For each threshold :math:`C`, ``clip_per_sample_`` and ``ignore_per_sample_`` (sum,
    no noise) reduce the per-sample gradients into fresh ``.grad`` tensors; the result
    is compared with the mean gradient of the samples marked ``clean`` (unclipped).

    Returns a dict of numpy arrays: ``norms`` (each sample's gradient norm), ``clean``,
    ``thresholds``, and per threshold ``clipped`` (samples over :math:`C`: scaled by
    clipping, dropped by ignoring), ``clip_cos`` and ``ignore_cos`` (cosine of each sum
    with the clean mean; NaN for a zero or non-finite sum), ``clip_norm`` and
    ``ignore_norm`` (the norm of each sum).
    """
    shapes = [g.shape[1:] for g in grad_samples]
    flat = _flat(grad_samples)
    clean_mask = np.asarray(clean, dtype=bool)
    reference = flat[clean_mask].mean(0)
    out: dict[str, list[float]] = {k: [] for k in ("clip_cos", "ignore_cos", "clip_norm")}
    out.update(ignore_norm=[], clipped=[])
    norms = None
    for c in thresholds:
        sums = {}
        for name, fn in (("clip", clip_per_sample_), ("ignore", ignore_per_sample_)):
            holders = [torch.zeros(s, dtype=torch.float64) for s in shapes]
            norms = fn(holders, [g.double() for g in grad_samples], float(c))
            sums[name] = np.concatenate([h.grad.reshape(-1).numpy() for h in holders])
        for name, total in sums.items():
            out[f"{name}_cos"].append(_cosine(total, reference))
            out[f"{name}_norm"].append(float(np.linalg.norm(total)))
        out["clipped"].append(int((norms.numpy() > c).sum()))
    result: dict[str, Any] = {k: np.asarray(v) for k, v in out.items()}
    result["norms"] = np.linalg.norm(flat, axis=1)
    result["clean"] = clean_mask
    result["thresholds"] = np.asarray(thresholds, dtype=float)
    return result


def clip_ignore_figure(max_norm: float, sweep: dict[str, Any]) -> Figure:
    """Left: every sample's gradient norm against ``max_norm``. Right: each sum's
    cosine with the clean samples' mean gradient, over all thresholds."""
    fig = new_figure(9.0, 3.6)
    left, right = fig.subplots(1, 2)
    norms, clean = sweep["norms"], sweep["clean"]
    order = np.argsort(norms)
    rank = np.arange(len(norms))
    over = norms[order] > max_norm
    for mask, marker, label in ((clean[order], "o", "clean"), (~clean[order], "X", "corrupted")):
        for sel, colour in ((mask & ~over, KEEP), (mask & over, CLIP)):
            if sel.any():
                left.scatter(rank[sel], norms[order][sel], marker=marker, color=colour, s=22)
        left.scatter([], [], marker=marker, color="#555555", s=22, label=label)
    left.axhline(max_norm, color=THRESHOLD, lw=1.2, ls="--", label=f"C = {max_norm:g}")
    left.set_yscale("log")
    left.set_xlabel("samples, by gradient norm")
    left.set_ylabel(r"$\|g_i\|_2$")
    n_over = int((norms > max_norm).sum())
    left.set_title(f"{n_over} of {len(norms)} samples over C (orange)", fontsize=10)
    left.legend(loc="upper left", fontsize=8)

    c = sweep["thresholds"]
    right.plot(c, sweep["clip_cos"], color=CLIP, marker="o", ms=3, label="clip per sample")
    right.plot(
        c, sweep["ignore_cos"], color=IGNORE, marker="s", ms=3, ls="--", label="ignore per sample"
    )
    right.axvline(max_norm, color=THRESHOLD, lw=1.0, ls=":")
    k = int(np.argmin(np.abs(c - max_norm)))
    for key, colour in (("clip_cos", CLIP), ("ignore_cos", IGNORE)):
        if np.isfinite(sweep[key][k]):
            right.scatter([c[k]], [sweep[key][k]], color=colour, s=50, zorder=3)
    right.set_xscale("log")
    right.set_ylim(-1.05, 1.05)
    right.set_xlabel("threshold C")
    right.set_ylabel("cosine with the clean mean")
    ign = sweep["ignore_cos"][k]
    ign_text = "nothing kept" if not np.isfinite(ign) else f"{ign:.2f}"
    right.set_title(f"clip {sweep['clip_cos'][k]:.2f}, ignore {ign_text}", fontsize=10)
    right.legend(loc="lower left", fontsize=8)
    return fig


# ------------------------------------------------------------------------ accounting


def epsilon_curve(
    noise_multiplier: float, sample_rate: float, steps: Sequence[int], delta: float
) -> np.ndarray:
    r"""The :math:`\varepsilon` of DP-SGD after each number of ``steps``, from Opacus.

    RDP composes additively, so Opacus's ``RDPAccountant`` computes
    ``compute_rdp(q, sigma, steps=n)`` as ``n`` times the one-step RDP at every order
    and converts to :math:`(\varepsilon, \delta)` with ``get_privacy_spent``; this
    function makes the same two calls of ``opacus.accountants.analysis.rdp``, with the
    accountant's default orders, computing the one-step RDP once for all ``steps``.
    """
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp as analysis

    orders = RDPAccountant.DEFAULT_ALPHAS
    one = np.asarray(
        analysis.compute_rdp(
            q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=orders
        )
    )
    eps = []
    with warnings.catch_warnings():
        # "Optimal order is the smallest/largest alpha": only where epsilon is far
        # outside any useful range (hundreds) or tiny; the value is still an upper bound.
        warnings.filterwarnings("ignore", message="Optimal order")
        for n in steps:
            value, _ = analysis.get_privacy_spent(orders=orders, rdp=one * int(n), delta=delta)
            eps.append(float(value))
    return np.asarray(eps)


def epsilon_grid(
    noise_multipliers: Sequence[float],
    sample_rates: Sequence[float],
    steps: Sequence[int],
    delta: float,
) -> dict[tuple[float, float], np.ndarray]:
    """:func:`epsilon_curve` for every pair of noise multiplier and sample rate."""
    return {
        (s, q): epsilon_curve(s, q, steps, delta) for s in noise_multipliers for q in sample_rates
    }


def epsilon_figure(
    noise_multiplier: float,
    sample_rate: float,
    grid: dict[tuple[float, float], np.ndarray],
    steps: Sequence[int],
    delta: float,
    mark: int,
) -> Figure:
    """Epsilon against the number of steps for one (sigma, q), the other sigmas faded.

    ``mark`` is marked on the curve and its epsilon given in the title. A pair
    (``noise_multiplier``, ``sample_rate``) that ``grid`` lacks, or a ``mark`` that is
    not one of ``steps``, is computed here with :func:`epsilon_curve` (the explorable's
    precomputed grid holds only its sliders' values).
    """
    fig = new_figure(6.4, 3.8)
    ax = fig.subplots()
    steps = np.asarray(steps)
    for (s, q), eps in sorted(grid.items()):
        if q != sample_rate or s == noise_multiplier:
            continue
        ax.plot(steps, eps, color=NONE, lw=0.8, alpha=0.5)
        ax.annotate(f"σ={s:g}", (steps[-1], eps[-1]), fontsize=7, color=NONE, va="center")
    key = (noise_multiplier, sample_rate)
    eps = grid[key] if key in grid else epsilon_curve(noise_multiplier, sample_rate, steps, delta)
    ax.plot(steps, eps, color=KEEP, lw=2.2, label=f"σ = {noise_multiplier:g}, q = {sample_rate:g}")
    if mark in list(steps):
        at = float(eps[list(steps).index(mark)])
    else:
        at = float(epsilon_curve(noise_multiplier, sample_rate, [mark], delta)[0])
    ax.scatter([mark], [at], color=KEEP, s=40, zorder=3)
    for level in (1.0, 8.0):
        ax.axhline(level, color=THRESHOLD, lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(1e-2, 1e3)
    ax.set_xlabel("steps")
    ax.set_ylabel(f"ε at δ = {delta:g}")
    ax.set_title(f"after {mark:,} steps: ε = {at:.3g}", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    return fig


# ----------------------------------------------------------------------------- costs


def load_costs(path: Path = COSTS_PATH) -> dict[str, Any]:
    """The stored benchmark run: its settings, the machine, and per model (``tables``)
    one row per method."""
    with open(path) as f:
        return json.load(f)


def ghost_costs(d_in: int, d_out: int, seq_len: int) -> dict[str, float]:
    r"""Per sample, for one Linear layer seeing ``seq_len`` positions: the Gram form
    against forming the weight gradient.

    The Gram form of the ghost norm holds two :math:`T \times T` matrices and costs
    :math:`T^2 (d_\text{in} + d_\text{out})` multiply-adds; forming
    :math:`\sum_t g_t a_t^\top` holds :math:`d_\text{in} d_\text{out}` numbers and costs
    :math:`T d_\text{in} d_\text{out}`. They hold as many numbers at
    :math:`2T^2 = d_\text{in} d_\text{out}` (the memory break-even) and cost as much at
    :math:`T (d_\text{in} + d_\text{out}) = d_\text{in} d_\text{out}`.

    Returns:
        dict: ``gram_numbers``, ``gram_madds``, ``formed_numbers``, ``formed_madds``,
        ``memory_break_even_T`` (:math:`\sqrt{d_\text{in} d_\text{out} / 2}`) and
        ``time_break_even_T`` (:math:`d_\text{in} d_\text{out} / (d_\text{in} +
        d_\text{out})`), as floats.
    """
    for name, v in (("d_in", d_in), ("d_out", d_out), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    t, p = float(seq_len), float(d_in) * float(d_out)
    return {
        "gram_numbers": 2 * t * t,
        "gram_madds": t * t * (d_in + d_out),
        "formed_numbers": p,
        "formed_madds": t * p,
        "memory_break_even_T": math.sqrt(p / 2),
        "time_break_even_T": p / (d_in + d_out),
    }
