"""Clip versus ignore: the grid of thresholds and corruption rates behind the explorable.

One command, seeded and deterministic (the same numbers on every rerun on the same
machine):

    .venv/bin/python experiments/clip_vs_ignore_grid.py

calibrates the thresholds on clean runs, trains every method of
:mod:`gradlab_book.figures.training` at the 90th, 95th and 99th percentile and at 0%,
10% and 20% corrupted batches, on seeds 0, 1 and 2 (162 runs of 150 steps, about 20 s
on one core), and writes ``gradlab-book/gradlab_book/data/clip_vs_ignore_grid.json``,
which the chapter ``book/training/clip_vs_ignore.ipynb`` loads.
``tests/book/test_experiments_clip_vs_ignore.py`` reruns some of the runs against the file.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from gradlab_book import stored
from gradlab_book.figures import training

PERCENTILES = (90, 95, 99)
RATES = (0.0, 0.1, 0.2)
SEEDS = (0, 1, 2)
SETUP = training.Setup()


def compute() -> dict:
    """The grid as JSON-ready values, with the clean statistics' thresholds."""
    norms, maxes = training.clean_statistics(SETUP)
    grid = training.experiment_grid(
        list(PERCENTILES), list(RATES), norms, maxes, seeds=SEEDS, setup=SETUP
    )
    data = training.grid_to_dict(grid)
    data = {
        "description": "clip versus ignore on a small MLP with corrupted batches; written "
        "by experiments/clip_vs_ignore_grid.py",
        "percentiles": list(PERCENTILES),
        "rates": list(RATES),
        "seeds": list(SEEDS),
        **data,
    }
    return data


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
