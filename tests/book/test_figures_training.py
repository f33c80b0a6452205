"""Tests of gradlab_book.figures.training (chapter 7): the experiment's pieces and figures."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from gradlab_book.demos import small_mlp
from gradlab_book.figures import training
from gradlab_book.plots import png_bytes

TINY = training.Setup(n_train=32, n_test=16, batch=8, steps=6, eval_every=2)


def _thresholds(norm: float, value: float) -> training.Thresholds:
    return training.Thresholds(50.0, norm, value)


# ----------------------------------------------------------------------- corruption


@pytest.mark.parametrize("rate, expected", [(0.0, 0), (1.0, 50), (-3.0, 0), (7.0, 50)])
def test_corruption_schedule_extremes(rate, expected):
    assert training.corruption_schedule(50, rate, seed=0).sum() == expected


def test_corruption_schedule_is_seeded_and_nan_means_none():
    a = training.corruption_schedule(200, 0.3, seed=4)
    assert np.array_equal(a, training.corruption_schedule(200, 0.3, seed=4))
    assert not np.array_equal(a, training.corruption_schedule(200, 0.3, seed=5))
    assert 20 < a.sum() < 100
    assert training.corruption_schedule(10, math.nan, seed=0).sum() == 0


def test_corrupt_labels_scale_zero_is_identity():
    y = torch.arange(4.0).unsqueeze(1)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(training.corrupt_labels(y, 0.0, g), y)


def test_make_data_shapes():
    x_tr, y_tr, x_te, y_te = training.make_data(TINY)
    assert x_tr.shape == (32, TINY.d_in) and y_tr.shape == (32, 1)
    assert x_te.shape == (16, TINY.d_in) and y_te.shape == (16, 1)


# ----------------------------------------------------------------------- thresholds


def test_thresholds_at_matches_numpy_and_extremes():
    norms, maxes = np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.1, 0.2, 0.3, 0.4])
    t = training.thresholds_at(50, norms, maxes)
    assert t.norm == pytest.approx(np.percentile(norms, 50))
    assert t.value == pytest.approx(np.percentile(maxes, 50))
    low = training.thresholds_at(0, norms, maxes)
    assert (low.norm, low.value) == (1.0, 0.1)
    top = training.thresholds_at(100, norms, maxes)
    assert math.isinf(top.norm) and math.isinf(top.value)
    empty = training.thresholds_at(50, np.zeros(0), np.zeros(0))
    assert math.isinf(empty.norm)


@pytest.mark.parametrize("bad", [-1.0, 100.5, math.nan])
def test_thresholds_at_rejects_bad_percentiles(bad):
    with pytest.raises(ValueError):
        training.thresholds_at(bad, np.ones(3), np.ones(3))


# -------------------------------------------------------------------------- runs


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError):
        training.train_run("clip_harder", 0, 0.0, None, TINY)


def test_infinite_thresholds_change_nothing():
    base = training.train_run("none", 1, 0.5, None, TINY)
    for method in training.METHODS:
        run = training.train_run(method, 1, 0.5, _thresholds(math.inf, math.inf), TINY)
        np.testing.assert_allclose(run.test_loss, base.test_loss, rtol=1e-6)
        assert not run.acted.any()
    assert np.array_equal(base.corrupted, training.corruption_schedule(TINY.steps, 0.5, 1))


@pytest.mark.parametrize(
    "method", ["clip_norm", "clip_value", "ignore_norm", "ignore_value", "skip"]
)
def test_zero_thresholds_freeze_the_model(method):
    run = training.train_run(method, 0, 0.0, _thresholds(0.0, 0.0), TINY)
    assert run.acted.all()
    # every gradient is zeroed (clip to 0), ignored or skipped: the weights never move
    np.testing.assert_allclose(run.test_loss, run.test_loss[0], rtol=1e-6)


def test_clip_norm_run_matches_torch_clip_grad_norm():
    tau = 0.5
    run = training.train_run("clip_norm", 2, 0.5, _thresholds(tau, math.inf), TINY)
    # the same loop written with torch.nn.utils and the module's seeded pieces
    x_tr, y_tr, x_te, y_te = training.make_data(TINY)
    model = small_mlp(TINY.d_in, TINY.hidden, 1, seed=2)
    opt = torch.optim.SGD(model.parameters(), lr=TINY.lr, momentum=TINY.momentum)
    order = training._batch_order(TINY, 2)
    schedule = training.corruption_schedule(TINY.steps, 0.5, 2)
    noise = torch.Generator().manual_seed(20_000 + 2)
    for step in range(TINY.steps):
        xb, yb = x_tr[order[step]], y_tr[order[step]]
        if schedule[step]:
            yb = training.corrupt_labels(yb, TINY.corruption_scale, noise)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tau)
        opt.step()
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(x_te), y_te).item()
    assert run.final_test_loss == pytest.approx(final, rel=1e-5)


def test_acted_flags_follow_the_rules():
    run = training.train_run("ignore_norm", 3, 0.5, _thresholds(2.0, math.inf), TINY)
    assert np.array_equal(run.acted, ~(2.0 / (run.total_norm + 1e-6) >= 1))
    run = training.train_run("ignore_value", 3, 0.5, _thresholds(math.inf, 0.5), TINY)
    assert np.array_equal(run.acted, ~(run.max_abs < 0.5))


def test_non_finite_batches_ignored_or_diverged_never_raise():
    setup = training.Setup(
        n_train=32, n_test=16, batch=8, steps=6, eval_every=2, corruption_scale=math.inf
    )
    none = training.train_run("none", 0, 1.0, None, setup)
    assert none.diverged and math.isinf(none.final_test_loss)
    assert len(none.test_loss) == len(none.eval_steps)
    for method in ["ignore_norm", "ignore_value", "skip"]:
        run = training.train_run(method, 0, 1.0, _thresholds(5.0, 5.0), setup)
        assert run.acted.all() and not run.diverged
        np.testing.assert_allclose(run.test_loss, run.test_loss[0], rtol=1e-6)


# --------------------------------------------------------------------- summaries


def test_band_and_summary():
    experiment = training.run_experiment(
        0.5, _thresholds(1.0, 0.5), seeds=[0, 1, 2], setup=TINY, methods=["none", "skip"]
    )
    steps, median, lo, hi = training.band(experiment.runs["none"])
    losses = np.stack([r.test_loss for r in experiment.runs["none"]])
    np.testing.assert_allclose(median, np.median(losses, 0))
    assert np.all(lo <= median) and np.all(median <= hi)
    assert list(steps) == [0, 2, 4, 6]
    rows = {r["method"]: r for r in training.summary_rows(experiment)}
    assert rows["none"]["acted"] == 0.0 and math.isnan(rows["none"]["precision"])
    assert 0.0 <= rows["skip"]["acted"] <= 1.0
    assert training.band([])[0].size == 0


def test_band_treats_divergence_as_infinite():
    run = training.RunResult(
        "none",
        0,
        np.array([0, 1]),
        np.array([1.0, math.nan]),
        np.ones(1),
        np.ones(1),
        np.zeros(1, bool),
        np.zeros(1, bool),
    )
    _, median, _, hi = training.band([run, run])
    assert math.isinf(median[-1]) and math.isinf(hi[-1])


def test_experiment_grid_shares_uncontrolled_runs():
    grid = training.experiment_grid(
        [50, 100],
        [0.0, 1.0],
        np.array([1.0, 2.0]),
        np.array([0.5, 1.0]),
        seeds=[0],
        setup=TINY,
        methods=["none", "ignore_norm"],
    )
    assert set(grid) == {(50, 0.0), (50, 1.0), (100, 0.0), (100, 1.0)}
    assert grid[(50, 1.0)].runs["none"] is grid[(100, 1.0)].runs["none"]
    assert math.isinf(grid[(100, 0.0)].thresholds.norm)


# ----------------------------------------------------------------------- figures


def _render(fig: Figure) -> None:
    assert isinstance(fig, Figure)
    assert png_bytes(fig).startswith(b"\x89PNG")


def test_figures_render_at_the_extremes():
    setup = training.Setup(
        n_train=32, n_test=16, batch=8, steps=6, eval_every=2, corruption_scale=math.inf
    )
    grid = training.experiment_grid(
        [0, 100],
        [0.0, 1.0],
        np.array([1.0, 2.0]),
        np.array([0.5, 1.0]),
        seeds=[0, 1],
        setup=setup,
    )
    for (q, r), experiment in grid.items():
        _render(training.grid_figure(q, r, grid))
        _render(training.loss_curves_figure(experiment))
    for run in grid[(0, 1.0)].runs.values():
        for threshold in (0.0, 1.0, math.inf, math.nan):
            _render(training.norm_trace_figure(run[0], threshold))


def test_seed_acted_and_stall_tables():
    experiment = training.run_experiment(
        0.5, _thresholds(1.0, 0.5), seeds=[0, 1], setup=TINY, methods=["none", "skip"]
    )
    reference = training.run_experiment(
        0.0, _thresholds(1.0, 0.5), seeds=[0, 1], setup=TINY, methods=["none"]
    )
    text = training.seed_table(experiment, reference)
    lines = text.splitlines()
    assert lines[0].split()[-3:] == ["mean", "median", "failed"]
    assert lines[1].startswith("clean data, no control") and lines[1].endswith("0/2")
    assert "skip (StepGuard)" in text
    finals = [r.final_test_loss for r in experiment.runs["skip"]]
    limit = training.FAIL_FACTOR * np.median([r.final_test_loss for r in reference.runs["none"]])
    failed = sum(not f <= limit for f in finals)
    skip_line = next(line for line in lines if line.startswith("skip"))
    assert skip_line.endswith(f"{failed}/2")
    assert "precision" in training.acted_table(experiment)
    stall = training.stall_table({95: experiment}, "skip").splitlines()
    assert len(stall) == 3 and stall[0].split()[0] == "q"


def test_clipped_displacement_is_eta_tau_over_one_minus_mu():
    first, total = training.clipped_displacement(2.0, 0.1, 0.9, steps=400)
    assert first == pytest.approx(0.2)
    assert total == pytest.approx(0.2 / (1 - 0.9), rel=1e-9)
    first, steady = training.clipped_displacement(2.0, 0.1, 0.5, steps=100, repeat=True)
    assert first == pytest.approx(0.2) and steady == pytest.approx(0.4, rel=1e-9)


def test_best_percentile_and_tuned_table_follow_the_stored_runs():
    # An independent reading of the stored JSON: fewest failures, then lowest median.
    data = training.load_data()
    grid = training.load_grid()
    setup = training.Setup(**data["setup"])
    clean = next(c for c in data["cells"] if c["rate"] == 0.0)["runs"]["none"]

    def finals(cell, method):
        losses = [r["test_loss"][-1] for r in cell["runs"][method]]
        return np.array([math.inf if v is None else float(np.float32(v)) for v in losses])

    limit = training.FAIL_FACTOR * float(np.median(finals({"runs": {"none": clean}}, "none")))
    assert setup.steps > 0
    for rate in (0.1, 0.2):
        cells = [c for c in data["cells"] if c["rate"] == rate]
        for method in ("clip_norm", "skip", "clip_skip"):
            scores = {
                c["percentile"]: (
                    int(np.sum(~(finals(c, method) <= limit))),
                    float(np.median(finals(c, method))),
                    c["percentile"],
                )
                for c in cells
            }
            want = min(scores, key=scores.get)
            assert training.best_percentile(grid, rate, method) == want
        table = training.tuned_table(grid, rate)
        assert len(table.splitlines()) == len(training.METHODS) + 3
        best = training.best_percentile(grid, rate, "clip_norm")
        row = next(line for line in table.splitlines() if line.startswith("clip by norm"))
        assert row.split()[3] == f"{best:g}"
    with pytest.raises(ValueError, match="rates"):
        training.tuned_table(grid, 0.5)
    assert training.percentiles_of(grid, 0.1) == sorted(data["percentiles"])
