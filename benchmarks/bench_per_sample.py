r"""Time one DP-SGD clip step (no noise) five or six ways, on an MLP and a sequence model.

    .venv/bin/python benchmarks/bench_per_sample.py                # 10 rounds per model
    .venv/bin/python benchmarks/bench_per_sample.py --repeats 30   # steadier numbers
    .venv/bin/python benchmarks/bench_per_sample.py --json costs.json   # also the table

Every cell is one optimizer step: zero_grad, forward, loss, per-sample clipping to
``--max-norm`` with a mean over the batch, and an SGD step; noise is off everywhere so
only the clipping is compared. The methods:

* ``non-private``: the plain step (``loss.mean().backward()``), the baseline;
* ``per-sample loop``: one forward and backward per sample, ``clip_grad_norm_``, sum;
* ``torch.func vmap``: :func:`gradlab.per_sample.per_sample_grads` then
  :func:`gradlab.per_sample.clip_per_sample_`;
* ``gradlab ghost``: :class:`gradlab.per_sample.GhostClipping`;
* ``opacus hooks`` / ``opacus ghost``: Opacus's ``GradSampleModule`` + ``DPOptimizer``
  and its ``GradSampleModuleFastGradientClipping`` (ghost clipping), when opacus is
  importable; otherwise these rows are skipped with a note.

The models:

* ``MLP``: 784-400-200-10 with ReLU (396,210 parameters), batch ``--batch`` (64): every
  Linear sees one row per sample (T = 1), where a ghost norm is :math:`\|a\| \|b\|`;
* ``sequence``: Embedding(512, 128) -> LayerNorm(128) -> Linear(128, 256) -> tanh ->
  mean over the sequence -> Linear(256, 10) (101,386 parameters), batch ``--seq-batch``
  (16), at T = 128 (the Linear's ghost norm takes the Gram form, :math:`T^2 \le d_\text{in}
  d_\text{out}`) and T = 512 (it forms each sample's gradient instead); the Embedding's
  norm is a Gram form over repeated ids at both lengths.

Timing: CPU time of the calling thread (:func:`time.thread_time_ns`), one torch thread
(so every kernel and the autograd engine run on that thread; another process's load
does not count, as it would in wall-clock time). Each round runs every method once,
interleaved, after ``--warmup`` untimed rounds. The table gives, per method, the ratio
of minima to the non-private step's minimum, and in brackets the median over rounds
of the same-round ratio (paired). Before timing, one step of each method from the same
weights is checked against the per-sample loop (largest difference of the clipped,
summed gradients, the largest entry of the loop's beside it).

``--json PATH`` writes the settings, the machine and, per model, one row per method:
``min_ms`` and ``median_ms`` (thread CPU milliseconds), ``ratio_to_non_private``
(minima), ``paired_ratio_median`` and ``max_abs_grad_diff_vs_loop``. The MLP's table is
also at the top level (``model``, ``rows``), where earlier versions put it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlab.per_sample import GhostClipping, clip_per_sample_, per_sample_grads

Step = Callable[[Tensor, Tensor], None]
Factory = Callable[[nn.Module, float, float, int], Step]


def make_mlp(seed: int = 0) -> nn.Module:
    """784-400-200-10, ReLU: 396,210 parameters."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(784, 400), nn.ReLU(), nn.Linear(400, 200), nn.ReLU(), nn.Linear(200, 10)
    )


class SequenceModel(nn.Module):
    """Embedding -> LayerNorm -> Linear -> tanh -> mean over T -> Linear head."""

    def __init__(self, vocab: int = 512, dim: int = 128, hidden: int = 256, classes: int = 10):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.proj(self.norm(self.emb(ids)))).mean(1))


