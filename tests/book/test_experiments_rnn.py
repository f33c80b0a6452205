"""The stored RNN experiment reproduces: a prefix of one run, the thresholds, the grid.

``rnn_long_dependency.json`` (:mod:`gradlab_book.stored`) is written by
``experiments/rnn_long_dependency.py`` (about a quarter of an hour on two cores). Here a
few seconds rerun the beginning of one stored run and compare every stored number.
"""

from __future__ import annotations

import math

import experiment_scripts
import pytest

from gradlab_book.figures import rnn

PREFIX = 200  # steps: two evaluations and eight windows of gradient norms


@pytest.fixture(scope="module")
def data():
    return rnn.load_results()


@pytest.fixture(scope="module")
def script():
    return experiment_scripts.load("rnn_long_dependency")


def _close(a, b):
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def test_the_file_is_small_and_holds_the_whole_grid(data, script):
    assert rnn.DATA_PATH.stat().st_size < 400_000
    assert data["lengths"] == list(script.LENGTHS)
    assert data["seeds"] == list(script.SEEDS)
    assert data["methods"] == list(rnn.METHODS)
    assert data["setup"] == script.SETUP
    keys = sorted((r["length"], r["method"], r["seed"]) for r in data["runs"])
    expected = sorted((t, m, s) for t in script.LENGTHS for m in rnn.METHODS for s in script.SEEDS)
    assert keys == expected


def _longest_run(data, method):
    runs = [r for r in data["runs"] if r["method"] == method and r["steps_run"] >= PREFIX]
    return max(runs, key=lambda r: (r["length"], -r["seed"]))


@pytest.mark.parametrize("method", ["clip_norm", "skip"])
def test_a_prefix_of_a_stored_run_reproduces(data, method):
    stored = _longest_run(data, method)
    length = stored["length"]
    thresholds = data["thresholds"][str(length)]
    rerun = rnn.train_run(length, method, stored["seed"], data["setup"], thresholds, PREFIX)
    setup = data["setup"]
    n_eval, n_windows = PREFIX // setup.eval_every + 1, PREFIX // setup.stride
    assert rerun["eval_steps"] == stored["eval_steps"][:n_eval]
    for a, b in zip(rerun["test_mse"], stored["test_mse"][:n_eval], strict=True):
        assert _close(a, b), (a, b)
    for a, b in zip(rerun["norm_max"], stored["norm_max"][:n_windows], strict=True):
        assert _close(a, b), (a, b)
    assert rerun["acted"] == stored["acted"][:n_windows]


def test_the_thresholds_reproduce(data):
    length = data["lengths"][0]
    again = rnn.calibrate(length, data["setup"])
    stored = data["thresholds"][str(length)]
    assert _close(again["norm"], stored["norm"]) and _close(again["value"], stored["value"])


def test_every_run_is_consistent(data):
    setup = data["setup"]
    for run in data["runs"]:
        assert run["eval_steps"][-1] == run["steps_run"] <= setup.steps
        assert len(run["test_mse"]) == len(run["eval_steps"])
        assert (
            len(run["norm_max"]) == len(run["acted"]) == math.ceil(run["steps_run"] / setup.stride)
        )
        if run["solved_at"] is not None:
            assert run["solved_at"] == run["steps_run"]
            assert run["test_mse"][-1] < setup.success_mse
            assert not run["diverged"]
        if run["diverged"]:
            assert run["test_mse"][-1] is None
