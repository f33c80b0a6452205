"""gradlab's clip and ignore functions against torch.nn.utils, the reference loop and the floor.

A plain script, not a test. Two kinds of table, each variant timed side by side with
the others in interleaved rounds (benchmarks/harness.py: thread CPU time, one torch
thread, ratios min/min and paired):

* **cases** (``--tables cases``): four parameter sets, 10 x 1M, 300 x 33K and
  3000 x 3.3K floats (10M in all) and 3000 x 100 (300K), each in three families, with
  the ratios against torch's own function:

  - ``norm``: ``torch.nn.utils.get_total_norm`` (the baseline),
    ``gradlab.get_total_norm``, and the floors;
  - ``clip``: ``torch.nn.utils.clip_grad_norm_`` (the baseline),
    ``gradlab.clip_grad_norm_``, ``gradlab.grad_ignore_norm_``, the per-tensor loop of
    the reference walk-through (``gradlab_book.benchmark.loop_ignore_norm_``: a norm per
    tensor, stacked, and a Python ``if`` on a tensor, which reads the host), and
    ``floor_norm``;
  - ``value``: ``torch.nn.utils.clip_grad_value_`` (the baseline),
    ``gradlab.clip_grad_value_``, ``gradlab.grad_ignore_value_``, the reference value
    loop (one host read per tensor) and ``floor_norm``;

* **sweep** (``--tables sweep``): 1,000,000 floats split into 1 to 3,000 equal tensors;
  at each split the chapter's eight implementations (the two reference loops, and
  gradlab's and torch's clip and ignore with ``foreach=False`` and ``foreach=True``;
  ``gradlab_book.benchmark.IMPLEMENTATIONS``) against ``floor_norm``, the baseline.

The floors, over one contiguous tensor of the same numbers: ``floor_norm``, one
:func:`torch.linalg.vector_norm` (the least torch's norm kernel costs), and
``floor_sum``, one ``sum()`` (a plain read: cheaper than the norm while the numbers sit
in the cache, where one thread's norm is bound by its arithmetic). Each row's note is
its time over ``floor_norm`` (min/min). Thresholds are above every norm and entry, so
nothing is clipped or ignored and each call does the work of a healthy step.

    .venv/bin/python benchmarks/bench_clip.py [--rounds 40] [--quick] [--json PATH]
    .venv/bin/python benchmarks/bench_clip.py --tables sweep --sizes 10,1000
    .venv/bin/python benchmarks/bench_clip.py --device cuda    # wall clock, synchronised
"""

from __future__ import annotations

import argparse
import os
import platform
import re
from collections.abc import Callable
from pathlib import Path

import torch
from harness import Row, compare, format_rows, setup_threads, write_json
from torch import Tensor

import gradlab
from gradlab_book.benchmark import (
    IMPLEMENTATIONS,
    floor_norm,
    loop_ignore_norm_,
    loop_ignore_value_,
    make_parameters,
)

#: name -> (tensors, numbers in all)
CASES = {
    "10 x 1M": (10, 10_000_000),
    "300 x 33K": (300, 10_000_000),
    "3000 x 3.3K": (3000, 10_000_000),
    "3000 x 100": (3000, 300_000),
}
#: The same shapes with 10x fewer numbers, for --quick.
QUICK_CASES = {
    "10 x 100K": (10, 1_000_000),
    "300 x 3.3K": (300, 1_000_000),
    "3000 x 333": (3000, 1_000_000),
    "3000 x 100": (3000, 300_000),
}
SWEEP_SIZES = (1, 3, 10, 30, 100, 300, 1000, 3000)
SWEEP_ELEMENTS = 1_000_000
FLOOR = "floor_norm"


def floors(flat: Tensor) -> dict[str, Callable[[], object]]:
    """The one-tensor floors over ``flat``."""
    return {FLOOR: lambda: floor_norm(flat), "floor_sum": lambda: flat.sum()}


