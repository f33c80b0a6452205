"""The stored clip-versus-ignore grid reproduces: thresholds, and runs rerun in full.

``clip_vs_ignore_grid.json`` (:mod:`gradlab_book.stored`) is written by
``experiments/clip_vs_ignore_grid.py`` (162 runs, about 20 s on one core). Here a few
seconds recompute the thresholds and rerun one cell's runs of one seed, and compare
every stored number bit for bit.
"""

from __future__ import annotations

import json

import experiment_scripts
import numpy as np
import pytest
import torch

from gradlab_book.figures import training


@pytest.fixture(scope="module")
def script():
    return experiment_scripts.load("clip_vs_ignore_grid")


@pytest.fixture(scope="module")
def raw():
    return json.loads(training.GRID_PATH.read_text())


@pytest.fixture(scope="module")
def grid():
    return training.load_grid()


@pytest.fixture(scope="module")
def clean():
    torch.set_num_threads(1)
    return training.clean_statistics(training.Setup())


def test_the_file_is_small_and_holds_the_whole_grid(raw, grid, script):
    assert training.GRID_PATH.stat().st_size < 200_000
    assert raw["percentiles"] == list(script.PERCENTILES)
    assert raw["rates"] == list(script.RATES)
    assert raw["seeds"] == list(script.SEEDS)
    assert sorted(grid) == [(q, r) for q in script.PERCENTILES for r in script.RATES]
    for experiment in grid.values():
        assert experiment.setup == script.SETUP
        assert list(experiment.runs) == list(training.METHODS)
        for runs in experiment.runs.values():
            assert [r.seed for r in runs] == list(script.SEEDS)
            for run in runs:
                assert len(run.acted) == len(run.corrupted) == script.SETUP.steps
                assert len(run.test_loss) == len(run.eval_steps)


def test_the_thresholds_reproduce(grid, clean):
    norms, maxes = clean
    for (q, _), experiment in grid.items():
        assert experiment.thresholds == training.thresholds_at(q, norms, maxes)


@pytest.mark.parametrize("cell", [(99, 0.2), (90, 0.0)])
def test_runs_of_one_seed_reproduce(grid, cell):
    torch.set_num_threads(1)
    experiment = grid[cell]
    seed = 2
    for method, runs in experiment.runs.items():
        stored = next(r for r in runs if r.seed == seed)
        thresholds = None if method == "none" else experiment.thresholds
        rerun = training.train_run(method, seed, experiment.rate, thresholds, experiment.setup)
        np.testing.assert_array_equal(rerun.eval_steps, stored.eval_steps)
        np.testing.assert_array_equal(rerun.test_loss, stored.test_loss)
        np.testing.assert_array_equal(rerun.acted, stored.acted)
        np.testing.assert_array_equal(rerun.corrupted, stored.corrupted)


def test_a_round_trip_keeps_every_stored_number(grid):
    again = training.grid_from_dict(training.grid_to_dict(grid))
    assert sorted(again) == sorted(grid)
    for key, experiment in grid.items():
        assert again[key].thresholds == experiment.thresholds
        for method, runs in experiment.runs.items():
            for a, b in zip(again[key].runs[method], runs, strict=True):
                np.testing.assert_array_equal(a.test_loss, b.test_loss)
                np.testing.assert_array_equal(a.acted, b.acted)
                assert np.isnan(a.total_norm).all()  # not stored
