r"""What clipping and ignoring cost, counted and timed (taught in book/training/costs).

Two kinds of numbers:

* **counts**, which are exact and the same on every machine: how many ATen operators
  a call dispatches, how many tensors those operators touch, and how many times a
  value is read back on the host (:func:`gradlab.sync.is_read_op`), all seen through a
  :class:`~torch.utils._python_dispatch.TorchDispatchMode`;
* **timings**, which depend on the machine: taken with :mod:`gradlab_book.benchmark`
  (median of repeats, after a warm-up, every implementation interleaved with the
  others).

The cost model joins them:

.. math::
    t_\text{call} \approx c_\text{op}\,K + c_\text{tensor}\,V + \frac{B}{\beta} + c_\text{sync}\,S,

with :math:`K` operator calls, :math:`V` tensor visits, :math:`B` bytes moved,
bandwidth :math:`\beta` and :math:`S` host reads. :func:`fit_cost_model` estimates
the constants from timings by non-negative least squares.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from matplotlib.figure import Figure
from torch.utils._python_dispatch import TorchDispatchMode

import gradlab
from gradlab.sync import is_read_op
from gradlab_book.benchmark import (
    floor_norm,
    loop_ignore_norm_,
    loop_ignore_value_,
    make_parameters,
    time_calls,
)
from gradlab_book.plots import CLIP, IGNORE, KEEP, NONE, THRESHOLD, new_figure

__all__ = [
    "IMPLEMENTATIONS",
    "PASSES",
    "PASS_KINDS",
    "CostModel",
    "OpCount",
    "Sweep",
    "count_ops",
    "count_table",
    "fit_cost_model",
    "fit_report",
    "foreach_figure",
    "model_check_figure",
    "overhead_figure",
    "predict",
    "sweep_figure",
    "time_sweep",
]


# A threshold far above any gradient in these measurements: every call keeps the
# gradients as they are, so each repeat does the same work.
_HUGE = 1e30

#: What each timed implementation runs on a list of parameters.
IMPLEMENTATIONS: dict[str, Callable[[list[torch.Tensor]], object]] = {
    "reference loop, ignore norm": lambda ps: loop_ignore_norm_(ps, _HUGE),
    "reference loop, ignore value": lambda ps: loop_ignore_value_(ps, _HUGE),
    "gradlab ignore norm, foreach=False": lambda ps: gradlab.grad_ignore_norm_(
        ps, _HUGE, foreach=False
    ),
    "gradlab ignore norm, foreach=True": lambda ps: gradlab.grad_ignore_norm_(
        ps, _HUGE, foreach=True
    ),
    "gradlab clip norm, foreach=False": lambda ps: gradlab.clip_grad_norm_(
        ps, _HUGE, foreach=False
    ),
    "gradlab clip norm, foreach=True": lambda ps: gradlab.clip_grad_norm_(ps, _HUGE, foreach=True),
    "torch clip norm, foreach=False": lambda ps: torch.nn.utils.clip_grad_norm_(
        ps, _HUGE, foreach=False
    ),
    "torch clip norm, foreach=True": lambda ps: torch.nn.utils.clip_grad_norm_(
        ps, _HUGE, foreach=True
    ),
}

#: Passes over the gradient memory per call, by reading the code: a norm reads every
#: entry once; an in-place multiply or select reads and writes it (2); the reference
#: value loop makes ``abs()`` (read, write a copy) then ``max()`` (read) = 3.
PASSES: dict[str, int] = {
    "floor (one norm over a flat tensor)": 1,
    "reference loop, ignore norm": 1,
    "reference loop, ignore value": 3,
    "gradlab ignore norm, foreach=False": 3,
    "gradlab ignore norm, foreach=True": 3,
    "gradlab clip norm, foreach=False": 3,
    "gradlab clip norm, foreach=True": 3,
    "torch clip norm, foreach=False": 3,
    "torch clip norm, foreach=True": 3,
}

FLOOR = "floor (one norm over a flat tensor)"

COLOURS = {
    FLOOR: THRESHOLD,
    "reference loop, ignore norm": NONE,
    "reference loop, ignore value": NONE,
    "gradlab ignore norm, foreach=False": IGNORE,
    "gradlab ignore norm, foreach=True": IGNORE,
    "gradlab clip norm, foreach=False": CLIP,
    "gradlab clip norm, foreach=True": CLIP,
    "torch clip norm, foreach=False": KEEP,
    "torch clip norm, foreach=True": KEEP,
}


def _style(name: str) -> str:
    if name == FLOOR:
        return ":"
    if name.startswith("reference"):
        return "-." if "value" in name else "-"
    return "--" if name.endswith("foreach=False") else "-"


# -------------------------------------------------------------------------- counts


@dataclass
class OpCount:
    """What one call dispatched: operators, tensors they touched, host reads."""

    ops: int = 0
    tensor_visits: int = 0
    host_reads: int = 0
    by_op: Counter = field(default_factory=Counter)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = OpCount()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.count.ops += 1
        self.count.by_op[func.__name__] += 1
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, torch.Tensor):
                self.count.tensor_visits += 1
            elif isinstance(arg, list | tuple):
                self.count.tensor_visits += sum(isinstance(a, torch.Tensor) for a in arg)
        if is_read_op(func, args):
            self.count.host_reads += 1
        return func(*args, **kwargs)


def count_ops(fn: Callable[[], object]) -> OpCount:
    """Run ``fn()`` once and count what it dispatched (every device, CPU included)."""
    counter = _OpCounter()
    with counter:
        fn()
    return counter.count


def count_table(
    n_tensors: Sequence[int],
    n_elements: int,
    implementations: dict[str, Callable] | None = None,
) -> dict[str, list[OpCount]]:
    """:func:`count_ops` of every implementation at every number of tensors."""
    implementations = IMPLEMENTATIONS if implementations is None else implementations
    table: dict[str, list[OpCount]] = {name: [] for name in implementations}
    for n in n_tensors:
        params = make_parameters(n, n_elements)
        for name, fn in implementations.items():
            table[name].append(count_ops(lambda fn=fn, params=params: fn(params)))
    return table


# ------------------------------------------------------------------------- timings


@dataclass
class Sweep:
    """Median times (seconds) of each implementation as the number of tensors grows."""

    n_tensors: np.ndarray
    n_elements: int
    times: dict[str, np.ndarray]
    counts: dict[str, list[OpCount]]


def time_sweep(
    n_tensors: Sequence[int],
    n_elements: int,
    repeats: int = 5,
    warmup: int = 1,
    implementations: dict[str, Callable] | None = None,
) -> Sweep:
    """Time every implementation, and the one-pass floor, at each number of tensors.

    The floor is :func:`gradlab_book.benchmark.floor_norm` on one flat tensor holding all
    ``n_elements`` numbers: the least any total-norm computation can cost. At each
    number of tensors the floor and the implementations are timed interleaved
    (:func:`gradlab_book.benchmark.time_calls`, median of ``repeats`` rounds), so that
    whatever else the machine is doing slows them alike and the ratios stay fair.
    """
    implementations = IMPLEMENTATIONS if implementations is None else implementations
    times: dict[str, list[float]] = {FLOOR: [], **{name: [] for name in implementations}}
    flat = make_parameters(1, n_elements)[0].grad
    for n in n_tensors:
        params = make_parameters(n, n_elements)
        calls: dict[str, Callable[[], object]] = {FLOOR: lambda: floor_norm(flat)}
        for name, fn in implementations.items():
            calls[name] = lambda fn=fn, params=params: fn(params)
        for name, seconds in time_calls(calls, repeats=repeats, warmup=warmup).items():
            times[name].append(seconds)
    counts = count_table(n_tensors, n_elements, implementations)
    counts[FLOOR] = [count_ops(lambda: floor_norm(flat)) for _ in n_tensors]
    return Sweep(
        n_tensors=np.asarray(n_tensors),
        n_elements=int(n_elements),
        times={k: np.asarray(v) for k, v in times.items()},
        counts=counts,
    )


# ---------------------------------------------------------------------- cost model


#: The passes of :data:`PASSES` split by operator type, (reduction, elementwise): a
#: reduction (a norm, a max) reads every entry once; an elementwise pass (``mul_``,
#: the select, ``abs``) reads and writes it, counted as 2 passes as in ``PASSES``.
PASS_KINDS: dict[str, tuple[int, int]] = {
    "floor (one norm over a flat tensor)": (1, 0),
    "reference loop, ignore norm": (1, 0),
    "reference loop, ignore value": (1, 2),
    "gradlab ignore norm, foreach=False": (1, 2),
    "gradlab ignore norm, foreach=True": (1, 2),
    "gradlab clip norm, foreach=False": (1, 2),
    "gradlab clip norm, foreach=True": (1, 2),
    "torch clip norm, foreach=False": (1, 2),
    "torch clip norm, foreach=True": (1, 2),
}


@dataclass(frozen=True)
class CostModel:
    """``t_call = c_op K + c_tensor V + bytes / bandwidth`` (seconds, bytes/s).

    With ``elementwise_seconds_per_byte`` set (a fit ``by_kind``), the bytes are split
    by operator type: ``seconds_per_byte`` prices the bytes of reductions and
    ``elementwise_seconds_per_byte`` those of elementwise passes (:data:`PASS_KINDS`).
    """

    c_op: float
    c_tensor: float
    seconds_per_byte: float
    elementwise_seconds_per_byte: float | None = None

    @property
    def bandwidth(self) -> float:
        return math.inf if self.seconds_per_byte <= 0 else 1.0 / self.seconds_per_byte

    @property
    def elementwise_bandwidth(self) -> float | None:
        per_byte = self.elementwise_seconds_per_byte
        if per_byte is None:
            return None
        return math.inf if per_byte <= 0 else 1.0 / per_byte


def _features(sweep: Sweep, name: str, by_kind: bool = False) -> np.ndarray:
    if by_kind:
        reduction, elementwise = PASS_KINDS.get(name, (PASSES.get(name, 1), 0))
        moved = [reduction * 4 * sweep.n_elements, elementwise * 4 * sweep.n_elements]
    else:
        moved = [PASSES.get(name, 1) * 4 * sweep.n_elements]
    return np.array([[c.ops, c.tensor_visits, *moved] for c in sweep.counts[name]], dtype=float)


def _nnls(a: np.ndarray, b: np.ndarray, iterations: int = 200) -> np.ndarray:
    """Non-negative least squares by projected coordinate descent (small problems)."""
    x = np.zeros(a.shape[1])
    norms = (a**2).sum(0)
    for _ in range(iterations):
        for j in range(a.shape[1]):
            if norms[j] == 0:
                continue
            residual = b - a @ x + a[:, j] * x[j]
            x[j] = max(0.0, float(a[:, j] @ residual) / norms[j])
    return x


def fit_cost_model(
    sweep: Sweep, names: Sequence[str] | None = None, by_kind: bool = False
) -> CostModel:
    """Fit the constants to the sweep's timings, weighting every point by 1/T.

    Relative errors are what matter across four orders of magnitude, so each
    equation is divided by its measured time before the fit. ``by_kind``: fit one
    price per byte for reductions and one for elementwise passes.
    """
    names = list(sweep.times) if names is None else list(names)
    rows, targets = [], []
    for name in names:
        feats = _features(sweep, name, by_kind)
        for f, t in zip(feats, sweep.times[name], strict=True):
            if t > 0 and math.isfinite(t):
                rows.append(f / t)
                targets.append(1.0)
    if not rows:
        return CostModel(0.0, 0.0, 0.0, 0.0 if by_kind else None)
    a, b = np.array(rows), np.array(targets)
    scale = np.where(a.max(0) > 0, a.max(0), 1.0)
    x = _nnls(a / scale, b) / scale
    elementwise = float(x[3]) if by_kind else None
    return CostModel(float(x[0]), float(x[1]), float(x[2]), elementwise)


def predict(model: CostModel, sweep: Sweep, name: str) -> np.ndarray:
    """The model's time (seconds) for ``name`` at each point of the sweep."""
    coef = [model.c_op, model.c_tensor, model.seconds_per_byte]
    by_kind = model.elementwise_seconds_per_byte is not None
    if by_kind:
        coef.append(model.elementwise_seconds_per_byte)
    return _features(sweep, name, by_kind) @ np.array(coef)


