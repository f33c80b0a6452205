"""Time StepGuard's exact skip against the norm plus the optimizer step it replaces.

A plain script, not a test. For a 394K- and a ~30M-parameter MLP it prints, side by side,
the median time of one step call (gradients fixed, so only the step is timed):

* the sync-free guard on fused AdamW (``found_inf`` path) against ``get_total_norm(grads)``
  plus ``optimizer.step()``, target at most 1.15x;
* the sync=True guard against the norm, one host read and the step, target at most 1.1x;
* the snapshot/select path (non-fused AdamW, sync=False) against its own norm plus step;

with the host reads per step after the first and the memory the guard holds.

    .venv/bin/python benchmarks/bench_skip.py [--repeats 10] [--threads 1] [--quick]
        [--statistic median|min]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from torch import Tensor, nn

import gradlab
from gradlab.sync import HostReadCounter
from gradlab_book.benchmark import time_calls

SIZES = {"394K": (256, 1024, 128), "30M": (2048, 4096, 4096, 1024)}


def make_model(widths: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    x = torch.randn(32, widths[0])
    nn.functional.mse_loss(model(x), torch.randn(32, widths[-1])).backward()
    return model


def guard_bytes(guard: gradlab.StepGuard) -> int:
    """Bytes of the tensors the guard holds itself: counters, flag, thresholds and
    decision codes, snapshot buffers; a storage shared by views counted once."""
    held = [v for v in vars(guard).values() if isinstance(v, Tensor)]
    held += [v for v in vars(guard._threshold).values() if isinstance(v, Tensor)]
    for codes in guard._device_codes.values():
        held += vars(codes).values()
    if guard._transaction is not None:
        held += guard._transaction.buffers
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    return sum(storages.values())


def reads_after_first(step, n: int = 5) -> int:
    """Host reads per call of ``step``, the worst of ``n`` calls after a first one."""
    step()
    counts = []
    for _ in range(n):
        with HostReadCounter() as reads:
            step()
        counts.append(reads.count)
    return max(counts)


def bench_size(
    widths: tuple[int, ...], repeats: int, statistic: str = "median"
) -> list[tuple[str, float, float, int, int]]:
    """Rows (label, time in ms, ratio to its baseline, host reads per step, guard bytes)."""

    def setup(fused: bool, sync: bool | None):
        model = make_model(widths)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused or None)
        guard = None
        if sync is not None:
            guard = gradlab.StepGuard(opt, threshold=1e9, sync=sync)
        grads = [p.grad for p in model.parameters()]
        return opt, guard, grads

    fused_opt, _, fused_grads = setup(True, None)
    _, nosync, _ = setup(True, False)
    sync_opt, sync, sync_grads = setup(True, True)
    plain_opt, _, plain_grads = setup(False, None)
    _, snapshot, _ = setup(False, False)

    def norm_step() -> None:
        gradlab.get_total_norm(fused_grads)
        fused_opt.step()

    def norm_read_step() -> None:
        if gradlab.get_total_norm(sync_grads).item() < 1e9:
            sync_opt.step()

    def plain_norm_step() -> None:
        gradlab.get_total_norm(plain_grads)
        plain_opt.step()

    calls = {
        "norm + step (fused AdamW)": norm_step,
        "guard sync=False (fused)": nosync.step,
        "norm + 1 read + step (fused)": norm_read_step,
        "guard sync=True (fused)": sync.step,
        "norm + step (AdamW, for-loop)": plain_norm_step,
        "guard sync=False (snapshot)": snapshot.step,
    }
    reads = {name: reads_after_first(fn) for name, fn in calls.items()}
    times = time_calls(calls, repeats=repeats, warmup=2, statistic=statistic)
    baseline = {
        "guard sync=False (fused)": "norm + step (fused AdamW)",
        "guard sync=True (fused)": "norm + 1 read + step (fused)",
        "guard sync=False (snapshot)": "norm + step (AdamW, for-loop)",
    }
    held = {
        "guard sync=False (fused)": guard_bytes(nosync),
        "guard sync=True (fused)": guard_bytes(sync),
        "guard sync=False (snapshot)": guard_bytes(snapshot),
    }
    return [
        (
            name,
            times[name] * 1e3,
            times[name] / times[baseline[name]] if name in baseline else 1.0,
            reads[name],
            held.get(name, 0),
        )
        for name in calls
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds per row")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="the 394K model only")
    parser.add_argument(
        "--statistic", default="median", choices=["median", "min"], help="min: for a busy machine"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU, {args.threads} thread(s), {args.statistic} of {args.repeats} interleaved rounds")
    print("reads: host reads per step after the first; held: bytes the guard keeps\n")
    header = f"{'model':6} {'step call':30} {'ms':>9} {'ratio':>6} {'reads':>5} {'held':>12}"
    print(header)
    print("-" * len(header))
    for size, widths in SIZES.items():
        if args.quick and size != "394K":
            continue
        n = sum(p.numel() for p in make_model(widths).parameters())
        for name, ms, ratio, reads, held in bench_size(widths, args.repeats, args.statistic):
            shown = f"{ratio:5.2f}x" if name.startswith("guard") else ""
            held_text = f"{held:,} B" if name.startswith("guard") else ""
            print(f"{size:6} {name:30} {ms:9.3f} {shown:>6} {reads:5d} {held_text:>12}")
        print(f"{'':6} ({n:,} parameters)")


if __name__ == "__main__":
    main()
