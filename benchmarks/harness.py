"""The one timing harness of the benchmarks: CPU time per thread, interleaved rounds.

The machines the benchmarks run on are shared, so wall-clock time counts the time other
jobs hold the core. With one torch thread every kernel runs on the calling thread, and
``time.thread_time_ns`` counts only the time this thread ran. Each round times every
variant once, in a new random order, as a block of ``inner`` back-to-back calls (chosen
so that a block lasts about ``block_ms``), so that drifts of the machine fall on all
variants alike. A ratio is given two ways:

* min/min: the fastest block of a variant over the fastest block of the baseline;
* paired: the median over rounds of that round's ratio, which a busy stretch of the
  machine moves less than either minimum.

On a CUDA device thread time would miss the kernels, so there the blocks are timed by
the wall clock between two ``torch.cuda.synchronize()`` calls.

    rows = compare({"torch": f, "gradlab": g}, baseline="torch")
    print(format_rows(rows))
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["Row", "compare", "format_rows", "setup_threads", "write_json"]


@dataclass
class Row:
    """One variant's timing: per-call microseconds and ratios to the baseline."""

    name: str
    min_us: float
    median_us: float
    ratio_min: float
    ratio_paired: float
    note: str = ""


def setup_threads(threads: int = 1) -> None:
    """One torch thread by default, so that thread CPU time is all of the work."""
    torch.set_num_threads(threads)


def _clock(device: str) -> Callable[[], int]:
    if device == "cuda":

        def wall() -> int:
            torch.cuda.synchronize()
            return time.perf_counter_ns()

        return wall
    return time.thread_time_ns


def _inner(fn: Callable[[], object], clock: Callable[[], int], block_ms: float) -> int:
    """How many calls make a block of about ``block_ms`` (at least 1)."""
    start = clock()
    fn()
    once = max(clock() - start, 1)
    return max(1, round(block_ms * 1e6 / once))


def compare(
    variants: Mapping[str, Callable[[], object]],
    baseline: str | Mapping[str, str],
    *,
    rounds: int = 40,
    block_ms: float = 4.0,
    warmup: int = 3,
    device: str = "cpu",
    seed: int = 0,
    notes: Mapping[str, str] | None = None,
) -> list[Row]:
    """Time every variant in interleaved rounds; ratios against ``baseline``.

    Args:
        variants: name -> a callable that does one unit of work (it must leave its
            inputs so that the next call does the same work).
        baseline: the name of the variant the ratios divide by, or a mapping from each
            variant's name to its own baseline's (every variant runs in the same
            interleaved rounds either way).
        rounds: how many rounds; each times every variant once. Default: 40
        block_ms: the length a timed block aims at, in milliseconds. Default: 4.0
        warmup: calls of each variant before timing. Default: 3
        device: ``"cpu"`` (thread CPU time) or ``"cuda"`` (wall clock, synchronised).
        seed: the seed of the random order of each round. Default: 0
        notes: name -> a short note printed beside its row (host reads, memory).

    Returns:
        One :class:`Row` per variant, in the order given.
    """
    baselines = {name: baseline for name in variants} if isinstance(baseline, str) else baseline
    missing = {b for b in baselines.values() if b not in variants} | (
        set(variants) - set(baselines)
    )
    if missing:
        raise ValueError(f"baselines {sorted(missing)} are not among the variants {list(variants)}")
    clock = _clock(device)
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    inner = {name: _inner(fn, clock, block_ms) for name, fn in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            fn, n = variants[name], inner[name]
            start = clock()
            for _ in range(n):
                fn()
            times[name].append((clock() - start) / n / 1e3)
    rows = []
    for name, samples in times.items():
        base = times[baselines[name]]
        paired = statistics.median(s / b for s, b in zip(samples, base, strict=True))
        rows.append(
            Row(
                name,
                min(samples),
                statistics.median(samples),
                min(samples) / min(base),
                paired,
                (notes or {}).get(name, ""),
            )
        )
    return rows


def format_rows(rows: list[Row], title: str = "") -> str:
    """A plain-text table of ``rows``: times in µs and both ratios."""
    width = max(len(r.name) for r in rows)
    lines = [title] if title else []
    lines.append(
        f"{'variant':<{width}}  {'min µs':>9}  {'median µs':>9}  {'min/min':>7}  "
        f"{'paired':>7}  note"
    )
    for r in rows:
        lines.append(
            f"{r.name:<{width}}  {r.min_us:9.1f}  {r.median_us:9.1f}  {r.ratio_min:7.3f}  "
            f"{r.ratio_paired:7.3f}  {r.note}"
        )
    return "\n".join(lines)


def write_json(path: str | Path, tables: Mapping[str, list[Row]], settings: Mapping) -> None:
    """Write the tables and the settings they were measured with, as one JSON file."""
    data = {
        "settings": dict(settings),
        "tables": {k: [asdict(r) for r in rows] for k, rows in tables.items()},
    }
    Path(path).write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
