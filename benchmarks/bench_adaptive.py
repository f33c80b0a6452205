"""Time the adaptive thresholds and agc_ per step, against one fused AdamW step.

A plain script, not a test. For the 394K-parameter MLP of bench_skip.py with fused
AdamW, it prints the median thread CPU time (``time.thread_time_ns``) of

* ``optimizer.step()`` alone, fused AdamW (the reference, ratio 1);
* the total gradient norm (``gradlab.get_total_norm``), which a policy is fed;
* each policy's ``threshold(norm)`` then ``update(norm, taken)`` in a steady state:
  AutoClip's whole history (the paper's rule) after 1,100 and after 100,000 steps
  (its ``update`` is a pass over the history), the windowed AutoClip (1000 slots,
  sorted at every call), ZClip and SigmaSkip at their defaults;
* ``agc_`` over the model's parameters, with and without the foreach kernels;
* with ``--compile``, the fixed-size policies' step compiled by inductor as well (about
  a minute of compilation first).

The calls are interleaved round by round, so that a busy moment on a shared machine
slows all of them alike, and timed by the CPU time of this thread, which another
process's load does not add to. torch runs on this one thread (``set_num_threads(1)``),
so that the thread's time is all of the work.

    .venv/bin/python benchmarks/bench_adaptive.py [--steps 300] [--compile]
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


def policy_step(policy, stat: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
    tau = policy.threshold(stat)
    policy.update(stat, taken)
    return tau


def long_history(steps: int) -> AutoClip:
    """AutoClip's whole history as after ``steps`` steps of norm-like values, loaded from
    a state (filling it call by call would take minutes)."""
    policy = AutoClip()
    state = policy.state_dict()
    size = 1024
    while size <= steps:
        size *= 2
    history = torch.full((size,), torch.inf)
    history[:steps] = (
        (1.0 + torch.rand(steps, generator=torch.Generator().manual_seed(0))).sort().values
    )
    state["state"] = {"history": history, "count": torch.tensor(steps)}
    policy.load_state_dict(state)
    return policy


def policy_call(policy, compiled: bool = False, warm: int = 1100) -> Callable[[], object]:
    """threshold then update on a fresh norm-like value each call, every step taken."""
    stats = [torch.tensor(1.0 + 0.01 * (i % 97)) for i in range(97)]
    taken = torch.tensor(True)
    counter = iter(range(10**9))
    step = torch.compile(policy_step, fullgraph=True) if compiled else policy_step

    def call() -> None:
        step(policy, stats[next(counter) % len(stats)], taken)

    # Fill the windows and end the warm-up, so that every timed call is a steady one.
    for _ in range(warm):
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
            "AutoClip(90, 1000), compiled": policy_call(
                AutoClip(percentile=90.0, window=1000), compiled=True
            ),
            "ZClip(), compiled": policy_call(ZClip(), compiled=True),
            "SigmaSkip(), compiled": policy_call(SigmaSkip(), compiled=True),
        }
    return {
        "AdamW(fused).step()": optimizer.step,
        "get_total_norm": lambda: gradlab.get_total_norm(grads),
        "AutoClip() at 1,100 steps": policy_call(AutoClip()),
        "AutoClip() at 100,000 steps": policy_call(long_history(100_000), warm=10),
        "AutoClip(90, window=1000)": policy_call(AutoClip(percentile=90.0, window=1000)),
        "ZClip()": policy_call(ZClip()),
        "SigmaSkip()": policy_call(SigmaSkip()),
        'SigmaSkip(steps="taken")': policy_call(SigmaSkip(steps="taken")),
        **extra,
        "agc_ foreach": lambda: agc_(params, foreach=True),
        "agc_ loop": lambda: agc_(params, foreach=False),
        "agc_ foreach, head excluded": lambda: agc_(params, exclude=head, foreach=True),
    }


def median_thread_times_us(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    times: dict[str, list[int]] = {name: [] for name in calls}
    for i in range(rounds + 5):  # the first rounds warm up caches and optimizer state
        for name, call in calls.items():
            start = time.thread_time_ns()
            call()
            if i >= 5:
                times[name].append(time.thread_time_ns() - start)
    return {name: statistics.median(ts) / 1e3 for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="timed rounds")
    parser.add_argument("--compile", action="store_true", help="add compiled policies")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    fill_gradients(model)
    optimizer.step()  # create the optimizer state before timing
    n = sum(p.numel() for p in model.parameters())
    print(f"MLP with {n} parameters, fused AdamW, 1 thread, CPU, torch {torch.__version__}")
    print(f"median thread CPU time per call over {args.steps} interleaved rounds\n")
    results = median_thread_times_us(cases(model, optimizer, args.compile), args.steps)
    bare = results["AdamW(fused).step()"]
    print(f"{'call':30} {'us':>8} {'/ step()':>9}")
    for name, us in results.items():
        print(f"{name:30} {us:8.1f} {us / bare:9.3f}")


if __name__ == "__main__":
    main()
