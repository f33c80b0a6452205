r"""Zeroing a gradient is not skipping a step (taught in book/training/skip_step).

Four runs of the same small MLP from :mod:`gradlab_book.demos` see the same clean
minibatches; three of them also see one more batch part-way through:

* ``reference``: never sees it;
* ``zeroed``: sees a bad batch (targets a thousand times too large), zeroes every
  gradient with :func:`gradlab.grad_ignore_norm_` and calls ``optimizer.step()``
  anyway;
* ``skipped``: sees the bad batch, and :func:`gradlab.step_if_` skips the step
  (``keep`` from :func:`gradlab.keep_by_norm`);
* ``swapped``: sees one more *clean* batch there and steps on it normally: the scale
  of the drift one ordinary batch causes, against which the zeroed drift is judged.

After every batch the distance :math:`\|\theta - \theta_{\text{ref}}\|_2` to the
reference run after the same clean batches measures how far the extra step moved the
parameters, and the loss on held-out data after the last batch what it cost. The
computations (:func:`drift_after_bad_batch`, :func:`host_reads_per_step`) return plain
numbers; the figure functions only draw.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import nn

import gradlab
from gradlab.sync import HostReadCounter
from gradlab_book import demos, stored
from gradlab_book.plots import IGNORE, NONE, SKIP, new_figure

#: ``benchmarks/bench_skip.py --json``'s tables, with the platform that measured them.
BENCH_PATH = stored.path("skip_bench.json")

__all__ = [
    "HOST_READ_OPTIMIZERS",
    "OPTIMIZERS",
    "Drift",
    "drift_after_bad_batch",
    "drift_comparison_figure",
    "drift_figure",
    "format_host_read_table",
    "host_read_table",
    "host_reads_per_step",
    "make_optimizer",
    "own_reads_per_step",
]

#: The optimizers compared, and how the figures name them.
OPTIMIZERS = {
    "sgd": "SGD + momentum",
    "adam": "Adam",
    "adamw": "AdamW",
}

_D_IN = 4
_HIDDEN = 16
_BATCH = 16
_WARMUP = 5  # clean batches before the bad one
_THRESHOLD = 20.0  # max_norm of the ignore: clean batches stay well below it
_BAD_SCALE = 1000.0  # the bad batch's targets are this many times too large


def make_optimizer(
    name: str, params, beta: float = 0.9, weight_decay: float = 0.01
) -> torch.optim.Optimizer:
    r"""The chapter's optimizers, with the momentum or :math:`\beta_1` given by ``beta``.

    ``"sgd"``: SGD with momentum ``beta``, lr 0.01, L2 weight decay; ``"adam"``: Adam
    with :math:`(\beta_1, \beta_2) = (\text{beta}, 0.999)`, lr 0.01, L2 weight decay
    added to the gradient; ``"adamw"``: AdamW, the same with decoupled weight decay.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"name must be one of {sorted(OPTIMIZERS)}, got {name!r}")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {beta!r}")
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=beta, weight_decay=weight_decay)
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return cls(params, lr=0.01, betas=(beta, 0.999), weight_decay=weight_decay)


@dataclass(frozen=True)
class Drift:
    r"""How far two ways of "ignoring" a bad batch end up from never seeing it.

    Attributes:
        optimizer: a key of :data:`OPTIMIZERS`.
        beta: the momentum (SGD) or :math:`\beta_1` (Adam, AdamW).
        steps: 0, 1, ..., n: clean batches seen since the bad one.
        zeroed: per step, :math:`\|\theta_{\text{zeroed}} - \theta_{\text{ref}}\|_2`.
        skipped: the same for the true skip (all exactly 0.0 when it works).
        swapped: the same for a run that took one extra clean step there instead: the
            drift of one ordinary batch, the scale to judge ``zeroed`` against.
        test_loss: the mean squared error on held-out data after the last batch, by run
            (``"reference"``, ``"zeroed"``, ``"skipped"``, ``"swapped"``).
        zeroed_step_count: the optimizer's step count after the bad batch under
            zeroing (``None`` for SGD, which keeps no count).
        reference_step_count: the same in the reference run.
        bad_norm: the total gradient norm of the bad batch.
        clean_norm_max: the largest total gradient norm of a clean batch (in the
            reference run).
        clean_ignored: how many clean batches the reference run ignored (0 unless
            training itself diverges: then the comparison means nothing).
        threshold: the ``max_norm`` used by both ignores.
    """

    optimizer: str
    beta: float
    steps: np.ndarray
    zeroed: np.ndarray
    skipped: np.ndarray
    swapped: np.ndarray
    test_loss: dict[str, float]
    zeroed_step_count: int | None
    reference_step_count: int | None
    bad_norm: float
    clean_norm_max: float
    clean_ignored: int
    threshold: float


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _step_count(opt: torch.optim.Optimizer) -> int | None:
    state = opt.state_dict()["state"]
    if not state or "step" not in state[0]:
        return None
    return int(state[0]["step"])


