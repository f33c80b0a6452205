"""The stored RNN sweep reproduces: a prefix of one group of runs, the thresholds, the grid.

``rnn_long_dependency.json`` (:mod:`gradlab_book.stored`) is written by
``experiments/rnn_long_dependency.py`` (about three and a half minutes of CPU time). Here
some seconds rerun the first steps of one (length, seed) group, every learning rate and
control, and the calibration of every length (T = 20, 30, 50), and compare them with the
file: bit for bit on the platform that wrote it, within ``RTOL`` elsewhere
(``experiment_scripts``). A 1 % change of the learning rate, or another seed, moves the
same numbers by more than ``RTOL``.
"""

from __future__ import annotations

import math

import experiment_scripts
import pytest

from gradlab_book import stored as stored_data
from gradlab_book.figures import rnn

PREFIX = 100  # steps: two evaluations, two windows of norms, one direction probe
#: How far float32 kernel noise may carry the calm runs (lr <= CALM_LR) of a prefix on
#: another CPU (the chapter's 50-step rerun stays within it under ATEN_CPU_CAPABILITY=
#: default, MKL_CBWR=COMPATIBLE and OPENBLAS_CORETYPE=Haswell). A run at a chaotic rate
#: can move by any amount in 100 steps, so it is compared bit for bit only.
RTOL = 1e-3
CALM_LR = 0.1
LENGTH, SEED = 20, 0


@pytest.fixture(scope="module")
def data():
    return rnn.load_results()


@pytest.fixture(scope="module")
def script():
    return experiment_scripts.load("rnn_long_dependency")


def _numbers(runs, calm_only):
    """The prefix of every run, flattened: its first two evaluations, norm windows and
    direction probe (runs at a rate above CALM_LR left out where ``calm_only``)."""
    values = []
    for run in runs:
        if calm_only and run["lr"] > CALM_LR:
            continue
        values += run["test_mse"][:2] + run["norm_max"][:2] + run["acted"][:2]
        if "probe" in run:
            values += [run["probe"][k][0] for k in ("norm", "along", "random")]
    return [math.nan if v is None else v for v in values]


@pytest.fixture(scope="module")
def rerun(data, script):
    thresholds = data["thresholds"][str(LENGTH)]
    return rnn.train_group(LENGTH, script.group(LENGTH, SEED), thresholds, data["setup"], PREFIX)


def _stored_group(data, script):
    key = {(lr, c) for lr, c, _ in script.group(LENGTH, SEED)}
    runs = [
        r
        for r in data["runs"]
        if r["length"] == LENGTH and r["seed"] == SEED and (r["lr"], r["control"]) in key
    ]
    order = [(lr, c) for lr, c, _ in script.group(LENGTH, SEED)]
    return sorted(runs, key=lambda r: order.index((r["lr"], r["control"])))


def test_the_file_is_small_and_holds_the_whole_sweep(data, script):
    assert rnn.DATA_PATH.stat().st_size < 300_000
    assert data["lengths"] == list(script.LENGTHS)
    assert data["lrs"] == list(script.LRS)
    assert data["seeds"] == list(script.SEEDS)
    assert data["controls"] == list(rnn.CONTROLS)
    assert data["setup"] == script.SETUP
    assert set(data["platform"]) == set(stored_data.platform())
    keys = sorted((r["length"], r["lr"], r["control"], r["seed"]) for r in data["runs"])
    expected = sorted(
        (t, lr, c, s)
        for t in script.LENGTHS
        for lr in script.LRS
        for c in rnn.CONTROLS
        for s in script.SEEDS
    )
    assert keys == expected


def test_a_prefix_of_a_stored_group_reproduces(data, script, rerun):
    stored = _stored_group(data, script)
    calm_only = not stored_data.same_platform(data)
    experiment_scripts.assert_prefix_reproduces(
        _numbers(rerun, calm_only), _numbers(stored, calm_only), data, RTOL
    )


@pytest.mark.parametrize("change", ["lr + 1 %", "another seed"])
def test_a_real_change_falls_outside_the_tolerance(data, script, rerun, change):
    thresholds = data["thresholds"][str(LENGTH)]
    if change == "lr + 1 %":
        runs = [(lr * 1.01, c, s) for lr, c, s in script.group(LENGTH, SEED)]
    else:
        runs = script.group(LENGTH, SEED + 1)
    changed = rnn.train_group(LENGTH, runs, thresholds, data["setup"], PREFIX)
    for run, again in zip(changed, rerun, strict=True):
        run["lr"] = again["lr"]  # compare the same runs, whatever rate they ran at
    experiment_scripts.assert_outside(_numbers(changed, True), _numbers(rerun, True), RTOL)


@pytest.mark.parametrize("length", [20, 30, 50])
def test_the_thresholds_reproduce(data, script, length):
    assert length in script.LENGTHS
    again = rnn.calibrate(length, data["setup"])
    stored = data["thresholds"][str(length)]
    keys = ["norm", "value", "zero", "skip"]
    experiment_scripts.assert_prefix_reproduces(
        [again[k] for k in keys], [stored[k] for k in keys], data, RTOL
    )
    assert [s["calm"] for s in again["seeds"]] == [s["calm"] for s in stored["seeds"]]


def test_every_run_is_consistent(data):
    setup = data["setup"]
    for run in data["runs"]:
        assert run["eval_steps"][-1] == run["steps_run"] <= setup.steps
        assert len(run["test_mse"]) == len(run["eval_steps"])
        assert (
            len(run["norm_max"]) == len(run["acted"]) == math.ceil(run["steps_run"] / setup.stride)
        )
        assert sum(run["acted"]) <= run["steps_run"]
        if run["solved_at"] is not None:
            assert run["solved_at"] == run["steps_run"]
            assert run["test_mse"][-1] < setup.success_mse
            assert not run["diverged"]
        if run["diverged"]:
            assert run["test_mse"][-1] is None
        if run["control"] in rnn.PROBED:
            # a probe at every evaluation but the one at the end of the budget
            probes = len(run["eval_steps"]) - (run["steps_run"] == setup.steps)
            assert all(len(v) == probes for v in run["probe"].values())


def test_zero_and_skip_are_one_rule_with_plain_sgd(data):
    """With plain SGD a zeroed gradient moves nothing, as a skipped step: at the same
    threshold the two controls are the same run, bit for bit (here a short one)."""
    thresholds = dict(data["thresholds"][str(LENGTH)])
    thresholds["skip"] = thresholds["zero"]
    zero, skip = rnn.train_group(
        LENGTH, [(0.3, "zero", SEED), (0.3, "skip", SEED)], thresholds, data["setup"], 60
    )
    assert sum(zero["acted"]) > 0
    for key in ("test_mse", "norm_max", "acted", "steps_run"):
        assert zero[key] == skip[key]