def case_families(
    k: int, total: int, device: str
) -> dict[str, tuple[str, dict[str, Callable[[], object]]]]:
    """family -> (its baseline, name -> call) for one parameter set."""
    params = make_parameters(k, total, device=device)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    # Above the norm and the largest entry: nothing is ever clipped or ignored.
    max_norm = 2.0 * float(torch.linalg.vector_norm(flat)) + 1.0
    clip_value = 2.0 * float(flat.abs().max()) + 1.0
    u, g = torch.nn.utils, gradlab
    base = floors(flat)
    return {
        "norm": (
            "torch get_total_norm",
            {
                "torch get_total_norm": lambda: u.get_total_norm(grads),
                "gradlab get_total_norm": lambda: g.get_total_norm(grads),
                **base,
            },
        ),
        "clip": (
            "torch clip_grad_norm_",
            {
                "torch clip_grad_norm_": lambda: u.clip_grad_norm_(params, max_norm),
                "gradlab clip_grad_norm_": lambda: g.clip_grad_norm_(params, max_norm),
                "gradlab grad_ignore_norm_": lambda: g.grad_ignore_norm_(params, max_norm),
                "reference loop_ignore_norm_": lambda: loop_ignore_norm_(params, max_norm),
                FLOOR: base[FLOOR],
            },
        ),
        "value": (
            "torch clip_grad_value_",
            {
                "torch clip_grad_value_": lambda: u.clip_grad_value_(params, clip_value),
                "gradlab clip_grad_value_": lambda: g.clip_grad_value_(params, clip_value),
                "gradlab grad_ignore_value_": lambda: g.grad_ignore_value_(params, clip_value),
                "reference loop_ignore_value_": lambda: loop_ignore_value_(params, clip_value),
                FLOOR: base[FLOOR],
            },
        ),
    }


def sweep_calls(k: int, total: int, device: str) -> dict[str, Callable[[], object]]:
    """The floors and the chapter's implementations on ``total`` floats in ``k`` tensors."""
    params = make_parameters(k, total, device=device)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    calls = floors(flat)
    for name, fn in IMPLEMENTATIONS.items():
        calls[name] = lambda fn=fn: fn(params)
    return calls


def note_floor(rows: list[Row]) -> list[Row]:
    """Each row's note: its time over floor_norm's (min/min)."""
    floor = next(r for r in rows if r.name == FLOOR).min_us
    for r in rows:
        r.note = f"{r.min_us / floor:.3g}x {FLOOR}"
    return rows


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return found.group(1).strip() if found else platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds per table")
    parser.add_argument("--quick", action="store_true", help="10 rounds, sets of 1M floats")
    parser.add_argument(
        "--block-ms", type=float, default=20.0, help="length of a timed block (default 20)"
    )
    parser.add_argument(
        "--tables", default="cases,sweep", help="cases, sweep or both (default: cases,sweep)"
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help=f"tensor counts of the sweep (default: {','.join(map(str, SWEEP_SIZES))})",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--json", default=None, help="write every table to this JSON file")
    args = parser.parse_args()
    tables_asked = {t.strip() for t in args.tables.split(",")}
    if not tables_asked <= {"cases", "sweep"} or not tables_asked:
        parser.error(f"--tables takes cases, sweep or both, got {args.tables!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda asked for, but torch.cuda.is_available() is False")
    try:
        sizes = SWEEP_SIZES if args.sizes is None else tuple(int(s) for s in args.sizes.split(","))
    except ValueError:
        parser.error(f"--sizes takes comma-separated integers, got {args.sizes!r}")
    if any(s < 1 for s in sizes):
        parser.error("--sizes must be positive")
    setup_threads(1)
    rounds = 10 if args.quick else args.rounds
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    clock = "thread CPU time" if device == "cpu" else "wall clock between CUDA synchronisations"
    where = cpu_model() if device == "cpu" else torch.cuda.get_device_name(args.device)
    settings = {
        "torch": torch.__version__,
        "device": device,
        "machine": f"{where}; {platform.machine()}, {os.cpu_count()} CPUs, 1 torch thread",
        "capability": torch.backends.cpu.get_cpu_capability(),
        "clock": f"{clock}, interleaved rounds",
        "rounds": rounds,
        "block_ms": args.block_ms,
        "dtype": "float32",
        "sweep_elements": SWEEP_ELEMENTS,
    }
    print(
        f"torch {torch.__version__}, {settings['machine']}; {rounds} rounds of {clock}; "
        "µs per call (min, median); ratios min/min and paired"
    )
    tables: dict[str, list[Row]] = {}
    if "cases" in tables_asked:
        for label, (k, total) in (QUICK_CASES if args.quick else CASES).items():
            print(f"\n== {label}: {k} tensors, {total:,} floats")
            for family, (baseline, calls) in case_families(k, total, device).items():
                rows = compare(
                    calls, baseline, rounds=rounds, block_ms=args.block_ms, device=device
                )
                tables[f"{label} {family}"] = note_floor(rows)
                print(format_rows(rows, f"\n{family} (ratios to {baseline})"))
    if "sweep" in tables_asked:
        print(f"\n== sweep: {SWEEP_ELEMENTS:,} floats in k tensors (ratios to {FLOOR})")
        for k in sizes:
            rows = compare(
                sweep_calls(k, SWEEP_ELEMENTS, device),
                FLOOR,
                rounds=rounds,
                block_ms=args.block_ms,
                device=device,
            )
            tables[f"sweep k={k}"] = rows
            print(format_rows(rows, f"\nk={k}"))
    if args.json:
        write_json(args.json, tables, settings)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