@functools.lru_cache(maxsize=64)
def drift_after_bad_batch(
    optimizer: str = "adam",
    beta: float = 0.9,
    steps: int = 30,
    weight_decay: float = 0.01,
    seed: int = 0,
) -> Drift:
    """Train three runs (reference, zeroed, skipped) and measure their drift.

    Args:
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"``.
        beta: momentum of SGD, :math:`\\beta_1` of Adam and AdamW, in [0, 1).
        steps: how many clean batches follow the bad one (at least 0).
        weight_decay: passed to the optimizer.
        seed: seeds the data and the model.

    Returns:
        A :class:`Drift` (cached: treat it as read-only).
    """
    if steps < 0:
        raise ValueError(f"steps must be at least 0, got {steps}")
    n_clean = _WARMUP + steps
    x, y = demos.regression_data((n_clean + 1) * _BATCH, d_in=_D_IN, seed=seed)
    *clean, (x_bad, y_bad) = zip(x.split(_BATCH), y.split(_BATCH), strict=True)
    bad = (x_bad, y_bad * _BAD_SCALE)
    # the same teacher (drawn first from the seed), new inputs: one more clean batch for
    # the swapped run, and a held-out set
    start = (n_clean + 1) * _BATCH
    x_more, y_more = demos.regression_data(start + _BATCH + 256, d_in=_D_IN, seed=seed)
    extra = (x_more[start : start + _BATCH], y_more[start : start + _BATCH])
    x_test, y_test = x_more[start + _BATCH :], y_more[start + _BATCH :]

    def train(kind: str) -> tuple[list[torch.Tensor], list[float], int | None, float]:
        model = demos.small_mlp(_D_IN, _HIDDEN, 1, seed=seed)
        opt = make_optimizer(optimizer, model.parameters(), beta, weight_decay)
        inserted = {"reference": [], "swapped": [extra]}.get(kind, [bad])
        stream = [*clean[:_WARMUP], *inserted, *clean[_WARMUP:]]
        snapshots, norms, count = [], [], None
        for i, (xb, yb) in enumerate(stream):
            demos.backward(model, xb, yb)
            grads = [p.grad for p in model.parameters()]
            if kind == "skipped":  # the two phases: decide on the device, step or not
                norm = gradlab.get_total_norm(grads)
                gradlab.step_if_(opt, gradlab.keep_by_norm(norm, _THRESHOLD))
                norms.append(float(norm))
            elif kind == "zeroed":
                norms.append(float(gradlab.grad_ignore_norm_(model.parameters(), _THRESHOLD)))
                opt.step()
            else:  # reference and swapped: clean batches, stepped as they come
                norms.append(float(gradlab.get_total_norm(grads)))
                opt.step()
            if kind != "reference" and i == _WARMUP:
                count = _step_count(opt)
            snapshots.append(_flat(model))
        model.zero_grad(set_to_none=True)
        return snapshots, norms, count, demos.mse_or_inf(model, x_test, y_test)

    ref, ref_norms, _, ref_loss = train("reference")
    zeroed, norms, zeroed_count, zeroed_loss = train("zeroed")
    skipped, _, _, skipped_loss = train("skipped")
    swapped, _, _, swapped_loss = train("swapped")
    # After the bad batch (stream index _WARMUP + k) both runs have seen the same
    # _WARMUP + k clean batches as the reference after its batch _WARMUP + k - 1.
    initial = _flat(demos.small_mlp(_D_IN, _HIDDEN, 1, seed=seed))
    ref_after = [initial, *ref]

    def distances(run: list[torch.Tensor]) -> np.ndarray:
        return np.array(
            [
                torch.linalg.vector_norm(run[_WARMUP + k] - ref_after[_WARMUP + k]).item()
                for k in range(steps + 1)
            ]
        )

    ref_count = None
    if zeroed_count is not None:
        ref_count = _WARMUP  # the reference has taken exactly the clean steps so far
    return Drift(
        optimizer=optimizer,
        beta=beta,
        steps=np.arange(steps + 1),
        zeroed=distances(zeroed),
        skipped=distances(skipped),
        swapped=distances(swapped),
        test_loss={
            "reference": ref_loss,
            "zeroed": zeroed_loss,
            "skipped": skipped_loss,
            "swapped": swapped_loss,
        },
        zeroed_step_count=zeroed_count,
        reference_step_count=ref_count,
        bad_norm=norms[_WARMUP],
        clean_norm_max=max(ref_norms),
        clean_ignored=sum(not n < _THRESHOLD for n in ref_norms),
        threshold=_THRESHOLD,
    )


