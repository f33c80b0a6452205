"""The stored loss-spike experiment reproduces: its corpus, a prefix of a run, the files.

``spikes_*`` (:mod:`gradlab_book.stored`) are written by ``experiments/char_lm_spikes.py``
(about four minutes on two cores; a quarter of an hour when the machine is
busier). Here a few seconds rerun the first ``PREFIX`` steps
of stored runs and compare every stored number. The losses (five significant digits)
and gradient norms (four) must agree to ``RTOL`` and one unit of their last stored
digit: float rounding can differ between processes, CPUs and torch builds by far less
than that, but a value on a rounding boundary may then be stored one unit apart. The
decisions (kept, clipped, skipped) must agree exactly.
"""

from __future__ import annotations

import math

import experiment_scripts
import pytest

from gradlab_book.figures import spikes

PREFIX = 50  # steps: one held-out evaluation after the one at step 0
RTOL = 1e-4
#: A run whose guard acts within the prefix (checked below), and one without a guard.
PREFIX_RUNS = [("clip+skip", 0), ("none", 1)]


@pytest.fixture(scope="module")
def script():
    return experiment_scripts.load("char_lm_spikes")


@pytest.fixture(scope="module")
def data():
    return spikes.load_runs()


def test_the_corpus_is_the_stored_one(data, script):
    stored = data["corpus"]
    assert stored["files"] == list(script.CORPUS_FILES)
    try:
        text = script.corpus_text()
    except OSError as exc:
        pytest.fail(
            f"the corpus cannot be read ({exc}): the experiment reads "
            f"{stored['files']} from sysconfig.get_paths()['stdlib'] of Python "
            "3.11; this Python's standard library lacks one of them"
        )
    digest = script.corpus_sha256(text)
    if digest != stored["sha256"]:
        pytest.fail(
            "the corpus differs from the one the stored runs were trained on: sha256 "
            f"{digest} here, {stored['sha256']} stored ({len(text)} characters here, "
            f"{stored['chars']} stored). This Python's standard-library sources are not "
            "the ones of the machine that ran experiments/char_lm_spikes.py, so its "
            "runs cannot be reproduced here."
        )
    train, held = script.splits(text)
    assert (len(train), len(held)) == (stored["train_chars"], stored["held_out_chars"])


def test_the_files_are_small_and_hold_the_whole_grid(data, script):
    assert spikes.RUNS_PATH.stat().st_size < 500_000
    assert spikes.TABLE_PATH.stat().st_size < 10_000
    assert data["setup"] == script.SETUP
    assert data["methods"] == list(script.METHODS)
    assert data["seeds"] == list(script.SEEDS) and len(script.SEEDS) >= 5
    assert data["thresholds"] == {
        "clip": script.CLIP,
        "skip": script.SKIP,
        "skip_above": script.SKIP_ABOVE,
    }
    assert data["spike_rule"] == {"window": script.SPIKE_WINDOW, "ratio": script.SPIKE_RATIO}
    keys = sorted((r["method"], r["seed"]) for r in data["runs"])
    assert keys == sorted((m, s) for m in script.METHODS for s in script.SEEDS)
    steps = data["setup"]["steps"]
    for run in data["runs"]:
        assert len(run["loss"]) == len(run["norm"]) == len(run["decision"]) == steps
        assert set(run["decision"]) <= set("kcs")
        assert run["eval_steps"] == list(range(0, steps + 1, data["setup"]["eval_every"]))


def test_the_reference_runs(data, script):
    ref = data["reference"]
    assert ref["lr"] == script.REFERENCE_LR < data["setup"]["lr"]
    assert [r["seed"] for r in ref["runs"]] == list(script.SEEDS)
    for run in ref["runs"]:
        assert len(run["loss"]) == data["setup"]["steps"]
        assert run["eval_steps"] == spikes.run_of(data, "none", run["seed"])["eval_steps"]
    stored = ref["runs"][0]
    rerun = script.train_run("none", stored["seed"], {**data["setup"], "lr": ref["lr"]}, PREFIX)
    for t, (a, b) in enumerate(zip(rerun["loss"], stored["loss"][:PREFIX], strict=True)):
        assert _close(a, b), f"loss at step {t}: rerun {a}, stored {b}"


def test_the_table_is_the_scripts(data, script):
    rows = spikes.load_table()
    for row in rows:
        again = script.table_row(spikes.run_of(data, row["method"], row["seed"]))
        for key, value in again.items():
            assert row[key] == value or math.isclose(row[key], value, rel_tol=1e-9), key


def _close(a, b, digits=5):
    """Equal within RTOL and one unit of the last of the ``digits`` significant digits
    the file stores (the rerun is rounded the same way, so a value on a rounding
    boundary may come out one unit apart)."""
    if a is None or b is None:
        return a is b
    unit = 10.0 ** (math.floor(math.log10(abs(b))) - (digits - 1)) if b else 0.0
    return abs(a - b) <= 1.001 * unit + RTOL * abs(b)


@pytest.mark.parametrize(("method", "seed"), PREFIX_RUNS)
def test_a_prefix_of_a_stored_run_reproduces(data, script, method, seed):
    stored = spikes.run_of(data, method, seed)
    rerun = script.train_run(method, seed, data["setup"], PREFIX)
    for key, digits in (("loss", 5), ("norm", 4)):
        for t, (a, b) in enumerate(zip(rerun[key], stored[key][:PREFIX], strict=True)):
            assert _close(a, b, digits), f"{key} at step {t}: rerun {a}, stored {b}"
    assert rerun["decision"] == stored["decision"][:PREFIX]
    assert rerun["eval_steps"] == stored["eval_steps"][:2]
    for a, b in zip(rerun["eval_loss"], stored["eval_loss"][:2], strict=True):
        assert _close(a, b), (a, b)
    if method != "none":  # the prefix exercises the guard
        assert set(stored["decision"][:PREFIX]) != {"k"}


def test_the_costs_describe_the_machine(data):
    costs = spikes.load_costs()
    assert "this machine" in costs["note"]
    assert costs["machine"]["threads_per_run"] == 1
    for method in data["methods"]:
        c = costs["methods"][method]
        assert 0 < c["control_ms"] < c["step_ms"]
