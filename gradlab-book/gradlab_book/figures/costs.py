r"""What clipping and ignoring cost, counted and timed (taught in book/training/costs).

Two kinds of numbers:

* **counts**, which are exact and the same on every machine: how many ATen operators
  a call dispatches, how many tensors those operators touch, and how many times a
  value is read back on the host (:func:`gradlab.sync.is_read_op`), all seen through a
  :class:`~torch.utils._python_dispatch.TorchDispatchMode`; computed live;
* **timings**, which depend on the machine: never taken here. They are read from the
  JSON that ``benchmarks/bench_clip.py`` and ``benchmarks/bench_flat.py`` wrote with
  ``--json`` into the book's stored data (:func:`load_bench`), measured by the
  benchmarks' one harness (``benchmarks/harness.py``: thread CPU time, one torch
  thread, interleaved rounds), with the machine they ran on named in the file.

The cost model joins them:

.. math::
    t_\text{call} \approx c_\text{op}\,K + c_\text{tensor}\,V + \frac{B}{\beta} + c_\text{sync}\,S,

with :math:`K` operator calls, :math:`V` tensor visits, :math:`B` bytes moved,
bandwidth :math:`\beta` and :math:`S` host reads. :func:`fit_cost_model` estimates
the constants from the stored timings by non-negative least squares.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch.utils._python_dispatch import TorchDispatchMode

from gradlab.sync import is_read_op
from gradlab_book import stored
from gradlab_book.benchmark import IMPLEMENTATIONS, make_parameters
from gradlab_book.plots import CLIP, IGNORE, KEEP, NONE, THRESHOLD, new_figure

__all__ = [
    "BENCH_CLIP",
    "BENCH_FLAT",
    "FLAT_FAMILIES",
    "FLAT_SETS",
    "FLOOR",
    "IMPLEMENTATIONS",
    "PASSES",
    "PASS_KINDS",
    "Bench",
    "CostModel",
    "OpCount",
    "Sweep",
    "clip_sweep",
    "count_ops",
    "count_table",
    "fit_cost_model",
    "fit_report",
    "flat_report",
    "flat_times",
    "foreach_figure",
    "load_bench",
    "model_check_figure",
    "overhead_figure",
    "per_tensor_cost",
    "predict",
    "ratio_table",
    "sweep_figure",
    "sync_free_cost",
    "tensor_count_figure",
]

#: The stored output of ``benchmarks/bench_clip.py --json``.
BENCH_CLIP = "bench_clip.json"
#: The stored output of ``benchmarks/bench_flat.py --json``.
BENCH_FLAT = "bench_flat.json"

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

#: Shorter names for the printed tables, which must fit 80 columns.
_SHORT = {
    FLOOR: "floor (one norm, one tensor)",
    "reference loop, ignore norm": "reference loop, ignore norm",
    "reference loop, ignore value": "reference loop, ignore value",
    "gradlab ignore norm, foreach=False": "gradlab ignore, foreach=False",
    "gradlab ignore norm, foreach=True": "gradlab ignore, foreach=True",
    "gradlab clip norm, foreach=False": "gradlab clip, foreach=False",
    "gradlab clip norm, foreach=True": "gradlab clip, foreach=True",
    "torch clip norm, foreach=False": "torch clip, foreach=False",
    "torch clip norm, foreach=True": "torch clip, foreach=True",
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
    """:func:`count_ops` of every implementation at every number of tensors.

    Each implementation is called once first, on two tiny parameters, so that what it
    does only once (gradlab keeps the tensor form of a threshold it has seen) is not
    counted: the counts are those of every later call, a training step's.
    """
    implementations = IMPLEMENTATIONS if implementations is None else implementations
    for fn in implementations.values():
        fn(make_parameters(2, 2))
    table: dict[str, list[OpCount]] = {name: [] for name in implementations}
    for n in n_tensors:
        params = make_parameters(n, n_elements)
        for name, fn in implementations.items():
            table[name].append(count_ops(lambda fn=fn, params=params: fn(params)))
    return table


# ------------------------------------------------------------------ stored timings


@dataclass(frozen=True)
class Bench:
    """One benchmark's stored JSON: its settings and its tables of rows.

    Each row is a dict as ``benchmarks/harness.py`` writes it: ``name``, ``min_us`` and
    ``median_us`` (thread CPU microseconds per call: the fastest and the median block
    of the rounds), ``ratio_min`` and ``ratio_paired`` (to the table's baseline) and
    ``note``.
    """

    settings: dict[str, Any]
    tables: dict[str, list[dict[str, Any]]]

    def row(self, table: str, name: str) -> dict[str, Any]:
        """The row ``name`` of ``table``.

        Raises:
            KeyError: naming what is missing.
        """
        rows = self.tables.get(table)
        if rows is None:
            raise KeyError(f"no table {table!r} in the stored benchmark")
        for r in rows:
            if r["name"] == name:
                return r
        raise KeyError(f"no row {name!r} in table {table!r}")

    def min_us(self, table: str, name: str) -> float:
        """The fastest block's time per call of ``name`` in ``table``, in µs."""
        return float(self.row(table, name)["min_us"])

    @property
    def machine(self) -> str:
        """The machine, the torch and the clock the tables were measured with."""
        s = self.settings
        return (
            f"{s.get('machine', 'machine not recorded')}; torch {s.get('torch', '?')}; "
            f"{s.get('clock', 'clock not recorded')}, {s.get('rounds', '?')} rounds"
        )


def load_bench(name: str) -> Bench:
    """The stored JSON of a benchmark (:data:`BENCH_CLIP` or :data:`BENCH_FLAT`).

    Args:
        name (str): the file's name in the book's stored data.

    Returns:
        Bench: its settings and tables.

    Raises:
        FileNotFoundError: if the file was never written.
        ValueError: if it is not a benchmark's JSON (no ``settings`` or ``tables``).
    """
    path = stored.path(name)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: write it with benchmarks/bench_clip.py or "
            f"benchmarks/bench_flat.py --json {path}"
        )
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not {"settings", "tables"} <= set(data):
        raise ValueError(f"{name} is not a benchmark's JSON (no 'settings' and 'tables')")
    return Bench(settings=dict(data["settings"]), tables=dict(data["tables"]))


