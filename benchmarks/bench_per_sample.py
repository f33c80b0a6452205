"""Time one DP-SGD clip step (no noise) five or six ways on the same 400K-parameter MLP.

    .venv/bin/python benchmarks/bench_per_sample.py               # 1 thread, batch 64
    .venv/bin/python benchmarks/bench_per_sample.py --repeats 50  # steadier numbers
    .venv/bin/python benchmarks/bench_per_sample.py --repeats 30 \
        --json book/scale/data/per_sample_costs.json          # the table the book shows

Every column is one optimizer step: zero_grad, forward, loss, per-sample clipping to
``--max-norm`` with a mean over the batch, and an SGD step; noise is off everywhere so
only the clipping is compared. The methods:

* ``non-private``: the plain step (``loss.mean().backward()``), the baseline;
* ``per-sample loop``: one forward and backward per sample, ``clip_grad_norm_``, sum;
* ``torch.func vmap``: :func:`gradlab.per_sample.per_sample_grads` then
  :func:`gradlab.per_sample.clip_per_sample_`;
* ``gradlab ghost``: :class:`gradlab.per_sample.GhostClipping`;
* ``opacus hooks`` / ``opacus ghost``: Opacus's ``GradSampleModule`` + ``DPOptimizer``
  and its ``GradSampleModuleFastGradientClipping`` (ghost clipping), when opacus is
  importable; otherwise these columns are skipped with a note.

Before timing, one step of each method from the same weights is checked against the
per-sample loop (largest gradient difference printed). Each round runs every method
once (interleaved, so a busy moment slows all alike); the table gives the minimum and
the median over rounds, and ratios (of the minima) to the non-private step.
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
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gradlab.per_sample import GhostClipping, clip_per_sample_, per_sample_grads


def make_model(seed: int = 0) -> nn.Sequential:
    """784-400-200-10, ReLU: 396,210 parameters."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(784, 400), nn.ReLU(), nn.Linear(400, 200), nn.ReLU(), nn.Linear(200, 10)
    )


def non_private(model, lr, max_norm, batch):
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step(x, y):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def per_sample_loop(model, lr, max_norm, batch):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    params = list(model.parameters())

    def step(x, y):
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


def func_vmap(model, lr, max_norm, batch):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    params = list(model.parameters())

    def step(x, y):
        opt.zero_grad()
        grads = per_sample_grads(model, F.cross_entropy, x, y)
        clip_per_sample_(params, grads, max_norm, reduction="mean")
        opt.step()

    return step


def gradlab_ghost(model, lr, max_norm, batch):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ghost = GhostClipping(model)

    def step(x, y):
        opt.zero_grad()
        with ghost:
            losses = F.cross_entropy(model(x), y, reduction="none")
            ghost.clip_(losses, max_norm, reduction="mean")
        opt.step()

    return step


def opacus_hooks(model, lr, max_norm, batch):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    gsm = GradSampleModule(model)
    opt = DPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=lr),
        noise_multiplier=0.0,
        max_grad_norm=max_norm,
        expected_batch_size=batch,
    )

    def step(x, y):
        opt.zero_grad()
        F.cross_entropy(gsm(x), y).backward()
        opt.step()

    return step


def opacus_ghost(model, lr, max_norm, batch):
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

    def step(x, y):
        opt.zero_grad()
        criterion(gsm(x), y).backward()
        opt.step()

    return step


METHODS = {
    "non-private": non_private,
    "per-sample loop": per_sample_loop,
    "torch.func vmap": func_vmap,
    "gradlab ghost": gradlab_ghost,
    "opacus hooks": opacus_hooks,
    "opacus ghost": opacus_ghost,
}
OPACUS = ("opacus hooks", "opacus ghost")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1)")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds (20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds (3)")
    parser.add_argument("--max-norm", type=float, default=1.0, help="C (1.0)")
    parser.add_argument("--json", type=Path, help="also write the table and settings here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    methods = dict(METHODS)
    try:
        import opacus

        opacus_note = f"opacus {opacus.__version__}"
    except ImportError:
        opacus_note = "opacus not importable: its columns are skipped"
        for name in OPACUS:
            methods.pop(name)

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 784, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    base = make_model()
    n_params = sum(p.numel() for p in base.parameters())

    # Check: one step from the same weights, lr=0, gradients against the per-sample loop.
    grads = {}
    for name, factory in methods.items():
        model = copy.deepcopy(base)
        factory(model, 0.0, args.max_norm, args.batch)(x, y)
        grads[name] = [p.grad.clone() for p in model.parameters()]
    ref = grads["per-sample loop"]

    steps = {}
    for name, factory in methods.items():
        steps[name] = factory(copy.deepcopy(base), 1e-3, args.max_norm, args.batch)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(args.warmup + args.repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step(x, y)
            elapsed = time.perf_counter() - start
            if round_ >= args.warmup:
                times[name].append(elapsed * 1e3)

    print(
        f"# per-sample clip step, MLP 784-400-200-10 ({n_params:,} parameters), "
        f"batch {args.batch}, {args.threads} thread(s), C={args.max_norm}, no noise"
    )
    print(
        f"# torch {torch.__version__}, {opacus_note}, {platform.processor() or platform.machine()}"
    )
    print(f"# {args.repeats} timed rounds after {args.warmup} warm-up rounds\n")
    base_min = min(times["non-private"])
    rows = []
    header = "| method | min ms | median ms | x non-private | max abs grad diff vs loop |"
    print(header)
    print("|---|---:|---:|---:|---:|")
    for name, ts in times.items():
        best = min(ts)
        diff = max((g - r).abs().max().item() for g, r in zip(grads[name], ref, strict=True))
        diff_text = "(no clip)" if name == "non-private" else f"{diff:.1e}"
        print(
            f"| {name} | {best:.1f} | {statistics.median(ts):.1f} | "
            f"{best / base_min:.2f}x | {diff_text} |"
        )
        rows.append(
            {
                "method": name,
                "min_ms": round(best, 1),
                "median_ms": round(statistics.median(ts), 1),
                "ratio_to_non_private": round(best / base_min, 2),
                "max_abs_grad_diff_vs_loop": None
                if name == "non-private"
                else float(f"{diff:.1e}"),
            }
        )
    if args.json is not None:
        record = {
            "command": "python benchmarks/bench_per_sample.py " + " ".join(sys.argv[1:]),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "torch": torch.__version__,
            "opacus": opacus_note.removeprefix("opacus "),
            "python": platform.python_version(),
            "model": f"MLP 784-400-200-10 ({n_params:,} parameters)",
            "batch": args.batch,
            "threads": args.threads,
            "max_norm": args.max_norm,
            "timed_rounds": args.repeats,
            "warmup_rounds": args.warmup,
            "rows": rows,
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    if opacus_note.startswith("opacus not"):
        print(f"\nNote: {opacus_note}.")


if __name__ == "__main__":
    main()