def make_sequence(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SequenceModel()


# ------------------------------------------------------------------------ methods


def non_private(model: nn.Module, lr: float, max_norm: float, batch: int) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step(x: Tensor, y: Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def per_sample_loop(model: nn.Module, lr: float, max_norm: float, batch: int) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    params = list(model.parameters())

    def step(x: Tensor, y: Tensor) -> None:
        opt.zero_grad()
        total = [torch.zeros_like(p) for p in params]
        for i in range(x.shape[0]):
            for p in params:
                p.grad = None
            F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
            torch.nn.utils.clip_grad_norm_(params, max_norm)
            torch._foreach_add_(total, [p.grad for p in params])
        for p, t in zip(params, total, strict=True):
            p.grad = t.div_(x.shape[0])
        opt.step()

    return step


def func_vmap(model: nn.Module, lr: float, max_norm: float, batch: int) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    params = list(model.parameters())

    def step(x: Tensor, y: Tensor) -> None:
        opt.zero_grad()
        grads = per_sample_grads(model, F.cross_entropy, x, y)
        clip_per_sample_(params, grads, max_norm, reduction="mean")
        opt.step()

    return step


def gradlab_ghost(model: nn.Module, lr: float, max_norm: float, batch: int) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ghost = GhostClipping(model)

    def step(x: Tensor, y: Tensor) -> None:
        opt.zero_grad()
        with ghost:
            losses = F.cross_entropy(model(x), y, reduction="none")
            ghost.clip_(losses, max_norm, reduction="mean")
        opt.step()

    return step


def opacus_hooks(model: nn.Module, lr: float, max_norm: float, batch: int) -> Step:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    gsm = GradSampleModule(model)
    opt = DPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=lr),
        noise_multiplier=0.0,
        max_grad_norm=max_norm,
        expected_batch_size=batch,
    )

    def step(x: Tensor, y: Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(gsm(x), y).backward()
        opt.step()

    return step


def opacus_ghost(model: nn.Module, lr: float, max_norm: float, batch: int) -> Step:
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(
        model, max_grad_norm=max_norm, use_ghost_clipping=True, loss_reduction="mean"
    )
    opt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(gsm.parameters(), lr=lr),
        noise_multiplier=0.0,
        max_grad_norm=max_norm,
        expected_batch_size=batch,
        loss_reduction="mean",
    )
    criterion = DPLossFastGradientClipping(
        gsm, opt, nn.CrossEntropyLoss(reduction="mean"), loss_reduction="mean"
    )

    def step(x: Tensor, y: Tensor) -> None:
        opt.zero_grad()
        criterion(gsm(x), y).backward()
        opt.step()

    return step


METHODS: dict[str, Factory] = {
    "non-private": non_private,
    "per-sample loop": per_sample_loop,
    "torch.func vmap": func_vmap,
    "gradlab ghost": gradlab_ghost,
    "opacus hooks": opacus_hooks,
    "opacus ghost": opacus_ghost,
}
OPACUS = ("opacus hooks", "opacus ghost")


# ------------------------------------------------------------------------- timing


def check_against_loop(
    methods: dict[str, Factory], base: nn.Module, x: Tensor, y: Tensor, max_norm: float
) -> tuple[dict[str, float], float]:
    """One step at lr 0 per method: the largest gradient difference from the loop's."""
    grads = {}
    for name, factory in methods.items():
        model = copy.deepcopy(base)
        factory(model, 0.0, max_norm, x.shape[0])(x, y)
        grads[name] = [p.grad.clone() for p in model.parameters()]
    ref = grads["per-sample loop"]
    largest = max(r.abs().max().item() for r in ref)
    diffs = {
        name: max((g - r).abs().max().item() for g, r in zip(gs, ref, strict=True))
        for name, gs in grads.items()
    }
    return diffs, largest