@dataclass
class Sweep:
    """Times (seconds) of each implementation as the number of tensors grows.

    ``times`` are the stored minima (the fastest block of the rounds) of
    ``benchmarks/bench_clip.py``'s sweep, ``counts`` the exact counts of this machine,
    ``floor_sum`` the time of one ``sum()`` over the flat tensor beside the floor.
    """

    n_tensors: np.ndarray
    n_elements: int
    times: dict[str, np.ndarray]
    counts: dict[str, list[OpCount]]
    floor_sum: np.ndarray | None = None


def clip_sweep(bench: Bench, *, counts: bool = True) -> Sweep:
    """The sweep of ``bench_clip.json`` (1M floats in k tensors) as a :class:`Sweep`.

    Args:
        bench (Bench): :func:`load_bench` of :data:`BENCH_CLIP`.
        counts (bool): count every implementation's operators at every k (live,
            exact). Default: True

    Returns:
        Sweep: the stored minima in seconds, the floor's under :data:`FLOOR`.

    Raises:
        ValueError: if the file holds no sweep.
    """
    sizes = sorted(int(t.split("=")[1]) for t in bench.tables if t.startswith("sweep k="))
    if not sizes:
        raise ValueError("the stored benchmark holds no sweep (tables 'sweep k=...')")
    n_elements = int(bench.settings.get("sweep_elements", 1_000_000))
    times: dict[str, np.ndarray] = {}
    for name, stored_name in [(FLOOR, "floor_norm"), *((n, n) for n in IMPLEMENTATIONS)]:
        us = [bench.min_us(f"sweep k={k}", stored_name) for k in sizes]
        times[name] = np.asarray(us) * 1e-6
    floor_sum = np.asarray([bench.min_us(f"sweep k={k}", "floor_sum") for k in sizes]) * 1e-6
    table: dict[str, list[OpCount]] = {}
    if counts:
        flat = make_parameters(1, n_elements)[0].grad
        table = count_table(sizes, n_elements)
        table[FLOOR] = [count_ops(lambda: torch.linalg.vector_norm(flat)) for _ in sizes]
    return Sweep(np.asarray(sizes), n_elements, times, table, floor_sum)


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


