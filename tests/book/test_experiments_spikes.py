"""The stored loss-spike experiment reproduces: its corpus, a prefix of a run, the files.

``spikes_*`` (:mod:`gradlab_book.stored`) are written by ``experiments/char_lm_spikes.py``.
Here a few seconds rerun the first ``PREFIX`` steps of two runs and compare them with
``spikes_prefix.json``, the same prefixes in full precision with the numeric platform
that computed them: bit for bit on that platform, within ``RTOL`` on any other
(``experiment_scripts.assert_prefix_reproduces``), and a 1 % change of the learning rate
or another seed falls outside ``RTOL`` (``assert_outside``). The decisions (kept,
clipped, skipped) must agree exactly. The long runs of ``spikes_runs.json`` (losses to
five significant digits, norms to four) must agree with the prefix rounded the same way,
to ``RTOL`` and one unit of their last stored digit.
"""

from __future__ import annotations

import math

import experiment_scripts
import pytest
import torch

from gradlab import StepGuard
from gradlab_book import stored as stored_data
from gradlab_book.figures import spikes

PREFIX = 50  # steps: one held-out evaluation after the one at step 0
#: How far float32 kernel noise carries the first 50 steps on another CPU or kernel set:
#: measured under ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE (see the module doc).
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
    for name in ("spikes_runs.json", *data["more_files"], "spikes_recipe.json"):
        assert stored_data.path(name).stat().st_size < 300_000, name
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


@pytest.fixture(scope="module")
def prefix(script):
    stored = spikes.load_prefix()
    assert stored["steps"] == PREFIX == script.PREFIX
    assert [(r["method"], r["seed"]) for r in stored["runs"]] == PREFIX_RUNS
    assert list(script.PREFIX_RUNS) == PREFIX_RUNS
    return stored


def _full(script, method, seed, setup):
    return script.train_run(method, seed, setup, PREFIX, digits=False)


@pytest.mark.parametrize(("method", "seed"), PREFIX_RUNS)
def test_a_prefix_reproduces_in_full_precision(data, script, prefix, method, seed):
    want = next(r for r in prefix["runs"] if (r["method"], r["seed"]) == (method, seed))
    rerun = _full(script, method, seed, data["setup"])
    for key in ("loss", "norm"):
        experiment_scripts.assert_prefix_reproduces(rerun[key], want[key], prefix, RTOL)
    assert rerun["decision"] == want["decision"]
    if method != "none":  # the prefix exercises the guard
        assert set(want["decision"]) != {"k"}
    # a real change falls outside the tolerance: a 1 % higher learning rate, another seed
    lr = _full(script, method, seed, {**data["setup"], "lr": 1.01 * data["setup"]["lr"]})
    experiment_scripts.assert_outside(lr["loss"], want["loss"], RTOL)
    other = _full(script, method, seed + 1, data["setup"])
    experiment_scripts.assert_outside(other["loss"], want["loss"], RTOL)


@pytest.mark.parametrize(("method", "seed"), PREFIX_RUNS)
def test_the_stored_runs_begin_with_the_prefix(data, script, prefix, method, seed):
    stored = spikes.run_of(data, method, seed)
    full = next(r for r in prefix["runs"] if (r["method"], r["seed"]) == (method, seed))
    for key, digits in (("loss", 5), ("norm", 4)):
        for t, (a, b) in enumerate(zip(full[key], stored[key][:PREFIX], strict=True)):
            assert _close(script._r(a, digits), b, digits), f"{key} at step {t}: {a}, {b}"
    assert full["decision"] == stored["decision"][:PREFIX]


def test_the_costs_describe_the_machine(data):
    costs = spikes.load_costs()
    assert "this machine" in costs["note"]
    assert costs["machine"]["threads_per_run"] == 1
    for method in data["methods"]:
        c = costs["methods"][method]
        assert 0 < c["control_ms"] < c["step_ms"]


def test_the_recipe_runs_are_the_scripts(script):
    recipe = spikes.load_recipe()
    assert recipe["limit"] == script.RECIPE_LIMIT
    assert recipe["recipes"] == {m: list(v) for m, v in script.RECIPES.items()}
    keys = [(r["method"], r["seed"]) for r in recipe["runs"]]
    assert keys == [(m, s) for m, seeds in script.RECIPE_SEEDS.items() for s in seeds]
    assert "platform" in recipe
    for run, row in zip(recipe["runs"], recipe["rows"], strict=True):
        assert row == script.table_row(run)
        # the limit holds: never more than RECIPE_LIMIT skips in a row
        assert "s" * (script.RECIPE_LIMIT + 1) not in run["decision"]
    run = recipe["runs"][0]
    rerun = script.train_run(run["method"], run["seed"], steps=PREFIX)
    assert rerun["decision"] == run["decision"][:PREFIX]
    for t, (a, b) in enumerate(zip(rerun["loss"], run["loss"][:PREFIX], strict=True)):
        assert _close(a, b), f"loss at step {t}: rerun {a}, stored {b}"


def _replay(norms, mode, policy):
    """The decisions of a guard with ``policy`` on stored norms: the gradient of one
    parameter is set to each norm (its norm is exact), SGD at lr 0 steps nothing."""
    w = torch.zeros(1, requires_grad=True)
    guard = StepGuard(torch.optim.SGD([w], lr=0.0), mode=mode, threshold=policy)
    out = []
    for n in norms:
        w.grad = torch.tensor([n])
        out.append(guard.step().decision[0])
    return "".join(out)


@pytest.mark.parametrize("method", ["zclip", "autoclip", "sigmaskip"])
def test_the_stored_policies_are_the_scripts(data, script, method):
    # A policy's decisions depend only on the norms it saw (and a skip leaves the
    # parameters where they are), so replaying the stored norms must give the stored
    # decisions back; the library's default of today must not (AutoClip's p = 10 of the
    # whole history, SigmaSkip with every step in its window).
    run = spikes.run_of(data, method, 0)
    guard = script.make_guard(method, torch.optim.SGD([torch.zeros(1)], lr=0.0))
    policy, mode = guard.threshold, guard.mode
    assert _replay(run["norm"], mode, policy) == run["decision"]
    if method != "zclip":
        assert _replay(run["norm"], mode, type(policy)()) != run["decision"]
