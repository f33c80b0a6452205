"""Record the gradient-norm traces that the adaptive-thresholds chapter replays.

One command, seeded and deterministic (same numbers on every rerun on the same machine),
one thread, well under a minute:

    .venv/bin/python experiments/record_norm_traces.py

trains the two uncontrolled runs of :func:`gradlab_book.figures.adaptive.record_traces`
(the chapter-7 MLP with 5% corrupted batches, and a 16-layer tanh chain at a high
learning rate, 600 steps each) and writes ``gradlab-book/gradlab_book/data/norm_traces.json``, which
``book/adaptive/adaptive_thresholds.ipynb`` loads.
``tests/book/test_experiments_traces.py`` reruns a prefix of both runs against the file.
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
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    data = adaptive.record_traces()
    size = stored.write_json(args.out, data) / 1024
    print(f"wrote {args.out} ({size:.0f} KB) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
