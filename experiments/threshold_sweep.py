"""Record the learning-rate sweep of the chapter on choosing a threshold, over seeds.

One command, seeded and deterministic (the same numbers on every rerun on the same
machine), one thread, about a minute:

    .venv/bin/python experiments/threshold_sweep.py

runs :func:`gradlab_book.figures.thresholds.record_sweep`: for each of five seeds, the
warm-up threshold of the chapter's logged run (the 90th percentile of the finite norms of
steps 51 to 100 at learning rate 0.01), then at each learning rate of the chapter's
table and of its re-tuning exercise three runs of 300 steps of SGD with momentum: clipped
at that threshold, at the 90th percentile of that run's own norms after step 100, and
with no threshold. It writes ``gradlab-book/gradlab_book/data/threshold_sweep.json``
with the numeric platform, which ``book/adaptive/choosing_threshold.ipynb`` loads.
The runs above a learning rate of about 0.05 are chaotic: on another CPU their clip
rates and losses differ, seed by seed, which is why the chapter reports them over seeds.
``tests/book/test_experiments_sweep.py`` reruns a prefix against the file.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from gradlab_book import stored
from gradlab_book.figures import thresholds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=thresholds.SWEEP_PATH, help="the JSON file to write"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.process_time()
    data = thresholds.record_sweep()
    size = stored.write_json(args.out, data) / 1024
    print(f"wrote {args.out} ({size:.0f} KB) in {time.process_time() - start:.1f} s of CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