def _bias_words(bias: float) -> str:
    if bias < 0.95:
        return "it under-predicts the floor"
    if bias > 1.05:
        return "it over-predicts the floor"
    return "within 5% of the floor"


def fit_report(sweep: Sweep, models: dict[str, CostModel]) -> str:
    """Each fit's constants, its share of points within a factor 2, and its bias on
    the floor (predicted over measured time of the one-pass floor, median over the
    sweep, with the direction in words), beside the bandwidth the floor itself implies
    (4N bytes / its time)."""
    floor = sweep.times[FLOOR]
    implied = 4 * sweep.n_elements / float(np.median(floor))
    lines = [f"bandwidth implied by the floor: {implied / 1e9:.2g} GB/s"]
    for label, model in models.items():
        within = []
        with np.errstate(divide="ignore", invalid="ignore"):  # a zero prediction: not within
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
            f"  within a factor 2: {100 * np.mean(within):.0f}% of the points",
            f"  floor predicted / measured: {bias:.2f} ({_bias_words(bias)})",
        ]
    return "\n".join(lines)


def ratio_table(sweep: Sweep) -> str:
    """Each implementation's time over the floor's, at each number of tensors, the
    floor's own time, and the range of the ratios at the fewest and most tensors."""
    floor = sweep.times[FLOOR]
    sizes = [int(k) for k in sweep.n_tensors]
    lines = [f"{'time / floor':30}" + "".join(f"{k:>6}" for k in sizes)]
    for name, t in sweep.times.items():
        lines.append(f"{_SHORT.get(name, name)[:30]:30}" + "".join(f"{r:>6.3g}" for r in t / floor))
    lines.append(f"{'floor itself (ms)':30}" + "".join(f"{1e3 * t:>6.2g}" for t in floor))
    if sweep.floor_sum is not None:
        share = sweep.floor_sum / floor
        lines.append(f"{'one sum() / floor':30}" + "".join(f"{r:>6.2g}" for r in share))
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


# ---------------------------------------------------------------- flat gradients


#: The sets of ``bench_flat.json`` at 1M floats, by label -> number of tensors.
FLAT_SETS: dict[str, int] = {"k=10": 10, "k=100": 100, "k=1000": 1000, "k=3000": 3000}
#: Its set of few large tensors (10 of 3M floats).
FLAT_LARGE = "10 large (30M)"
#: family -> (its own floor in bench_flat, what that floor runs).
FLAT_FAMILIES: dict[str, tuple[str, str]] = {
    "norm": ("floor_norm", "one norm"),
    "clip": ("floor_clip", "norm + mul_"),
    "ignore": ("floor_ignore", "norm + int mul_"),
    "clip_value": ("floor_clamp", "one clamp_"),
    "ignore_value": ("floor_ignore_value", "aminmax + int mul_"),
}
_FLAT_VARIANTS = ("torch", "per-tensor", "flat, list", "flat")
_FLAT_LABELS = {
    "torch": "torch.nn.utils",
    "per-tensor": "gradlab, per-tensor gradients",
    "flat, list": "gradlab, flat views as a list",
    "flat": "gradlab, FlatGrads",
}
_FLAT_COLOURS = {"torch": KEEP, "per-tensor": CLIP, "flat, list": IGNORE, "flat": THRESHOLD}


def _check_family(family: str) -> None:
    if family not in FLAT_FAMILIES:
        raise ValueError(f"family must be one of {list(FLAT_FAMILIES)}, got {family!r}")


def flat_times(bench: Bench, family: str) -> dict[str, dict[str, float]]:
    """The stored minima (µs) of one family of ``bench_flat.json``.

    Args:
        bench (Bench): :func:`load_bench` of :data:`BENCH_FLAT`.
        family (str): a key of :data:`FLAT_FAMILIES`.

    Returns:
        dict: variant (``torch``, ``per-tensor``, ``flat, list``, ``flat``, the family's
        floor and ``floor_norm``) -> set label (those of :data:`FLAT_SETS`, then
        ``10 large (30M)``) -> µs per call; variants a family lacks (torch has no
        ignore) are left out.

    Raises:
        ValueError: for an unknown family.
    """
    _check_family(family)
    floor = FLAT_FAMILIES[family][0]
    labels = [*FLAT_SETS, FLAT_LARGE]
    out: dict[str, dict[str, float]] = {}
    for variant in (*_FLAT_VARIANTS, floor, "floor_norm"):
        cells = {}
        for label in labels:
            table = f"{label} {family}"
            if table in bench.tables and any(r["name"] == variant for r in bench.tables[table]):
                cells[label] = bench.min_us(table, variant)
        if cells:
            out[variant] = cells
    return out


