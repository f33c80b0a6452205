"""The cost of an exact skip: step_if_ and StepGuard against the norm plus the step they replace.

A plain script, not a test. For a 394K-parameter MLP (4 tensors) and a 29M-parameter one
(6 tensors), with fused AdamW and gradients fixed (so that every call does the work of a
healthy step: thresholds above the norm, nothing skipped), it prints side by side:

* the baseline: ``gradlab.get_total_norm(grads)`` plus ``optimizer.step()``;
* the best alternative with torch alone: torch's norm, a decision written into the
  fused optimizer's ``found_inf``, then the step (three lines, sync-free);
* GradScaler used as a skip (``init_scale=1``), the other sync-free skip torch offers;
* ``step_if_(optimizer, keep_by_norm(norm, t), sync=False)``: target at most 1.05x at
  394K, 1.02x at 29M;
* ``StepGuard(sync=False)``: target at most 1.10x at 394K, 1.02x at 29M;
* ``StepGuard(sync=True)`` beside the norm, one host read and the step;
* the snapshot path (AdamW without ``fused``), beside its own norm plus step;

each with the host reads per step after the first and the bytes held for the skip.
Timed by each thread's CPU time over interleaved rounds (benchmarks/harness.py); the
ratios are min/min and paired (the median of the rounds' ratios).

    .venv/bin/python benchmarks/bench_skip.py [--rounds 40] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from harness import compare, format_rows, setup_threads, write_json
from torch import Tensor, nn

import gradlab
from gradlab.step import snapshot_buffers
from gradlab.sync import HostReadCounter

SIZES = {"394K": (256, 1024, 128), "29M": (2048, 4096, 4096, 1024)}
HIGH = 1e9  # above every norm: each call does the work of a step that is taken


def make_model(widths: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    x = torch.randn(32, widths[0])
    nn.functional.mse_loss(model(x), torch.randn(32, widths[-1])).backward()
    return model


def reads_after_first(step, n: int = 5) -> int:
    """Host reads per call of ``step``, the worst of ``n`` calls after a first one."""
    step()
    counts = []
    for _ in range(n):
        with HostReadCounter() as reads:
            step()
        counts.append(reads.count)
    return max(counts)


def held_bytes(guard: gradlab.StepGuard | None, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors kept for the skip: the guard's counters, the snapshot."""
    held: list[Tensor] = (
        [] if guard is None else [v for v in vars(guard).values() if isinstance(v, Tensor)]
    )
    held += snapshot_buffers(optimizer)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    return sum(storages.values())


def variants(widths: tuple[int, ...]) -> tuple[dict, dict, dict]:
    """(name -> step call, name -> baseline name, name -> note) for one model size."""

    def setup(fused: bool):
        model = make_model(widths)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused or None)
        return opt, [p.grad for p in model.parameters()]

    # One model and optimizer for every fused variant, one for both for-loop ones: every
    # step is taken (the threshold is HIGH), so the variants do the same work on the same
    # memory (separate copies of a model, placed apart, ran 5-20 % apart on their own).
    calls, notes = {}, {}
    fused = setup(True)
    plain = setup(False)
    opt, grads = fused

    def norm_step(opt=opt, grads=grads) -> None:
        gradlab.get_total_norm(grads)
        opt.step()

    calls["norm + step"] = norm_step
    flag = torch.zeros(())

    def diy_found_inf(opt=opt, grads=grads) -> None:
        norm = torch.nn.utils.get_total_norm(grads)
        torch.logical_not(norm <= HIGH, out=flag)
        opt.found_inf = flag
        opt.step()
        del opt.found_inf

    calls["torch norm, found_inf, step (DIY)"] = diy_found_inf
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=2**30)
    scaler.scale(torch.ones(()))  # makes its scale tensor, as scaling a loss would

    def scaler_step(opt=opt, scaler=scaler) -> None:
        scaler.step(opt)
        scaler.update()

    calls["GradScaler as a skip"] = scaler_step

    def step_if(opt=opt, grads=grads) -> None:
        norm = gradlab.get_total_norm(grads)
        gradlab.step_if_(opt, gradlab.keep_by_norm(norm, HIGH), sync=False)

    calls["step_if_ sync=False"] = step_if
    guard = gradlab.StepGuard(opt, threshold=HIGH, sync=False)
    calls["StepGuard sync=False"] = guard.step
    notes["StepGuard sync=False"] = f"{held_bytes(guard, opt)} B held"

    def norm_read_step(opt=opt, grads=grads) -> None:
        if gradlab.get_total_norm(grads).item() < HIGH:
            opt.step()

    calls["norm, 1 read, step"] = norm_read_step
    sync_guard = gradlab.StepGuard(opt, threshold=HIGH, sync=True)
    calls["StepGuard sync=True"] = sync_guard.step
    opt, grads = plain

    def plain_norm_step(opt=opt, grads=grads) -> None:
        gradlab.get_total_norm(grads)
        opt.step()

    calls["norm + step (AdamW, not fused)"] = plain_norm_step
    snap_guard = gradlab.StepGuard(opt, threshold=HIGH, sync=False)
    calls["StepGuard sync=False (snapshot)"] = snap_guard.step
    baselines = {name: "norm + step" for name in calls}
    baselines["StepGuard sync=True"] = "norm, 1 read, step"
    baselines["StepGuard sync=False (snapshot)"] = "norm + step (AdamW, not fused)"
    for name, fn in calls.items():
        reads = f"{reads_after_first(fn)} reads"
        notes[name] = f"{reads}, {notes[name]}" if name in notes else reads
    snap_guard.step()
    notes["StepGuard sync=False (snapshot)"] += f", {held_bytes(snap_guard, opt):,} B held"
    return calls, baselines, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="the 394K model only")
    parser.add_argument("--json", help="also write the tables to this JSON file")
    args = parser.parse_args()
    setup_threads(args.threads)
    print(f"CPU time per thread, {args.threads} torch thread(s), {args.rounds} rounds\n")
    tables = {}
    for size, widths in SIZES.items():
        if args.quick and size != "394K":
            continue
        calls, baselines, notes = variants(widths)
        n = sum(p.numel() for p in make_model(widths).parameters())
        for name, base in baselines.items():
            if base != "norm + step":
                notes[name] = f"vs {base!r}; {notes[name]}"
        rows = compare(calls, baselines, rounds=args.rounds, notes=notes)
        tables[size] = rows
        print(format_rows(rows, f"{size}: {n:,} parameters, fused AdamW unless said"))
        print()
    if args.json:
        write_json(args.json, tables, {"rounds": args.rounds, "threads": args.threads})


if __name__ == "__main__":
    main()
