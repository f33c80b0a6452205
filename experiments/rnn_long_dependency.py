"""Vanilla tanh RNNs on the addition problem: a sweep of learning rate x length x control.

One command, seeded and deterministic (the same numbers on every rerun on the same
numeric platform, :func:`gradlab_book.stored.platform`):

    nice -n 10 .venv/bin/python experiments/rnn_long_dependency.py

calibrates the thresholds of every length on calm uncontrolled runs
(:func:`gradlab_book.figures.rnn.calibrate`), then trains every (length, learning rate,
control, seed) of :data:`LENGTHS` x :data:`LRS` x :data:`gradlab_book.figures.rnn.CONTROLS`
x :data:`SEEDS`, one batched group per (length, seed)
(:func:`gradlab_book.figures.rnn.train_group`), and writes
``gradlab-book/gradlab_book/data/rnn_long_dependency.json``, which the chapter
``book/training/rnn_long_dependency.ipynb`` loads. Each worker process uses one thread;
``--workers`` (default 2) changes the wall time only. About three and a half minutes of
CPU time (209 s of training when last recorded: a (length, seed) group takes about 10 s
at T = 20, 12 s at T = 30 and 20 s at T = 50).
``tests/book/test_experiments_rnn.py`` reruns a prefix of one group against the file.
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

LENGTHS = (20, 30, 50)
LRS = (0.1, 0.3, 1.0)
SEEDS = (0, 1, 2, 3, 4)
SETUP = rnn.Setup()


def group(length: int, seed: int) -> list[tuple[float, str, int]]:
    """The runs trained together: every (learning rate, control) of one seed."""
    return [(lr, control, seed) for lr in LRS for control in rnn.CONTROLS]


def _calibrate(length: int) -> tuple[int, dict]:
    torch.set_num_threads(1)
    return length, rnn.calibrate(length, SETUP)


def _train(job: tuple[int, int, dict]) -> tuple[list[dict], float]:
    torch.set_num_threads(1)
    length, seed, thresholds = job
    start = time.process_time()
    runs = rnn.train_group(length, group(length, seed), thresholds, SETUP)
    return runs, time.process_time() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--out", type=Path, default=rnn.DATA_PATH, help="the JSON file to write")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        thresholds = dict(pool.map(_calibrate, LENGTHS))
        jobs = [(t, s, thresholds[t]) for t in sorted(LENGTHS, reverse=True) for s in SEEDS]
        runs, cpu = [], 0.0
        for done, seconds in pool.map(_train, jobs):
            runs += done
            cpu += seconds
            r = done[0]
            print(
                f"[{time.perf_counter() - start:6.0f}s] T={r['length']} seed {r['seed']}: "
                f"{seconds:.0f} s CPU, "
                f"{sum(x['solved_at'] is not None for x in done)} solved, "
                f"{sum(x['diverged'] for x in done)} diverged of {len(done)}",
                flush=True,
            )
    order = {c: i for i, c in enumerate(rnn.CONTROLS)}
    runs.sort(key=lambda r: (r["length"], r["lr"], order[r["control"]], r["seed"]))
    data = {
        "description": "addition problem, vanilla tanh RNN, plain SGD; written by "
        "experiments/rnn_long_dependency.py",
        "platform": stored.platform(),
        "setup": rnn.setup_dict(SETUP),
        "lengths": list(LENGTHS),
        "lrs": list(LRS),
        "controls": list(rnn.CONTROLS),
        "seeds": list(SEEDS),
        "thresholds": {str(t): thresholds[t] for t in LENGTHS},
        "train_cpu_s": round(cpu),
        "runs": runs,
    }
    size = stored.write_json(args.out, data) / 1024
    wall = time.perf_counter() - start
    print(f"wrote {args.out} ({size:.0f} KB) in {wall:.0f} s wall, {cpu:.0f} s CPU (training)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