def per_tensor_cost(bench: Bench, family: str, variant: str) -> tuple[float, float]:
    """The least-squares line ``t = a + b k`` through a variant's stored minima at the
    1M-float sets (:data:`FLAT_SETS`).

    Args:
        bench (Bench): :func:`load_bench` of :data:`BENCH_FLAT`.
        family (str): a key of :data:`FLAT_FAMILIES`.
        variant (str): ``torch``, ``per-tensor``, ``flat, list`` or ``flat``.

    Returns:
        tuple[float, float]: ``(a, b)`` in µs and µs per tensor.

    Raises:
        ValueError: for an unknown family, or fewer than two stored points.
    """
    cells = flat_times(bench, family).get(variant, {})
    points = [(k, cells[label]) for label, k in FLAT_SETS.items() if label in cells]
    if len(points) < 2:
        raise ValueError(f"fewer than two stored sets for {variant!r} in family {family!r}")
    k = np.array([p[0] for p in points], dtype=np.float64)
    t = np.array([p[1] for p in points], dtype=np.float64)
    slope = float(((k - k.mean()) * (t - t.mean())).sum() / ((k - k.mean()) ** 2).sum())
    return float(t.mean() - slope * k.mean()), slope


def flat_report(bench: Bench, family: str) -> str:
    """One family of ``bench_flat.json`` as a table: each variant's time over one norm
    of one buffer (``floor_norm``, the same in every family), per set; the floor's µs."""
    times = flat_times(bench, family)
    floor, what = FLAT_FAMILIES[family]
    labels = [*FLAT_SETS, FLAT_LARGE]
    heads = [*FLAT_SETS, "10x3M"]
    base = times.get("floor_norm", {})
    lines = [f"{family + ': time / floor_norm':31}" + "".join(f"{h:>8}" for h in heads)]
    names = {**_FLAT_LABELS, floor: f"floor: {what}"}
    for variant in (*_FLAT_VARIANTS, floor):
        if variant not in times:
            continue
        cells = [
            f"{times[variant][lab] / base[lab]:>8.3g}"
            if lab in times[variant] and lab in base
            else f"{'-':>8}"
            for lab in labels
        ]
        lines.append(f"{names[variant][:31]:31}" + "".join(cells))
    lines.append(
        f"{'floor_norm itself (µs)':31}"
        + "".join(f"{base[lab]:>8.4g}" if lab in base else f"{'-':>8}" for lab in labels)
    )
    return "\n".join(lines)


def _nearest(value: float, choices: Sequence[int]) -> int:
    """The choice nearest ``value`` on a log scale (the first for NaN or <= 0)."""
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        return choices[0]
    return min(choices, key=lambda c: abs(math.log(c) - math.log(value)))


def _nearest_title(title: str, shown: int, asked: float) -> str:
    """``title``, saying which count was asked for when the nearest measured one is shown."""
    return title if shown == asked else f"{title} (nearest measured to {asked})"