# ----------------------------------------------------------------------- host reads


def host_reads_per_step(
    sync: bool,
    steps: int = 6,
    bad_at: Sequence[int] = (2, 4),
    optimizer: Callable[..., torch.optim.Optimizer] | None = None,
    seed: int = 0,
) -> tuple[list[int], list[str]]:
    """Count the host reads inside each ``guard.step()`` of a short run.

    Args:
        sync: passed to :class:`gradlab.StepGuard` (``mode="skip"``).
        steps: how many steps.
        bad_at: steps whose batch is corrupted (targets 1000 times too large).
        optimizer: ``params -> Optimizer``; default SGD with momentum 0.9, which
            reads nothing on the host itself.
        seed: seeds the data and the model.

    Returns:
        (reads per step, decision per step).
    """
    x, y = demos.regression_data(steps * _BATCH, d_in=_D_IN, seed=seed)
    model = demos.small_mlp(_D_IN, _HIDDEN, 1, seed=seed)
    make = optimizer or (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    guard = gradlab.StepGuard(
        make(model.parameters()), threshold=_THRESHOLD, sync=sync, history=steps
    )
    counts = []
    for i, (xb, yb) in enumerate(zip(x.split(_BATCH), y.split(_BATCH), strict=True)):
        demos.backward(model, xb, yb * (_BAD_SCALE if i in bad_at else 1.0))
        with HostReadCounter() as counter:
            guard.step()
        counts.append(counter.count)
    return counts, [r.decision for r in guard.history]


# -------------------------------------------------------------------------- figures


def _label(optimizer: str, beta: float) -> str:
    knob = "momentum" if optimizer == "sgd" else "β₁"
    return f"{OPTIMIZERS[optimizer]}, {knob} = {beta:g}"


def drift_figure(optimizer: str = "adam", beta: float = 0.9, steps: int = 30) -> Figure:
    """Drift from the reference run after a bad batch: zeroed gradients vs a true skip."""
    data = drift_after_bad_batch(optimizer, beta, steps)
    fig = new_figure(6.4, 3.4)
    ax = fig.add_subplot()
    ax.plot(data.steps, data.zeroed, color=IGNORE, marker="o", ms=3, label="zeroed gradients")
    ax.plot(
        data.steps,
        data.swapped,
        color=NONE,
        ls="--",
        lw=1.2,
        label="one more clean batch instead (the scale)",
    )
    ax.plot(data.steps, data.skipped, color=SKIP, lw=2.5, label="true skip (step_if_)")
    drawn = np.concatenate([data.zeroed, data.swapped])
    finite = drawn[np.isfinite(drawn)]
    top = max(float(finite.max()), 1e-6) if finite.size else 1e-6
    ax.set_ylim(-0.05 * top, 1.15 * top)
    ax.set_xlabel("clean batches since the bad one")
    ax.set_ylabel(r"$\|\theta - \theta_{\mathrm{ref}}\|_2$")
    ax.set_title(_label(optimizer, beta), fontsize=10)
    final = data.zeroed[-1]
    ax.annotate(
        f"{final:.2g}",
        (data.steps[-1], final),
        textcoords="offset points",
        xytext=(-4, 6),
        ha="right",
        color=IGNORE,
    )
    ax.annotate(
        "exactly 0 at every step",
        (data.steps[-1], 0.0),
        textcoords="offset points",
        xytext=(-4, 6),
        ha="right",
        color=SKIP,
    )
    ax.legend(loc="upper left")
    return fig


def drift_comparison_figure(beta: float = 0.9, steps: int = 30) -> Figure:
    """The zeroed-gradient drift of the three optimizers on one (log) axis, each beside
    the drift of one extra clean batch (grey), the scale it is judged against."""
    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot()
    styles = {"sgd": ("-", "o"), "adam": ("--", "s"), "adamw": (":", "^")}
    for name in OPTIMIZERS:
        data = drift_after_bad_batch(name, beta, steps)
        line, marker = styles[name]
        ax.semilogy(
            data.steps,
            data.zeroed,
            color=IGNORE,
            ls=line,
            marker=marker,
            ms=3,
            label=f"{OPTIMIZERS[name]}, zeroed",
        )
        ax.semilogy(
            data.steps,
            data.swapped,
            color=NONE,
            ls=line,
            marker=marker,
            ms=2,
            lw=0.8,
            label=f"{OPTIMIZERS[name]}, one more clean batch",
        )
    ax.plot([], [], color=SKIP, lw=2.5, label="any optimizer, true skip: 0 (off the log axis)")
    ax.set_xlabel("clean batches since the bad one")
    ax.set_ylabel(r"$\|\theta - \theta_{\mathrm{ref}}\|_2$")
    ax.set_title(f"Drift of an 'ignored' step (momentum / β₁ = {beta:g})", fontsize=10)
    fig.legend(loc="outside lower center", ncol=2, fontsize=8)
    return fig


#: The optimizers of the chapter's host-read table (all on the CPU, lr 0.05 or 0.01).
HOST_READ_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "SGD, momentum 0.9": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "Adam (default)": lambda p: torch.optim.Adam(p, lr=0.01),
    "Adam, foreach=True": lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    "Adam, fused=True": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    "AdamW, fused=True": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
}