def fit_report(sweep: Sweep, models: dict[str, CostModel]) -> str:
    """Each fit's constants, its share of points within a factor 2, and its bias on
    the floor (predicted over measured time of the one-pass floor, median over the
    sweep), beside the bandwidth the floor itself implies (4N bytes / its time)."""
    floor = sweep.times[FLOOR]
    implied = 4 * sweep.n_elements / float(np.median(floor))
    lines = [f"bandwidth implied by the floor: {implied / 1e9:.2g} GB/s"]
    for label, model in models.items():
        within = []
        for name, measured in sweep.times.items():
            error = np.log2(predict(model, sweep, name) / measured)
            within.append(float(np.mean(np.abs(error) <= 1)))
        bias = float(np.median(predict(model, sweep, FLOOR) / floor))
        beta = f"{model.bandwidth / 1e9:.2g} GB/s"
        if model.elementwise_bandwidth is not None:
            beta = f"reductions {beta}, elementwise {model.elementwise_bandwidth / 1e9:.2g} GB/s"
        lines += [
            f"{label}:",
            f"  c_op {model.c_op * 1e6:.2g} us, c_tensor {model.c_tensor * 1e6:.2g} us",
            f"  beta: {beta}",
            f"  within a factor 2: {100 * np.mean(within):.0f}% of the points; "
            f"floor predicted / measured: {bias:.2f}",
        ]
    return "\n".join(lines)