def tensor_count_figure(n_tensors: float, bench: Bench, family: str = "clip") -> Figure:
    """Time per call against the number of tensors (left), and every variant at
    ``n_tensors`` (right), from the stored ``bench_flat.json``.

    A count that was not measured shows the nearest measured one, and says so; an
    unknown family, or a file without it, draws a message instead of raising.
    """
    fig = new_figure(7.2, 3.4)
    left, right = fig.subplots(1, 2, width_ratios=[1.1, 1.0])
    try:
        times = flat_times(bench, family)
    except ValueError as exc:
        left.text(0.5, 0.5, str(exc), ha="center", wrap=True, transform=left.transAxes)
        right.set_axis_off()
        return fig
    measured = [k for label, k in FLAT_SETS.items() if label in times.get("floor_norm", {})]
    if not measured:
        left.text(0.5, 0.5, f"no stored table for {family}", ha="center", transform=left.transAxes)
        right.set_axis_off()
        return fig
    shown = _nearest(n_tensors, measured)
    floor = FLAT_FAMILIES[family][0]
    variants = [v for v in (*_FLAT_VARIANTS, floor) if v in times]
    for v in variants:
        ks = [k for label, k in FLAT_SETS.items() if label in times[v]]
        us = [times[v][label] for label in FLAT_SETS if label in times[v]]
        colour = _FLAT_COLOURS.get(v, NONE)
        style = ":" if v == floor else "-"
        left.plot(ks, us, style, marker="o", ms=3, color=colour, label=_FLAT_LABELS.get(v, v))
    left.axvline(shown, color=NONE, lw=0.8, ls="--")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("number of tensors (1M floats in all)")
    left.set_ylabel("µs per call (fastest block)")
    left.legend(fontsize=6.5, loc="upper left")
    label = next(lab for lab, k in FLAT_SETS.items() if k == shown)
    base = times["floor_norm"][label]
    names = [v for v in variants if label in times[v]]
    values = [times[v][label] for v in names]
    y = np.arange(len(names))
    right.barh(y, values, color=[_FLAT_COLOURS.get(v, NONE) for v in names], alpha=0.85)
    for yi, v in zip(y, values, strict=True):
        right.text(v, yi, f" {v / base:.3g}x", va="center", fontsize=7)
    right.set_yticks(y, [_FLAT_LABELS.get(v, v) for v in names], fontsize=7)
    right.invert_yaxis()
    right.set_xscale("log")
    right.set_xlim(min(values) / 2, max(values) * 6)
    right.set_xlabel("µs per call (x one norm of one buffer)")
    right.set_title(_nearest_title(f"{family}: {shown} tensors", shown, n_tensors), fontsize=9)
    return fig


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


def sweep_figure(n_tensors: float, sweep: Sweep) -> Figure:
    """Every implementation's time at one number of tensors, with the floor drawn.

    A count that was not measured shows the nearest measured one, and says so.
    """
    fig = new_figure(6.4, 3.4)
    ax = fig.subplots()
    measured = [int(k) for k in sweep.n_tensors if k > 0]
    if not measured:
        ax.text(0.5, 0.5, "no measurement", ha="center", transform=ax.transAxes)
        return fig
    shown = _nearest(n_tensors, measured)
    i = int(np.flatnonzero(sweep.n_tensors == shown)[0])
    names = [n for n in sweep.times if n != FLOOR]
    values = [sweep.times[n][i] * 1e3 for n in names]
    floor = sweep.times[FLOOR][i] * 1e3
    y = np.arange(len(names))
    ax.barh(y, values, color=[COLOURS.get(n, NONE) for n in names], alpha=0.85)
    for yi, name, v in zip(y, names, values, strict=True):
        counts = sweep.counts.get(name)
        reads = counts[i].host_reads if counts else 0
        note = f"{v / floor:.3g}x floor" if floor > 0 and math.isfinite(floor) else ""
        if reads:
            note += f", {reads} host read{'s' if reads > 1 else ''}"
        ax.text(v, yi, " " + note, va="center", fontsize=6.5)
    if floor > 0 and math.isfinite(floor):
        ax.axvline(floor, color=THRESHOLD, lw=1, ls=":", label=f"one-pass floor {floor:.3g} ms")
        ax.legend(fontsize=7, loc="lower right")
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    shown_values = np.array([*values, floor], dtype=float)
    shown_values = shown_values[np.isfinite(shown_values) & (shown_values > 0)]
    if shown_values.size:
        ax.set_xscale("log")
        ax.set_xlim(shown_values.min() / 2, shown_values.max() * 30)
    ax.set_xlabel("time per call (ms, fastest block, log scale)")
    title = f"{shown} tensors, {sweep.n_elements:,} numbers in all"
    ax.set_title(_nearest_title(title, shown, n_tensors), fontsize=10)
    return fig