def own_reads_per_step(
    optimizer: Callable[..., torch.optim.Optimizer], steps: int = 5, seed: int = 0
) -> list[int]:
    """The host reads of a bare ``optimizer.step()``, no guard, per step of a short run."""
    x, y = demos.regression_data(steps * _BATCH, d_in=_D_IN, seed=seed)
    model = demos.small_mlp(_D_IN, _HIDDEN, 1, seed=seed)
    opt = optimizer(model.parameters())
    counts = []
    for xb, yb in zip(x.split(_BATCH), y.split(_BATCH), strict=True):
        demos.backward(model, xb, yb)
        with HostReadCounter() as counter:
            opt.step()
        counts.append(counter.count)
    return counts


def host_read_table(
    optimizers: dict[str, Callable[..., torch.optim.Optimizer]] | None = None,
    steps: int = 5,
    bad_at: Sequence[int] = (2,),
) -> dict[str, dict[str, list]]:
    """Host reads per step for each optimizer: bare, and inside ``StepGuard.step()``.

    Returns ``{name: {"own": [...], "sync=True": [...], "sync=False": [...],
    "decisions": [...]}}`` from :func:`own_reads_per_step` and
    :func:`host_reads_per_step` (the batches in ``bad_at`` are skipped).
    """
    table = {}
    for name, make in (optimizers or HOST_READ_OPTIMIZERS).items():
        row: dict[str, list] = {"own": own_reads_per_step(make, steps)}
        for sync in (True, False):
            reads, decisions = host_reads_per_step(sync, steps, bad_at, make)
            row[f"sync={sync}"] = reads
        row["decisions"] = decisions
        table[name] = row
    return table


def format_host_read_table(table: dict[str, dict[str, list]]) -> str:
    """The table of :func:`host_read_table` as text, one optimizer a line."""

    def cell(reads: list) -> str:
        return " ".join(str(r) for r in reads)

    columns = ("own", "sync=True", "sync=False")
    width = max(len(name) for name in table) + 1
    cols = max(14, *(len(cell(row[c])) + 2 for row in table.values() for c in columns))
    decisions = next(iter(table.values()))["decisions"]
    heads = ("step() alone", *columns[1:])
    lines = [
        "host reads per step; steps: " + ", ".join(decisions),
        f"{'optimizer':{width}}" + "".join(f"{c:>{cols}}" for c in heads),
    ]
    for name, row in table.items():
        lines.append(f"{name:{width}}" + "".join(f"{cell(row[c]):>{cols}}" for c in columns))
    return "\n".join(lines)