# ------------------------------------------------------------------------- figures


def overhead_figure(sweep: Sweep, names: Sequence[str] | None = None) -> Figure:
    """Time over the one-pass floor, as the same numbers are split into more tensors."""
    names = [n for n in (names or sweep.times) if n != FLOOR]
    fig = new_figure(6.4, 3.4)
    ax = fig.subplots()
    floor = sweep.times[FLOOR]
    for name in names:
        ratio = sweep.times[name] / np.where(floor > 0, floor, np.nan)
        ax.plot(
            sweep.n_tensors,
            ratio,
            _style(name),
            marker="o",
            ms=3,
            color=COLOURS.get(name, NONE),
            label=name,
        )
    ax.axhline(1.0, color=THRESHOLD, lw=1, ls=":", label="the floor")
    if len(sweep.n_tensors) and sweep.n_tensors.min() > 0:
        ax.set_xscale("log")
        ax.set_xlim(sweep.n_tensors.min() / 1.5, sweep.n_tensors.max() * 1.5)
    ax.set_yscale("log")
    ax.set_xlabel(f"number of tensors ({sweep.n_elements:,} numbers in all)")
    ax.set_ylabel("time / one-pass floor")
    ax.legend(fontsize=6.5, loc="upper left")
    return fig


def foreach_figure(sweep: Sweep) -> Figure:
    """foreach=True over foreach=False, for gradlab's and torch's functions."""
    fig = new_figure(6.4, 3.0)
    ax = fig.subplots()
    pairs = [
        ("gradlab ignore norm", IGNORE),
        ("gradlab clip norm", CLIP),
        ("torch clip norm", KEEP),
    ]
    for stem, colour in pairs:
        on, off = (
            sweep.times.get(f"{stem}, foreach=True"),
            sweep.times.get(f"{stem}, foreach=False"),
        )
        if on is None or off is None:
            continue
        ax.plot(
            sweep.n_tensors,
            on / np.where(off > 0, off, np.nan),
            marker="o",
            ms=3,
            color=colour,
            label=stem,
        )
    ax.axhline(1.0, color=THRESHOLD, lw=1, ls=":")
    if len(sweep.n_tensors) and sweep.n_tensors.min() > 0:
        ax.set_xscale("log")
        ax.set_xlim(sweep.n_tensors.min() / 1.5, sweep.n_tensors.max() * 1.5)
    ax.set_xlabel("number of tensors")
    ax.set_ylabel("time with foreach / without")
    ax.legend(fontsize=7)
    return fig


