"""Time the adaptive thresholds and agc_ per step, against a bare optimizer.step().

A plain script, not a test. For the 394K-parameter MLP of bench_skip.py with fused
AdamW, it prints the median time of

* ``optimizer.step()`` alone (the reference, ratio 1);
* the total gradient norm (``gradlab.get_total_norm``), which a policy is fed;
* each policy's ``threshold(norm)`` then ``update(norm, accepted)``, at the default
  sizes (AutoClip sorts its 1000-slot window on every call);
* ``agc_`` over the model's parameters, with and without the foreach kernels;
* with ``--compile``, each policy's step compiled by inductor as well (about a
  minute of compilation first).

The calls are interleaved round by round, so a busy moment on a shared machine slows
all of them alike.

    .venv/bin/python benchmarks/bench_adaptive.py [--steps 200] [--threads 1] [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import gradlab
from gradlab.adaptive import AutoClip, SigmaSkip, ZClip, agc_


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 128))


def fill_gradients(model: nn.Module) -> None:
    x, y = torch.randn(64, 256), torch.randn(64, 128)
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()


def policy_step(policy, stat: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    tau = policy.threshold(stat)
    policy.update(stat, accepted)
    return tau


def policy_call(policy, compiled: bool = False) -> Callable[[], object]:
    """threshold then update on a fresh norm-like value each call, all accepted."""
    stats = [torch.tensor(1.0 + 0.01 * (i % 97)) for i in range(97)]
    accepted = torch.tensor(True)
    counter = iter(range(10**9))
    step = torch.compile(policy_step, fullgraph=True) if compiled else policy_step

    def call() -> None:
        step(policy, stats[next(counter) % len(stats)], accepted)

    # Fill the windows and end the warm-up, so that every timed call is a steady one.
    for _ in range(1100):
        call()
    return call


def cases(
    model: nn.Module, optimizer: torch.optim.Optimizer, compiled: bool
) -> dict[str, Callable[[], object]]:
    params = list(model.parameters())
    grads = [p.grad for p in params]
    head = params[-2:]  # the last Linear: the classifier AGC leaves alone
    extra = {}
    if compiled:
        extra = {
            "AutoClip, compiled": policy_call(AutoClip(), compiled=True),
            "ZClip, compiled": policy_call(ZClip(), compiled=True),
            "SigmaSkip, compiled": policy_call(SigmaSkip(), compiled=True),
        }
    return {
        "optimizer.step()": optimizer.step,
        "get_total_norm": lambda: gradlab.get_total_norm(grads),
        "AutoClip(0.9, 1000)": policy_call(AutoClip()),
        "ZClip(0.97, 2.5, 25)": policy_call(ZClip()),
        "SigmaSkip(6, 128, 64)": policy_call(SigmaSkip()),
        **extra,
        "agc_ foreach": lambda: agc_(params, foreach=True),
        "agc_ loop": lambda: agc_(params, foreach=False),
        "agc_ foreach, head excluded": lambda: agc_(params, exclude=head, foreach=True),
    }


def median_times_us(calls: dict[str, Callable[[], object]], steps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(steps + 5):  # the first rounds warm up caches and optimizer state
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if i >= 5:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) * 1e6 for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--compile", action="store_true", help="add compiled policies")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    fill_gradients(model)
    optimizer.step()  # create the optimizer state before timing
    n = sum(p.numel() for p in model.parameters())
    print(f"MLP with {n} parameters, fused AdamW, {args.threads} thread(s), CPU")
    print(f"median time per call over {args.steps} interleaved rounds\n")
    results = median_times_us(cases(model, optimizer, args.compile), args.steps)
    bare = results["optimizer.step()"]
    print(f"{'call':30} {'us':>8} {'/ step()':>9}")
    for name, us in results.items():
        print(f"{name:30} {us:8.1f} {us / bare:9.3f}")


if __name__ == "__main__":
    main()
