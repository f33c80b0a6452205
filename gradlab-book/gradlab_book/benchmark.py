r"""A small timing harness for the gradient-control functions.

It answers one question: what does clipping or ignoring cost, next to
:func:`torch.nn.utils.clip_grad_norm_` and next to the least any total-norm
computation can cost? Used by ``benchmarks/bench_clip.py`` and by the book's
chapter on costs.

The pieces, each usable on its own:

* :func:`make_parameters` builds a seeded set of float32 parameters with gradients,
  ``n_tensors`` of them holding ``n_elements`` numbers in all;
* :func:`time_call` times a callable: the median of ``repeats`` runs after a warm-up,
  with :func:`time.perf_counter`, synchronising the GPU around each run;
  :func:`time_calls` does the same for several callables, interleaved;
* :func:`loop_ignore_norm_` and :func:`loop_ignore_value_` restate the per-tensor
  loop algorithm of the reference walk-through (norms of each tensor stacked, then a
  Python ``if`` on a tensor, which reads it on the host); the only change is that
  ``inf`` comes from :mod:`math`, as ``torch._six`` no longer exists;
* :func:`floor_norm` is the one-pass floor: a single
  :func:`torch.linalg.vector_norm` over one flat tensor of the same total size;
* :func:`benchmark_table` times all of them on a list of :class:`Case` and returns
  one plain ``dict`` per case; :func:`format_table` prints it.

Every timed call leaves the gradients as they were (the thresholds are set above the
gradients' norm and largest entry, so nothing is clipped or ignored): each repeat
measures the same work, the common step of a healthy training run. No timing is
asserted anywhere; timings depend on the machine.

Example::

    from gradlab_book.benchmark import Case, benchmark_table, format_table
    rows = benchmark_table([Case("300 x 10M", 300, 10_000_000)], repeats=5)
    print(format_table(rows))
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

import gradlab

__all__ = [
    "DEFAULT_CASES",
    "QUICK_CASES",
    "Case",
    "benchmark_table",
    "floor_norm",
    "format_table",
    "loop_ignore_norm_",
    "loop_ignore_value_",
    "make_parameters",
    "time_call",
    "time_calls",
]


@dataclass(frozen=True)
class Case:
    """One parameter set to time: ``n_tensors`` float32 tensors, ``n_elements`` in all."""

    name: str
    n_tensors: int
    n_elements: int


#: The cases of ``benchmarks/bench_clip.py``: few large, some, and many tensors
#: holding 10M numbers, and many small tensors (300K numbers), where per-tensor
#: overheads dominate.
DEFAULT_CASES: tuple[Case, ...] = (
    Case("10 x 1M", 10, 10_000_000),
    Case("300 x 33K", 300, 10_000_000),
    Case("3000 x 3.3K", 3000, 10_000_000),
    Case("3000 x 100", 3000, 300_000),
)

#: The same shapes, 10x smaller in numbers, for a quick look.
QUICK_CASES: tuple[Case, ...] = (
    Case("10 x 100K", 10, 1_000_000),
    Case("300 x 3.3K", 300, 1_000_000),
    Case("3000 x 333", 3000, 1_000_000),
    Case("3000 x 100", 3000, 300_000),
)


# ------------------------------------------------------------------- parameters


def make_parameters(
    n_tensors: int,
    n_elements: int,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> list[torch.nn.Parameter]:
    """``n_tensors`` float32 parameters holding ``n_elements`` numbers in all.

    The sizes differ by at most one (the first ``n_elements % n_tensors`` tensors get
    one more), so every tensor holds at least one number when ``n_elements >=
    n_tensors``. Each parameter's ``.grad`` is standard normal noise from a
    ``torch.Generator`` seeded with ``seed``: the same call gives the same gradients.
    """
    if n_tensors < 1 or n_elements < 0:
        raise ValueError("need n_tensors >= 1 and n_elements >= 0")
    generator = torch.Generator().manual_seed(seed)
    base, extra = divmod(n_elements, n_tensors)
    params = []
    for i in range(n_tensors):
        size = base + (1 if i < extra else 0)
        param = torch.nn.Parameter(torch.zeros(size, device=device))
        # Drawn on the CPU so that every device gets the same numbers.
        param.grad = torch.randn(size, generator=generator).to(device)
        params.append(param)
    return params


# ----------------------------------------------------------------------- timing


_STATISTICS: dict[str, Callable[[list[float]], float]] = {
    "median": statistics.median,
    "min": min,
}


def _check_timing(repeats: int, warmup: int, statistic: str) -> None:
    if repeats < 1 or warmup < 0:
        raise ValueError("need repeats >= 1 and warmup >= 0")
    if statistic not in _STATISTICS:
        raise ValueError(f"statistic must be 'median' or 'min', got {statistic!r}")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(
    fn: Callable[[], object],
    *,
    repeats: int = 10,
    warmup: int = 2,
    device: str | torch.device = "cpu",
    statistic: str = "median",
) -> float:
    """The median wall-clock time of ``fn()``, in seconds.

    ``fn`` runs ``warmup`` times untimed, then ``repeats`` times, each timed with
    :func:`time.perf_counter`. On a CUDA device the GPU is synchronised before and
    after each timed run, so a run's time includes the kernels it launched.
    ``statistic="min"`` returns the fastest run instead: on a machine shared with
    other work, the best estimate of what the call costs on its own.
    """
    _check_timing(repeats, warmup, statistic)
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return _STATISTICS[statistic](times)


def time_calls(
    fns: dict[str, Callable[[], object]],
    *,
    repeats: int = 10,
    warmup: int = 2,
    device: str | torch.device = "cpu",
    statistic: str = "median",
) -> dict[str, float]:
    """The median time of each callable in ``fns``, in seconds, measured interleaved.

    Like :func:`time_call`, but round-robin: each of the ``repeats`` rounds runs every
    callable once, in a fresh (seeded) random order. Whatever else the machine is doing
    then slows all of them alike, instead of whichever happened to be timed at a busy
    moment, and no callable always runs right after the same neighbour (whose caches,
    allocations and idle threads it would otherwise inherit every time).
    ``statistic`` is ``"median"`` or ``"min"``, as in :func:`time_call`.
    """
    _check_timing(repeats, warmup, statistic)
    device = torch.device(device)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    shuffler = random.Random(0)
    for _ in range(repeats):
        shuffler.shuffle(order)
        for name in order:
            fn = fns[name]
            _synchronize(device)
            start = time.perf_counter()
            fn()
            _synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: _STATISTICS[statistic](ts) for name, ts in times.items()}


# ------------------------------------------------------- the reference loop algorithm


def _with_grads(parameters: Tensor | Iterable[Tensor]) -> list[Tensor]:
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    return [p for p in parameters if p.grad is not None]


def loop_ignore_norm_(
    parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0
) -> Tensor:
    """Ignore-by-norm as the reference walk-through computes it, for timing only.

    One norm per tensor, the norms stacked and normed again, then a Python ``if`` on
    the 0-dim coefficient tensor, which copies it to the host (a device sync), and a
    ``zero_()`` per tensor when it is below 1. Like the original it raises
    IndexError on an empty list and lets a NaN norm through (``NaN < 1`` is false).
    Use :func:`gradlab.grad_ignore_norm_` for real work.
    """
    params = _with_grads(parameters)
    max_norm, norm_type = float(max_norm), float(norm_type)
    device = params[0].grad.device
    if norm_type == math.inf:
        per_tensor = [p.grad.detach().abs().max().to(device) for p in params]
        total = per_tensor[0] if len(per_tensor) == 1 else torch.stack(per_tensor).max()
    else:
        per_tensor = [torch.norm(p.grad.detach(), norm_type).to(device) for p in params]
        total = torch.norm(torch.stack(per_tensor), norm_type)
    coef = max_norm / (total + 1e-6)
    if coef < 1:  # a tensor in a Python `if`: the host waits for the device here
        for p in params:
            p.grad.zero_()
    return total


def loop_ignore_value_(parameters: Tensor | Iterable[Tensor], clip_value: float) -> None:
    """Ignore-by-value as the reference walk-through computes it, for timing only.

    The largest absolute entry of each tensor in turn, compared on the host with
    ``clip_value`` (one device sync per tensor until one reaches it), then a
    ``zero_()`` per tensor if one did. Use :func:`gradlab.grad_ignore_value_` for
    real work.
    """
    params = _with_grads(parameters)
    clip_value = float(clip_value)
    too_large = False
    for p in params:
        if p.grad.abs().max() >= clip_value:  # host read, once per tensor
            too_large = True
            break
    if too_large:
        for p in params:
            p.grad.zero_()


def floor_norm(flat: Tensor, norm_type: float = 2.0) -> Tensor:
    """The one-pass floor: one :func:`torch.linalg.vector_norm` over one flat tensor.

    Any total-norm computation must read every number at least once; this does
    exactly that, in one kernel, with no per-tensor work. Pass a flat tensor with as
    many numbers as the parameter set.
    """
    return torch.linalg.vector_norm(flat, norm_type)


# ------------------------------------------------------------------------ table

#: gradlab functions compared with torch.nn.utils.clip_grad_norm_ and with the floor,
#: and those compared with torch.nn.utils.clip_grad_value_.
_GRADLAB_NORM = ("get_total_norm", "clip_grad_norm_", "grad_ignore_norm_")
_GRADLAB_VALUE = ("clip_grad_value_", "grad_ignore_value_")


def _runs(
    params: list[torch.nn.Parameter], flat: Tensor, max_norm: float, clip_value: float
) -> dict[str, Callable[[], object]]:
    """The timed calls of one case, by column name."""
    grads = [p.grad for p in params]
    clip_norm, clip_value_ = torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_
    return {
        "get_total_norm": lambda: gradlab.get_total_norm(grads),
        "clip_grad_norm_": lambda: gradlab.clip_grad_norm_(params, max_norm),
        "grad_ignore_norm_": lambda: gradlab.grad_ignore_norm_(params, max_norm),
        "clip_grad_value_": lambda: gradlab.clip_grad_value_(params, clip_value),
        "grad_ignore_value_": lambda: gradlab.grad_ignore_value_(params, clip_value),
        "torch_clip_grad_norm_": lambda: clip_norm(params, max_norm),
        "torch_clip_grad_value_": lambda: clip_value_(params, clip_value),
        "loop_ignore_norm_": lambda: loop_ignore_norm_(params, max_norm),
        "loop_ignore_value_": lambda: loop_ignore_value_(params, clip_value),
        "floor": lambda: floor_norm(flat),
    }


def benchmark_table(
    cases: Sequence[Case] = DEFAULT_CASES,
    *,
    device: str | torch.device = "cpu",
    repeats: int = 10,
    warmup: int = 2,
    seed: int = 0,
    statistic: str = "median",
) -> list[dict[str, object]]:
    """Time every function on every case; one row (a plain dict) per case.

    Keys of a row (times in milliseconds: medians, or minima with
    ``statistic="min"``):

    * ``case``, ``n_tensors``, ``n_elements``, ``device``;
    * ``get_total_norm``, ``clip_grad_norm_``, ``grad_ignore_norm_``,
      ``clip_grad_value_``, ``grad_ignore_value_``: gradlab's functions;
    * ``torch_clip_grad_norm_``, ``torch_clip_grad_value_``: :mod:`torch.nn.utils`;
    * ``loop_ignore_norm_``, ``loop_ignore_value_``: the reference loop algorithm;
    * ``floor``: :func:`floor_norm` on a flat tensor of ``n_elements`` numbers;
    * ``<name>/torch``: each gradlab time over its torch counterpart
      (``torch_clip_grad_norm_`` for the three norm functions,
      ``torch_clip_grad_value_`` for the two value functions);
    * ``<name>/floor``: each gradlab norm function's time over ``floor``.

    Thresholds are set above the gradients' norm (and largest entry), so every call
    keeps the gradients as they are and each repeat does the same work. The functions
    of a case are timed interleaved (:func:`time_calls`).
    """
    _check_timing(repeats, warmup, statistic)
    device = torch.device(device)
    rows: list[dict[str, object]] = []
    for case in cases:
        params = make_parameters(case.n_tensors, case.n_elements, device=device, seed=seed)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        # Above the norm and the largest entry: nothing is ever clipped or ignored.
        max_norm = 2.0 * float(torch.linalg.vector_norm(flat)) + 1.0
        clip_value = 2.0 * float(flat.abs().max()) + 1.0
        runs = _runs(params, flat, max_norm, clip_value)
        row: dict[str, object] = {
            "case": case.name,
            "n_tensors": case.n_tensors,
            "n_elements": case.n_elements,
            "device": device.type,
        }
        seconds = time_calls(
            runs, repeats=repeats, warmup=warmup, device=device, statistic=statistic
        )
        row.update({name: 1e3 * value for name, value in seconds.items()})
        for name in _GRADLAB_NORM:
            row[f"{name}/torch"] = row[name] / row["torch_clip_grad_norm_"]
            row[f"{name}/floor"] = row[name] / row["floor"]
        for name in _GRADLAB_VALUE:
            row[f"{name}/torch"] = row[name] / row["torch_clip_grad_value_"]
        rows.append(row)
    return rows


def format_table(rows: Sequence[dict[str, object]], columns: Sequence[str] | None = None) -> str:
    """Render rows from :func:`benchmark_table` as a fixed-width text table.

    ``columns`` picks and orders the keys (default: every key of the first row).
    Floats print with 3 significant digits; ratios are the keys containing ``/``.
    """
    if not rows:
        return ""
    columns = list(columns) if columns is not None else list(rows[0])

    def cell(value: object) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    table = [columns] + [[cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = [
        "  ".join(text.rjust(w) for text, w in zip(line, widths, strict=True)) for line in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
