"""Clip versus ignore: every control at seven thresholds, three corruption rates, five seeds.

One command, seeded and deterministic (the same numbers on every rerun on the same
machine):

    nice -n 10 .venv/bin/python experiments/clip_vs_ignore_grid.py

calibrates the thresholds on three clean runs, trains every method of
:mod:`gradlab_book.figures.training` (no control, the five controls, the skip with a
limit and the hybrid clip + skip) at seven percentiles of the clean norms and at 0%,
10% and 20% corrupted batches, on seeds 0 to 4 (753 runs of 150 steps, about 3 minutes
of CPU time on one core), and writes
``gradlab-book/gradlab_book/data/clip_vs_ignore_grid.json`` with the numeric platform
that computed it (:func:`gradlab_book.stored.platform`). The chapter
``book/training/clip_vs_ignore.ipynb`` loads it; its threshold exercise is scored on two
of the runs stored here; ``tests/book/test_experiments_clip_vs_ignore.py`` reruns some
of them against the file.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from gradlab_book import stored
from gradlab_book.figures import training

PERCENTILES = (70, 80, 90, 95, 97.5, 99, 99.9)
RATES = (0.0, 0.1, 0.2)
SEEDS = (0, 1, 2, 3, 4)
SETUP = training.Setup()
CALIBRATION_SEEDS = (900, 901, 902)
WARMUP_STEPS = 20  # the threshold exercise's "first healthy steps" of each clean run
#: The runs the threshold exercise is scored on: (percentile, rate, seed) of a skip run,
#: whose recorded norms are those of every step (nothing it skipped moved the weights).
THRESHOLD_RUNS = {"seen": (95, 0.1, 0), "unseen": (95, 0.2, 3)}


def _f32(values) -> list:
    return [training.float32_text(float(v)) for v in values]


def compute() -> dict:
    """The grid, the calibration and the exercise's runs, as JSON-ready values."""
    runs = [training.train_run("none", s, 0.0, None, SETUP) for s in CALIBRATION_SEEDS]
    norms, maxes = training.clean_statistics(SETUP, CALIBRATION_SEEDS)  # the same runs again
    grid = training.experiment_grid(
        list(PERCENTILES), list(RATES), norms, maxes, seeds=SEEDS, setup=SETUP
    )
    exercise = {}
    for name, (q, r, seed) in THRESHOLD_RUNS.items():
        run = next(x for x in grid[(q, r)].runs["skip"] if x.seed == seed)
        exercise[name] = {
            "percentile": q,
            "rate": r,
            "seed": seed,
            "total_norm": _f32(run.total_norm),
            "corrupted": training.bits_to_hex(run.corrupted),
        }
    return {
        "description": "clip versus ignore on a small MLP with corrupted batches; written "
        "by experiments/clip_vs_ignore_grid.py",
        "platform": stored.platform(),
        "percentiles": list(PERCENTILES),
        "rates": list(RATES),
        "seeds": list(SEEDS),
        "calibration": {
            "seeds": list(CALIBRATION_SEEDS),
            "total_norm": [_f32(run.total_norm) for run in runs],
            "max_abs": [_f32(run.max_abs) for run in runs],
            "warmup_steps": WARMUP_STEPS,
        },
        "threshold_runs": exercise,
        **training.grid_to_dict(grid),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=training.GRID_PATH, help="the JSON file to write"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    data = compute()
    size = stored.write_json(args.out, data) / 1024
    print(f"wrote {args.out} ({size:.0f} KB) in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