def time_interleaved(steps: dict[str, Step], x: Tensor, y: Tensor, repeats: int, warmup: int):
    """Thread CPU seconds per step and method, ``repeats`` rounds of every method in turn."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(warmup + repeats):
        for name, step in steps.items():
            start = time.thread_time_ns()
            step(x, y)
            elapsed = time.thread_time_ns() - start
            if round_ >= warmup:
                times[name].append(elapsed * 1e-6)
    return times


def bench_model(
    label: str,
    base: nn.Module,
    x: Tensor,
    y: Tensor,
    seq_len: int,
    methods: dict[str, Factory],
    args: argparse.Namespace,
) -> dict[str, object]:
    """Check, then time, every method on one model; one table of rows."""
    print(f"# {label}: checking, then {args.warmup}+{args.repeats} rounds ...", file=sys.stderr)
    diffs, largest = check_against_loop(methods, base, x, y, args.max_norm)
    steps = {
        name: factory(copy.deepcopy(base), 1e-3, args.max_norm, x.shape[0])
        for name, factory in methods.items()
    }
    times = time_interleaved(steps, x, y, args.repeats, args.warmup)
    base_times = times["non-private"]
    rows = []
    for name, ts in times.items():
        paired = statistics.median(t / b for t, b in zip(ts, base_times, strict=True))
        rows.append(
            {
                "method": name,
                "min_ms": round(min(ts), 2),
                "median_ms": round(statistics.median(ts), 2),
                "ratio_to_non_private": round(min(ts) / min(base_times), 2),
                "paired_ratio_median": round(paired, 2),
                "max_abs_grad_diff_vs_loop": None
                if name == "non-private"
                else float(f"{diffs[name]:.1e}"),
            }
        )
    return {
        "model": label,
        "parameters": sum(p.numel() for p in base.parameters()),
        "batch": x.shape[0],
        "seq_len": seq_len,
        "largest_loop_grad_entry": float(f"{largest:.2e}"),
        "rows": rows,
    }


def print_tables(tables: list[dict[str, object]]) -> None:
    heads = [f"{t['model']} (B={t['batch']}, T={t['seq_len']})" for t in tables]
    methods = [r["method"] for r in tables[0]["rows"]]
    cells = {(k, r["method"]): r for k, t in enumerate(tables) for r in t["rows"]}
    print("Ratio to the non-private step: min/min (median of same-round ratios)\n")
    print("| method | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(tables))
    for m in methods:
        row = []
        for k in range(len(tables)):
            r = cells[(k, m)]
            row.append(f"{r['ratio_to_non_private']:.2f}x ({r['paired_ratio_median']:.2f})")
        print(f"| {m} | " + " | ".join(row) + " |")
    base = " | ".join(f"{cells[(k, 'non-private')]['min_ms']:.2f} ms" for k in range(len(tables)))
    print(f"| (non-private, min thread CPU time) | {base} |")
    print("\nLargest |clipped summed gradient - loop's| (largest |entry| of the loop's)\n")
    print("| method | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(tables))
    for m in methods[1:]:
        row = [
            f"{cells[(k, m)]['max_abs_grad_diff_vs_loop']:.1e} "
            f"({tables[k]['largest_loop_grad_entry']:.2g})"
            for k in range(len(tables))
        ]
        print(f"| {m} | " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="MLP batch (64)")
    parser.add_argument("--seq-batch", type=int, default=16, help="sequence batch (16)")
    parser.add_argument(
        "--seq-lens", type=int, nargs="*", default=[128, 512], help="sequence lengths (128 512)"
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds (10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds (2)")
    parser.add_argument("--max-norm", type=float, default=1.0, help="C (1.0)")
    parser.add_argument("--json", type=Path, help="also write the tables and settings here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # thread CPU time counts this thread's work only
    # opacus's modules warn at every backward about its full backward hooks
    warnings.filterwarnings("ignore", message=".*backward hook", category=UserWarning)

    methods = dict(METHODS)
    try:
        import opacus

        opacus_note = f"opacus {opacus.__version__}"
    except ImportError:
        opacus_note = "opacus not importable: its rows are skipped"
        for name in OPACUS:
            methods.pop(name)

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 784, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    tables = [bench_model("MLP 784-400-200-10", make_mlp(), x, y, 1, methods, args)]
    for seq_len in args.seq_lens:
        ids = torch.randint(0, 512, (args.seq_batch, seq_len), generator=gen)
        y = torch.randint(0, 10, (args.seq_batch,), generator=gen)
        label = "Emb+LN+Linear"
        tables.append(bench_model(label, make_sequence(), ids, y, seq_len, methods, args))

    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    print(
        f"# per-sample clip step, C={args.max_norm}, no noise, 1 torch thread; "
        f"thread CPU time, {args.repeats} interleaved rounds after {args.warmup} warm-up"
    )
    print(f"# torch {torch.__version__}, {opacus_note}, {machine}\n")
    print_tables(tables)
    if args.json is not None:
        record = {
            "command": "python benchmarks/bench_per_sample.py " + " ".join(sys.argv[1:]),
            "timer": "thread CPU time (time.thread_time_ns), 1 torch thread",
            "machine": machine,
            "torch": torch.__version__,
            "opacus": opacus_note.removeprefix("opacus "),
            "python": platform.python_version(),
            "batch": args.batch,
            "threads": 1,
            "max_norm": args.max_norm,
            "timed_rounds": args.repeats,
            "warmup_rounds": args.warmup,
            "model": f"{tables[0]['model']} ({tables[0]['parameters']:,} parameters)",
            "rows": tables[0]["rows"],
            "tables": tables,
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    if opacus_note.startswith("opacus not"):
        print(f"\nNote: {opacus_note}.")


if __name__ == "__main__":
    main()