def model_check_figure(sweep: Sweep, model: CostModel) -> Figure:
    """Measured time against the cost model's prediction, every point of the sweep."""
    fig = new_figure(4.8, 3.6)
    ax = fig.subplots()
    lo, hi = math.inf, 0.0
    for name, measured in sweep.times.items():
        predicted = predict(model, sweep, name)
        ax.scatter(
            predicted * 1e3,
            measured * 1e3,
            s=12,
            color=COLOURS.get(name, NONE),
            marker="s" if name.endswith("False") else "o",
            label=name,
        )
        good = (predicted > 0) & (measured > 0)
        if good.any():
            lo = min(lo, predicted[good].min(), measured[good].min())
            hi = max(hi, predicted[good].max(), measured[good].max())
    if hi > 0 and math.isfinite(lo):
        line = np.array([lo, hi]) * 1e3
        ax.plot(line, line, color=THRESHOLD, lw=1, ls=":")
        ax.plot(line, 2 * line, color=NONE, lw=0.6, ls=":")
        ax.plot(line, line / 2, color=NONE, lw=0.6, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("predicted (ms)")
    ax.set_ylabel("measured (ms)")
    ax.legend(fontsize=5.5, loc="upper left")
    return fig


def sweep_figure(n_tensors: int, sweep: Sweep) -> Figure:
    """Every implementation's time at one number of tensors, with the floor drawn."""
    matches = np.flatnonzero(sweep.n_tensors == n_tensors)
    fig = new_figure(6.4, 3.4)
    ax = fig.subplots()
    if matches.size == 0:
        ax.text(
            0.5, 0.5, f"no measurement at {n_tensors} tensors", ha="center", transform=ax.transAxes
        )
        return fig
    i = int(matches[0])
    names = [n for n in sweep.times if n != FLOOR]
    values = [sweep.times[n][i] * 1e3 for n in names]
    floor = sweep.times[FLOOR][i] * 1e3
    y = np.arange(len(names))
    ax.barh(y, values, color=[COLOURS.get(n, NONE) for n in names], hatch=None, alpha=0.85)
    for yi, name, v in zip(y, names, values, strict=True):
        reads = sweep.counts[name][i].host_reads
        note = f"{v / floor:.3g}x floor" if floor > 0 else ""
        if reads:
            note += f", {reads} host read{'s' if reads > 1 else ''}"
        ax.text(v, yi, " " + note, va="center", fontsize=6.5)
    ax.axvline(floor, color=THRESHOLD, lw=1, ls=":", label=f"one-pass floor {floor:.3g} ms")
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    shown = np.array([*values, floor], dtype=float)
    shown = shown[np.isfinite(shown) & (shown > 0)]
    if shown.size:
        ax.set_xscale("log")
        ax.set_xlim(shown.min() / 2, shown.max() * 30)
    ax.set_xlabel("median time per call (ms, log scale)")
    ax.set_title(f"{n_tensors} tensors, {sweep.n_elements:,} numbers in all", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    return fig


def ratio_table(sweep: Sweep) -> str:
    """Each implementation's median time over the floor's, at each number of tensors,
    the floor's own time, and the range of the ratios at the fewest and most tensors."""
    floor = sweep.times[FLOOR]
    sizes = [int(k) for k in sweep.n_tensors]
    lines = [f"{'time / floor':36}" + "".join(f"{k:>6}" for k in sizes)]
    for name, t in sweep.times.items():
        lines.append(f"{name[:36]:36}" + "".join(f"{r:>6.3g}" for r in t / floor))
    lines.append(f"{'floor itself (ms)':36}" + "".join(f"{1e3 * t:>6.3g}" for t in floor))
    ratios = np.array([t / floor for name, t in sweep.times.items() if name != FLOOR])
    for i in (0, len(sizes) - 1):
        low, high = ratios[:, i].min(), ratios[:, i].max()
        lines.append(f"at {sizes[i]} tensor(s): {low:.2g} to {high:.2g} times the floor")
    return "\n".join(lines)


def sync_free_cost(sweep: Sweep) -> dict[str, np.ndarray]:
    """Time of gradlab's sync-free ignore over the branching reference loop's, on a
    healthy step (nothing ignored), at each number of tensors: what never reading the
    host costs where a host read is cheap (a CPU)."""
    loop = sweep.times["reference loop, ignore norm"]
    return {
        f"foreach={flag}": sweep.times[f"gradlab ignore norm, foreach={flag}"] / loop
        for flag in (False, True)
    }
