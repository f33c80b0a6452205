"""A small GPT-style character model at a learning rate where its loss spikes.

One command, seeded and deterministic (the same numbers on every rerun on the same
machine):

    .venv/bin/python experiments/char_lm_spikes.py

trains every (method, seed) below with AdamW on a fixed list of Python
standard-library source files and writes, into the book package's data folder
(``gradlab-book/gradlab_book/data/``, :func:`gradlab_book.stored.folder`),

* ``spikes_runs.json`` (and ``spikes_runs_2.json``, more runs): the setup, the
  numeric platform, the corpus's sha256, and for every run the
  training loss, gradient norm and decision (kept, clipped, skipped) of every step
  and the held-out loss every ``eval_every`` steps;
* ``spikes_table.csv``: one row per (method, seed): final training and held-out
  loss, number of spikes (definition in :func:`count_spikes`), clip and skip counts;
* ``spikes_costs.json``: the median time of each method's guard and optimizer step,
  and of the whole training step, measured after the runs with every method stepped
  in turn (:func:`measure_costs`), *on the machine that ran it*, with that machine's
  description (``--costs-only`` measures them again without retraining).

* ``spikes_prefix.json``: the first ``PREFIX`` steps of ``PREFIX_RUNS`` in full
  precision with the numeric platform (``--prefix-only`` writes just this file);
* ``spikes_recipe.json``: the runs with a limit on skips that takes the step
  (``RECIPES``, ``--recipe-only``), with the numeric platform.

``spikes_runs.json`` also holds reference runs without control at the lower learning
rate ``REFERENCE_LR`` (``--reference-only`` trains just those again).

The chapter ``book/adaptive/loss_spikes.ipynb`` loads these files; it does not
retrain. ``tests/book/test_experiments_spikes.py`` reruns a short prefix of one run.
Each worker process uses one thread; ``--workers`` (default 2) changes the wall
time (and the timings, which are this machine's), not the losses.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gradlab import StepGuard
from gradlab.adaptive import AutoClip, SigmaSkip, ZClip
from gradlab_book import stored
from gradlab_book.char_lm import ALPHABET, make_model
from gradlab_book.figures import spikes

DATA_DIR = stored.folder()

#: The corpus: these files of the standard library, in this order, concatenated.
CORPUS_FILES = (
    "textwrap.py",
    "heapq.py",
    "bisect.py",
    "fractions.py",
    "string.py",
    "colorsys.py",
    "functools.py",
    "calendar.py",
    "statistics.py",
    "shlex.py",
)
HELD_OUT = 0.1  # the last tenth of the corpus is held out

SETUP = {
    "context": 64,
    "width": 64,
    "layers": 2,
    "heads": 4,
    "batch": 16,
    "steps": 800,
    "lr": 0.06,
    "warmup": 50,
    "betas": [0.9, 0.999],
    "eps": 1e-8,
    "weight_decay": 0.1,
    "eval_every": 50,
    "eval_batches": 8,
}
SEEDS = (0, 1, 2, 3, 4)
#: spikes_runs.json holds the first SPLIT runs, spikes_runs_2.json the rest (each file
#: under 300 KB).
SPLIT = 20
COST_STEPS = 200  # steps of every method, interleaved, for the timings
#: A reference: no control at this lower learning rate, every seed.
REFERENCE_LR = 0.01

#: Every method: how the step is controlled. ``clip`` and ``skip`` are fixed
#: numbers in units of the gradient norm.
CLIP = 1.0
SKIP = 2.0
SKIP_ABOVE = 2.0
METHODS = ("none", "clip", "skip", "clip+skip", "zclip", "autoclip", "sigmaskip")
LABELS = {
    "none": "no control",
    "clip": f"clip at {CLIP:g}",
    "skip": f"skip above {SKIP:g}",
    "clip+skip": f"clip at {CLIP:g}, skip above {SKIP_ABOVE:g}",
    "zclip": "ZClip (clip)",
    "autoclip": "AutoClip (clip)",
    "sigmaskip": "SigmaSkip (skip)",
}

#: The runs' adaptive policies, as gradlab 2 had them by default: AutoClip as the
#: third-party QuantileClip (the 0.9 quantile of the last 1000 norms), not the paper's
#: p = 10 of the whole history; SigmaSkip's accepted-only window (a skipped step never
#: enters it), not OLMo-core's, where every step enters.
AUTOCLIP = {"percentile": 90.0, "window": 1000}
SIGMASKIP = {"k": 6.0, "window": 128, "min_count": 64, "steps": "taken"}
#: A limit on skips that does not stall (``--recipe-only``): after ``RECIPE_LIMIT``
#: skips in a row the guard takes the step, clipped to its threshold.
RECIPE_LIMIT = 10
RECIPES = {"skip-take": (SKIP, None), "clip+skip-take": (CLIP, SKIP_ABOVE)}
#: The runs of the recipe check (every seed of clip+skip and two of skip went stale).
RECIPE_SEEDS = {"clip+skip-take": (0, 1, 2, 3, 4), "skip-take": (0, 3)}

#: Full-precision prefixes of these (method, seed) runs, for the prefix test: a run whose
#: guard acts within the prefix and one without a guard.
PREFIX = 50
PREFIX_RUNS = (("clip+skip", 0), ("none", 1))

# Spikes: a step whose training loss is more than SPIKE_RATIO times the median of the
# SPIKE_WINDOW losses before it starts a spike, unless one started in the SPIKE_WINDOW
# steps before it.
SPIKE_WINDOW = 50
SPIKE_RATIO = 1.25


# ----------------------------------------------------------------------- corpus


def corpus_text() -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    return "".join((root / name).read_text(encoding="utf-8") for name in CORPUS_FILES)


def corpus_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def encode(text: str) -> torch.Tensor:
    index = {ch: i + 1 for i, ch in enumerate(ALPHABET)}
    return torch.tensor([index.get(ch, 0) for ch in text], dtype=torch.int64)


def splits(text: str) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = encode(text)
    cut = int(len(tokens) * (1 - HELD_OUT))
    return tokens[:cut], tokens[cut:]


def batch_at(tokens: torch.Tensor, offsets: torch.Tensor, context: int):
    rows = offsets[:, None] + torch.arange(context + 1)
    chunk = tokens[rows]
    return chunk[:, :-1], chunk[:, 1:]


def make_guard(method: str, optimizer: torch.optim.Optimizer) -> StepGuard | None:
    """The StepGuard of ``method`` (None: a bare optimizer step)."""
    kw = {"max_consecutive_skips": None}  # record a stale threshold, do not raise
    if method == "none":
        return None
    if method == "clip":
        return StepGuard(optimizer, mode="clip", threshold=CLIP, **kw)
    if method == "skip":
        return StepGuard(optimizer, mode="skip", threshold=SKIP, **kw)
    if method == "clip+skip":
        return StepGuard(optimizer, mode="clip", threshold=CLIP, skip_above=SKIP_ABOVE, **kw)
    if method == "zclip":
        return StepGuard(optimizer, mode="clip", threshold=ZClip(), **kw)
    if method == "autoclip":  # QuantileClip's rule, the variant these runs used
        return StepGuard(optimizer, mode="clip", threshold=AutoClip(**AUTOCLIP), **kw)
    if method == "sigmaskip":  # the accepted-only window, the variant these runs used
        return StepGuard(optimizer, mode="skip", threshold=SigmaSkip(**SIGMASKIP), **kw)
    if method in RECIPES:  # a limit on skips that takes a clipped step instead
        threshold, skip_above = RECIPES[method]
        return StepGuard(
            optimizer,
            mode="clip" if skip_above else "skip",
            threshold=threshold,
            skip_above=skip_above,
            max_consecutive_skips=RECIPE_LIMIT,
            on_skip_limit="take",
        )
    raise ValueError(f"unknown method {method!r}")


# ---------------------------------------------------------------------- training


def _r(x: float, digits: int) -> float | None:
    return float(f"{x:.{digits}g}") if math.isfinite(x) else None


@torch.no_grad()
def held_out_loss(model: nn.Module, held: torch.Tensor, setup: dict) -> float:
    n, context = setup["eval_batches"] * setup["batch"], setup["context"]
    # fixed, evenly spaced windows of the held-out text
    offsets = torch.linspace(0, len(held) - context - 2, n).to(torch.int64)
    x, y = batch_at(held, offsets, context)
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()


class Trainer:
    """One (method, seed): the model, AdamW, the guard and the batches, stepped one
    training step at a time by :meth:`step`."""

    def __init__(self, method: str, seed: int, setup: dict, train: torch.Tensor) -> None:
        self.setup, self.train = setup, train
        self.model = make_model(seed, setup)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=setup["lr"],
            betas=tuple(setup["betas"]),
            eps=setup["eps"],
            weight_decay=setup["weight_decay"],
        )
        self.guard = make_guard(method, self.optimizer)
        # the same batches for every method of a seed
        self.data_gen = torch.Generator().manual_seed(1000 + seed)
        self.high = len(train) - setup["context"] - 1
        self.t = 0

    def step(self) -> tuple[float, float, str, float, float]:
        """One training step: (loss, gradient norm, decision, seconds of the guard and
        optimizer step, seconds of the whole step)."""
        setup, optimizer = self.setup, self.optimizer
        t0 = time.perf_counter()
        for group in optimizer.param_groups:  # linear warm-up, then constant
            group["lr"] = setup["lr"] * min(1.0, (self.t + 1) / setup["warmup"])
        offsets = torch.randint(0, self.high, (setup["batch"],), generator=self.data_gen)
        x, y = batch_at(self.train, offsets, setup["context"])
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        t1 = time.perf_counter()
        if self.guard is None:
            optimizer.step()
            t2 = time.perf_counter()
            grads = [p.grad for p in self.model.parameters()]
            norm, decision = torch.nn.utils.get_total_norm(grads).item(), "kept"
        else:
            record = self.guard.step()
            t2 = time.perf_counter()
            norm, decision = record.total_norm, record.decision
        self.t += 1
        return loss.item(), norm, decision, t2 - t1, t2 - t0


def train_run(
    method: str, seed: int, setup: dict = SETUP, steps: int | None = None, digits: bool = True
) -> dict:
    """Train one (method, seed) for ``steps`` (default ``setup["steps"]``) steps; losses
    to five significant digits and norms to four, or in full precision (``digits=False``)."""
    torch.set_num_threads(1)  # as every run of the script: the reduction order counts
    steps = setup["steps"] if steps is None else steps
    r = _r if digits else lambda x, _: x if math.isfinite(x) else None
    train, held = splits(corpus_text())
    trainer = Trainer(method, seed, setup, train)
    losses, norms, decisions = [], [], []
    eval_steps, eval_losses = [0], [held_out_loss(trainer.model, held, setup)]
    for step in range(steps):
        loss, norm, decision, _, _ = trainer.step()
        losses.append(r(loss, 5))
        norms.append(r(norm, 4))
        decisions.append(decision[0])  # k, c or s
        if (step + 1) % setup["eval_every"] == 0:
            eval_steps.append(step + 1)
            eval_losses.append(r(held_out_loss(trainer.model, held, setup), 5))
    return {
        "method": method,
        "seed": seed,
        "loss": losses,
        "norm": norms,
        "decision": "".join(decisions),
        "eval_steps": eval_steps,
        "eval_loss": eval_losses,
    }


def measure_costs(steps: int = COST_STEPS, seed: int = 0, setup: dict = SETUP) -> dict:
    """The time per step of each method, interleaved so that the machine's load falls
    on all of them alike: one trainer per method, all from the same seed, stepped in
    turn (the order rotating every step) for ``steps`` steps, the first 10 left out.
    Medians, in milliseconds; only steps the method took (not skipped) count."""
    torch.set_num_threads(1)
    train, _ = splits(corpus_text())
    trainers = {m: Trainer(m, seed, setup, train) for m in METHODS}
    control: dict[str, list[float]] = {m: [] for m in METHODS}
    whole: dict[str, list[float]] = {m: [] for m in METHODS}
    for step in range(steps):
        k = step % len(METHODS)
        for method in METHODS[k:] + METHODS[:k]:
            _, _, decision, c, w = trainers[method].step()
            if step >= 10 and decision != "skipped":
                control[method].append(c)
                whole[method].append(w)
    return {
        m: {
            "control_ms": 1e3 * statistics.median(control[m]),
            "step_ms": 1e3 * statistics.median(whole[m]),
            "steps_timed": len(control[m]),
        }
        for m in METHODS
    }


def count_spikes(losses: list[float | None]) -> int:
    """How many spikes ``losses`` has, by :func:`gradlab_book.figures.spikes.spike_starts`."""
    return len(spikes.spike_starts(losses, SPIKE_WINDOW, SPIKE_RATIO))


def table_row(run: dict, setup: dict = SETUP) -> dict:
    tail = [v for v in run["loss"][-setup["eval_every"] :] if v is not None]
    return {
        "method": run["method"],
        "seed": run["seed"],
        "final_train_loss": round(statistics.fmean(tail), 4) if tail else None,
        "held_out_loss": run["eval_loss"][-1],
        "best_held_out_loss": min(v for v in run["eval_loss"] if v is not None),
        "spikes": count_spikes(run["loss"]),
        "clipped": run["decision"].count("c"),
        "skipped": run["decision"].count("s"),
        "last_taken_step": max(
            (t for t, d in enumerate(run["decision"]) if d != "s"), default=None
        ),
    }


def _job(job: tuple[str, int]) -> dict:
    torch.set_num_threads(1)
    return train_run(*job)


def prefix_data() -> dict:
    """The first ``PREFIX`` steps of ``PREFIX_RUNS`` in full precision, with the numeric
    platform that computed them (:func:`gradlab_book.stored.platform`)."""
    torch.set_num_threads(1)
    runs = []
    for method, seed in PREFIX_RUNS:
        run = train_run(method, seed, steps=PREFIX, digits=False)
        runs.append({k: run[k] for k in ("method", "seed", "loss", "norm", "decision")})
    return {"platform": stored.platform(), "steps": PREFIX, "runs": runs}


def recipe_data(workers: int) -> dict:
    """The runs of ``RECIPES`` (a limit on skips that takes the step) for
    ``RECIPE_SEEDS``, with the numeric platform, rows as in ``spikes_table.csv``."""
    jobs = [(m, s) for m, seeds in RECIPE_SEEDS.items() for s in seeds]
    with ProcessPoolExecutor(workers) as pool:
        runs = list(pool.map(_job, jobs))
    return {
        "description": "a limit on skips that takes the step (max_consecutive_skips="
        f"{RECIPE_LIMIT}, on_skip_limit='take'); written by experiments/char_lm_spikes.py "
        "--recipe-only",
        "platform": stored.platform(),
        "limit": RECIPE_LIMIT,
        "recipes": {m: list(v) for m, v in RECIPES.items()},
        "rows": [table_row(r) for r in runs],
        "runs": runs,
    }


def reference_run(seed: int) -> dict:
    """No control at ``REFERENCE_LR``: the losses, without norms and decisions."""
    torch.set_num_threads(1)
    run = train_run("none", seed, {**SETUP, "lr": REFERENCE_LR})
    return {k: run[k] for k in ("seed", "loss", "eval_steps", "eval_loss")}


def reference_data(runs: list[dict]) -> dict:
    return {"method": "none", "lr": REFERENCE_LR, "runs": sorted(runs, key=lambda r: r["seed"])}


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads_per_run": 1,
    }


def write_costs(out: Path) -> None:
    """Measure the timings (:func:`measure_costs`) and write ``spikes_costs.json``."""
    costs = {
        "note": "median milliseconds per taken step, every method stepped in turn in "
        "one process with one thread, on the machine below while other work shared "
        "it: this machine's timings, not a benchmark",
        "steps": COST_STEPS,
        "machine": machine(),
        "methods": measure_costs(),
    }
    (out / "spikes_costs.json").write_text(json.dumps(costs, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="the folder to write")
    parser.add_argument(
        "--costs-only",
        action="store_true",
        help="only measure the timings again and rewrite spikes_costs.json",
    )
    parser.add_argument(
        "--reference-only",
        action="store_true",
        help="only train the reference runs again and write them into spikes_runs.json",
    )
    parser.add_argument(
        "--prefix-only",
        action="store_true",
        help="only rerun the prefix runs and write spikes_prefix.json",
    )
    parser.add_argument(
        "--recipe-only",
        action="store_true",
        help="only train the runs with a limit on skips and write spikes_recipe.json",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    if args.prefix_only or args.recipe_only:
        name, data = (
            ("spikes_prefix.json", prefix_data())
            if args.prefix_only
            else ("spikes_recipe.json", recipe_data(args.workers))
        )
        size = stored.write_json(args.out / name, data) / 1024
        print(f"wrote {args.out / name} ({size:.0f} KB) in {time.perf_counter() - start:.0f} s")
        return 0
    if args.costs_only:
        write_costs(args.out)
        print(f"wrote {args.out / 'spikes_costs.json'} in {time.perf_counter() - start:.0f} s")
        return 0
    runs_path = args.out / "spikes_runs.json"
    if args.reference_only:
        data = json.loads(runs_path.read_text())
        with ProcessPoolExecutor(args.workers) as pool:
            data["reference"] = reference_data(list(pool.map(reference_run, SEEDS)))
        stored.write_json(runs_path, data)
        print(f"wrote the reference runs into {runs_path} in {time.perf_counter() - start:.0f} s")
        return 0
    jobs = [(m, s) for s in SEEDS for m in METHODS]
    runs = []
    with ProcessPoolExecutor(args.workers) as pool:
        reference = reference_data(list(pool.map(reference_run, SEEDS)))
        for run in pool.map(_job, jobs):
            runs.append(run)
            row = table_row(run)
            print(
                f"[{time.perf_counter() - start:5.0f}s] {run['method']:10} seed {run['seed']}: "
                f"held-out {row['held_out_loss']}, spikes {row['spikes']}, "
                f"clipped {row['clipped']}, skipped {row['skipped']}",
                flush=True,
            )
    runs.sort(key=lambda r: (METHODS.index(r["method"]), r["seed"]))
    text = corpus_text()
    train, held = splits(text)
    data = {
        "description": "character GPT on Python stdlib sources, AdamW at a spiking "
        "learning rate; written by experiments/char_lm_spikes.py",
        "platform": stored.platform(),
        "corpus": {
            "files": list(CORPUS_FILES),
            "chars": len(text),
            "train_chars": len(train),
            "held_out_chars": len(held),
            "sha256": corpus_sha256(text),
        },
        "setup": SETUP,
        "thresholds": {"clip": CLIP, "skip": SKIP, "skip_above": SKIP_ABOVE},
        "spike_rule": {"window": SPIKE_WINDOW, "ratio": SPIKE_RATIO},
        "methods": list(METHODS),
        "labels": LABELS,
        "seeds": list(SEEDS),
        "runs": runs[:SPLIT],
        "reference": reference,
        "more_files": ["spikes_runs_2.json"],
    }
    size = stored.write_json(runs_path, data) / 1024
    size += stored.write_json(args.out / "spikes_runs_2.json", {"runs": runs[SPLIT:]}) / 1024
    rows = [table_row(r) for r in runs]
    with open(args.out / "spikes_table.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    stored.write_json(args.out / "spikes_prefix.json", prefix_data())
    stored.write_json(args.out / "spikes_recipe.json", recipe_data(args.workers))
    write_costs(args.out)
    print(f"wrote {args.out} ({size:.0f} KB runs) in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
