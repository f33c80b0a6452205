"""Vanilla tanh RNNs on the addition problem: which gradient control lets plain SGD solve it?

One command, seeded and deterministic (same numbers on every rerun on the same machine):

    .venv/bin/python experiments/rnn_long_dependency.py

trains every (sequence length, method, seed) of :mod:`gradlab_book.figures.rnn` and writes
``gradlab-book/gradlab_book/data/rnn_long_dependency.json``, which the chapter
``book/training/rnn_long_dependency.ipynb`` loads. Each worker process uses one thread;
``--workers`` (default 2) sets how many run at once, which changes the wall time only.
``tests/book/test_experiments_rnn.py`` reruns a prefix of one run against the file.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from gradlab_book import stored
from gradlab_book.figures import rnn

LENGTHS = (5, 10, 15, 20)
SEEDS = (0, 1, 2, 3, 4)
SETUP = rnn.Setup()


def _calibrate(length: int) -> tuple[int, dict[str, float]]:
    torch.set_num_threads(1)
    return length, rnn.calibrate(length, SETUP)


def _train(job: tuple[int, str, int, dict[str, float]]) -> dict:
    torch.set_num_threads(1)
    length, method, seed, thresholds = job
    return rnn.train_run(length, method, seed, SETUP, thresholds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--out", type=Path, default=rnn.DATA_PATH, help="the JSON file to write")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        thresholds = dict(pool.map(_calibrate, LENGTHS))
        # longest first, so the slowest runs do not end up alone at the end
        jobs = [
            (length, method, seed, thresholds[length])
            for length in sorted(LENGTHS, reverse=True)
            for method in rnn.METHODS
            for seed in SEEDS
        ]
        runs = []
        for run in pool.map(_train, jobs):
            runs.append(run)
            outcome = (
                f"solved at {run['solved_at']}"
                if run["solved_at"] is not None
                else "diverged"
                if run["diverged"]
                else "not solved"
            )
            print(
                f"[{time.perf_counter() - start:6.0f}s] T={run['length']:<3} "
                f"{run['method']:12} seed {run['seed']}: {outcome}",
                flush=True,
            )
    runs.sort(key=lambda r: (r["length"], rnn.METHODS.index(r["method"]), r["seed"]))
    data = {
        "description": "addition problem, vanilla tanh RNN, plain SGD; written by "
        "experiments/rnn_long_dependency.py",
        "setup": rnn.setup_dict(SETUP),
        "lengths": list(LENGTHS),
        "methods": list(rnn.METHODS),
        "seeds": list(SEEDS),
        "thresholds": {str(length): thresholds[length] for length in LENGTHS},
        "runs": runs,
    }
    size = stored.write_json(args.out, data) / 1024
    print(f"wrote {args.out} ({size:.0f} KB) in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
