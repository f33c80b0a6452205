"""Record the gradient-norm traces that the adaptive-thresholds chapter replays.

One command, seeded and deterministic (same numbers on every rerun on the same machine),
one thread, well under a minute:

    .venv/bin/python experiments/record_norm_traces.py

trains the two uncontrolled runs of :func:`gradlab_book.figures.adaptive.record_traces`
(the chapter-7 MLP with 5% corrupted batches, and a 16-layer tanh chain at a high
learning rate, 600 steps each) and writes ``gradlab-book/gradlab_book/data/norm_traces.json``, which
``book/adaptive/adaptive_thresholds.ipynb`` loads, and their first
:data:`~gradlab_book.figures.adaptive.PREFIX_STEPS` steps, with the numeric platform, to
``norm_traces_prefix.json`` (``--prefix-only`` writes just that file).
``tests/book/test_experiments_traces.py`` reruns a prefix of both runs against both files.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from gradlab_book import stored
from gradlab_book.figures import adaptive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=adaptive.DATA_PATH, help="the JSON file to write"
    )
    parser.add_argument(
        "--prefix-out",
        type=Path,
        default=adaptive.PREFIX_PATH,
        help="the JSON file of the first steps to write",
    )
    parser.add_argument(
        "--prefix-only",
        action="store_true",
        help="only rerun the first steps and write norm_traces_prefix.json",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    files = [(args.prefix_out, adaptive.record_traces(steps=adaptive.PREFIX_STEPS))]
    if not args.prefix_only:
        files.append((args.out, adaptive.record_traces()))
    for path, data in files:
        size = stored.write_json(path, data) / 1024
        print(f"wrote {path} ({size:.0f} KB) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
