"""Time gradlab's clip and ignore functions against torch.nn.utils and two baselines.

    .venv/bin/python benchmarks/bench_clip.py                 # CPU, 10 repeats
    .venv/bin/python benchmarks/bench_clip.py --quick         # smaller sets, 5 repeats
    .venv/bin/python benchmarks/bench_clip.py --device cuda   # on a GPU

See benchmarks/README.md for what the columns mean.
"""

from __future__ import annotations

import argparse
import platform

import torch

from gradlab_book.benchmark import DEFAULT_CASES, QUICK_CASES, benchmark_table, format_table

TIMES = [
    "case",
    "get_total_norm",
    "clip_grad_norm_",
    "grad_ignore_norm_",
    "torch_clip_grad_norm_",
    "loop_ignore_norm_",
    "floor",
    "clip_grad_value_",
    "grad_ignore_value_",
    "torch_clip_grad_value_",
    "loop_ignore_value_",
]
RATIOS = [
    "case",
    "get_total_norm/torch",
    "clip_grad_norm_/torch",
    "grad_ignore_norm_/torch",
    "get_total_norm/floor",
    "clip_grad_norm_/floor",
    "grad_ignore_norm_/floor",
    "clip_grad_value_/torch",
    "grad_ignore_value_/torch",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per cell")
    parser.add_argument(
        "--quick", action="store_true", help="parameter sets of 1M numbers, 5 repeats"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument(
        "--statistic",
        choices=["median", "min"],
        default="median",
        help="median (default) or min of the timed runs; min suits a busy machine",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda asked for, but torch.cuda.is_available() is False")
    repeats = args.repeats or (5 if args.quick else 10)
    cases = QUICK_CASES if args.quick else DEFAULT_CASES

    where = args.device
    if args.device.startswith("cuda"):
        where += f" ({torch.cuda.get_device_name(args.device)})"
    print(
        f"torch {torch.__version__} on {where} ({platform.machine()}, "
        f"{torch.get_num_threads()} threads); {args.statistic} of {repeats} interleaved runs "
        "after 2 warm-ups"
    )
    rows = benchmark_table(cases, device=args.device, repeats=repeats, statistic=args.statistic)
    print(f"\nTime per call, ms ({args.statistic})\n")
    print(format_table(rows, TIMES))
    print("\nRatios (below 1: faster than the reference)\n")
    print(format_table(rows, RATIOS))


if __name__ == "__main__":
    main()
