"""Time one optimizer step through StepGuard in each mode, against a bare optimizer.step().

A plain script, not a test: it prints the median time of the step call for a small MLP
with fused AdamW, so the cost of each skip mode can be compared on one machine.

    .venv/bin/python benchmarks/bench_skip.py [--steps 60] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import gradlab
from gradlab.book import demos


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 128))


def median_step_us(steps: int, sync: bool | None = None, mode: str = "ignore") -> float:
    """Median time of the step call in microseconds; ``sync=None`` means no guard."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = None
    if sync is not None:
        guard = gradlab.StepGuard(optimizer, mode=mode, threshold=1e9, sync=sync)
    x, y = torch.randn(64, 256), torch.randn(64, 128)
    times = []
    for i in range(steps + 5):  # the first steps create the optimizer state
        demos.backward(model, x, y)
        start = time.perf_counter()
        if guard is None:
            optimizer.step()
        else:
            guard.step()
        if i >= 5:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per row")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = sum(p.numel() for p in make_model().parameters())
    print(f"MLP with {n} parameters, fused AdamW, {args.threads} thread(s), CPU")
    print(f"median time of the step call over {args.steps} steps\n")
    print(f"{'optimizer.step() alone':28} {median_step_us(args.steps):8.0f} us")
    for sync in (True, False):
        for mode in ("none", "ignore", "clip"):
            label = f"StepGuard sync={sync} {mode}"
            print(f"{label:28} {median_step_us(args.steps, sync, mode):8.0f} us")


if __name__ == "__main__":
    main()
