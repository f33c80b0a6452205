"""Tests of gradlab_book.figures.rnn (the RNN chapter): task, model, training, figures."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from gradlab_book.figures import rnn
from gradlab_book.plots import png_bytes

TINY = rnn.Setup(steps=40, n_test=64, eval_every=10, stride=5, calibration_steps=10)
THRESHOLDS = {"norm": 0.5, "value": 0.2}


# ---------------------------------------------------------------------------- task


@pytest.mark.parametrize("length", [4, 5, 10, 20, 37])
def test_addition_batch_marks_two_steps_and_sums_them(length):
    x, y = rnn.addition_batch(256, length, torch.Generator().manual_seed(length))
    assert x.shape == (256, length, 2) and y.shape == (256, 1)
    marks = x[..., 1]
    assert torch.all(marks.sum(1) == 2)
    assert torch.all((x[..., 0] >= 0) & (x[..., 0] <= 1))
    positions = torch.stack([row.nonzero().flatten() for row in marks])
    first_end = max(1, length // 10)
    assert torch.all(positions[:, 0] < first_end)
    assert torch.all(positions[:, 1] >= first_end)
    assert torch.all(positions[:, 1] < max(first_end + 1, length // 2))
    expected = (x[..., 0].double() * marks.double()).sum(1, keepdim=True)
    assert torch.allclose(y.double(), expected, atol=1e-6)


def test_addition_batch_is_seeded_and_rejects_short_sequences():
    a = rnn.addition_batch(8, 10, torch.Generator().manual_seed(3))
    b = rnn.addition_batch(8, 10, torch.Generator().manual_seed(3))
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    with pytest.raises(ValueError, match="length"):
        rnn.addition_batch(8, 3, torch.Generator())


def test_predicting_one_scores_about_a_sixth():
    _, y = rnn.test_set(20, rnn.Setup(n_test=20_000))
    assert ((y - 1) ** 2).mean().item() == pytest.approx(1 / 6, rel=0.03)


def test_test_set_is_fixed_per_length():
    a, b = rnn.test_set(10, TINY), rnn.test_set(10, TINY)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0][..., 0], rnn.test_set(11, TINY)[0][..., 0][:, :10])


# --------------------------------------------------------------------------- model


def test_make_model_has_the_stated_initialisation():
    setup = rnn.Setup(hidden=16, spectral_radius=1.3)
    model = rnn.make_model(4, setup)
    w = model.rnn.weight_hh_l0.detach().double()
    assert torch.linalg.eigvals(w).abs().max().item() == pytest.approx(1.3, rel=1e-6)
    for bias in (model.rnn.bias_ih_l0, model.rnn.bias_hh_l0, model.readout.bias):
        assert torch.all(bias == 0)
    again = rnn.make_model(4, setup)
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters(), strict=True)
    )
    other = rnn.make_model(5, setup)
    assert not torch.equal(model.rnn.weight_hh_l0, other.rnn.weight_hh_l0)


def test_model_matches_the_recurrence_it_states():
    model = rnn.make_model(0, rnn.Setup(hidden=8)).double()
    x, _ = rnn.addition_batch(3, 6, torch.Generator().manual_seed(0))
    x = x.double()
    r = model.rnn
    h = torch.zeros(3, 8, dtype=torch.float64)
    for t in range(6):
        h = torch.tanh(
            h @ r.weight_hh_l0.T + x[:, t] @ r.weight_ih_l0.T + r.bias_ih_l0 + r.bias_hh_l0
        )
    with torch.no_grad():
        assert torch.allclose(model(x), model.readout(h), atol=1e-12)


@pytest.mark.parametrize("length", [1, 5, 20])
def test_jacobian_check_product_equals_autograd_and_obeys_the_bound(length):
    check = rnn.jacobian_check(max(length, 4), seed=1)
    assert check["max_difference"] < 1e-10
    assert check["product_norm"] <= check["bound"] * (1 + 1e-9)
    assert check["spectral_radius"] == pytest.approx(1.0, rel=1e-6)
    assert check["w_norm"] >= check["spectral_radius"] - 1e-9


# ------------------------------------------------------------------------ training


def test_train_run_rejects_unknown_methods():
    with pytest.raises(ValueError, match="method"):
        rnn.train_run(5, "clip", 0, TINY)


def test_train_run_records_windows_and_evaluations():
    run = rnn.train_run(5, "clip_norm", 0, TINY, THRESHOLDS, steps=23)
    assert run["steps_run"] == 23 and run["eval_steps"] == [0, 10, 20, 23]
    assert len(run["norm_max"]) == len(run["acted"]) == 5  # 4 full windows and 3 steps
    assert all(0 <= a <= 5 for a in run["acted"])
    assert run["solved_at"] is None and not run["diverged"]


def test_train_run_is_deterministic():
    a = rnn.train_run(6, "skip", 2, TINY, THRESHOLDS)
    b = rnn.train_run(6, "skip", 2, TINY, THRESHOLDS)
    assert a == b


def test_infinite_thresholds_change_nothing():
    calm = replace(TINY, lr=0.05)  # no divergence: a NaN norm would count as acted on
    base = rnn.train_run(5, "none", 1, calm)
    assert not base["diverged"]
    for method in ("clip_norm", "clip_value", "zero", "skip"):
        run = rnn.train_run(5, method, 1, calm)
        assert run["test_mse"] == base["test_mse"], method
        assert run["norm_max"] == base["norm_max"], method
        assert sum(run["acted"]) == 0, method


def test_zero_is_skip_bit_for_bit_with_plain_sgd():
    setup = replace(TINY, skip_factor=1.0)
    zero = rnn.train_run(5, "zero", 0, setup, THRESHOLDS)
    skip = rnn.train_run(5, "skip", 0, setup, THRESHOLDS)
    assert sum(zero["acted"]) > 0
    assert {k: v for k, v in zero.items() if k != "method"} == {
        k: v for k, v in skip.items() if k != "method"
    }


def test_zero_threshold_acts_on_every_step():
    for method in ("clip_norm", "clip_value", "zero", "skip"):
        run = rnn.train_run(5, method, 0, TINY, {"norm": 0.0, "value": 0.0}, steps=10)
        assert sum(run["acted"]) == 10, method


def test_low_lr_reference_uses_the_low_learning_rate():
    fast = rnn.train_run(5, "none", 0, TINY, steps=10)
    slow = rnn.train_run(5, "none_low_lr", 0, TINY, steps=10)
    same = rnn.train_run(
        5,
        "none_low_lr",
        0,
        replace(TINY, low_lr=TINY.lr),
        steps=10,
    )
    assert slow["test_mse"] != fast["test_mse"]
    assert same["test_mse"] == fast["test_mse"]


def test_a_run_stops_when_solved():
    easy = replace(TINY, success_mse=100.0)
    run = rnn.train_run(5, "none", 0, easy)
    assert run["solved_at"] == easy.eval_every == run["steps_run"]


def test_a_run_stops_when_it_diverges():
    wild = replace(TINY, lr=1e4)
    run = rnn.train_run(10, "none", 0, wild)
    assert run["diverged"] and run["solved_at"] is None
    assert run["test_mse"][-1] is None and run["steps_run"] < wild.steps


def test_calibrate_takes_medians_of_uncontrolled_steps():
    th = rnn.calibrate(5, TINY)
    norms, maxes = [], []
    for seed in TINY.calibration_seeds:
        run = rnn.train_run(5, "none", seed, TINY, steps=TINY.calibration_steps, record=True)
        norms += run["step_norms"]
        maxes += run["step_max_abs"]
    assert th == {"norm": float(np.median(norms)), "value": float(np.median(maxes))}
    assert 0 < th["value"] <= th["norm"]


# ------------------------------------------------------------------ tables, figures


@pytest.fixture(scope="module")
def tiny_data():
    lengths, seeds = [5, 8], [0, 1]
    thresholds = {str(t): rnn.calibrate(t, TINY) for t in lengths}
    runs = [
        rnn.train_run(t, m, s, TINY, thresholds[str(t)])
        for t in lengths
        for m in rnn.METHODS
        for s in seeds
    ]
    return {
        "setup": TINY,
        "lengths": lengths,
        "methods": list(rnn.METHODS),
        "seeds": seeds,
        "thresholds": thresholds,
        "runs": runs,
    }


def test_success_table_counts_every_run_once(tiny_data):
    rows = rnn.success_table(tiny_data)
    assert len(rows) == 2 * len(rnn.METHODS)
    for row in rows:
        assert row["runs"] == 2
        assert row["solved"] + row["diverged"] + row["stalled"] == 2
        assert len(row["solved_seeds"]) == row["solved"]
        assert math.isnan(row["median_steps"]) == (row["solved"] == 0)


def test_success_table_on_hand_made_runs():
    def run(method, seed, solved_at, diverged=False):
        return {
            "length": 5,
            "method": method,
            "seed": seed,
            "solved_at": solved_at,
            "diverged": diverged,
        }

    data = {
        "lengths": [5],
        "methods": ["none", "clip_norm"],
        "runs": [
            run("none", 0, None, True),
            run("none", 1, 300),
            run("clip_norm", 0, 100),
            run("clip_norm", 1, 500),
        ],
    }
    none, clip = rnn.success_table(data)
    assert (none["solved"], none["diverged"], none["stalled"], none["solved_seeds"]) == (
        1,
        1,
        0,
        [1],
    )
    assert (clip["solved"], clip["median_steps"]) == (2, 300.0)
    lines = rnn.success_lines({**data, "seeds": [0, 1]})
    assert len(lines) == 11
    assert lines[10].split()[-2:] == ["300", "300"]
    assert lines[1].split()[-2:] == ["1/2", "2/2"]
    assert lines[4].split()[-4:] == ["1d", "0s", "0d", "0s"]
    assert lines[7].split()[-2:] == ["1", "0,1"]


def test_figures_draw(tiny_data):
    figures = [
        rnn.success_figure(tiny_data),
        rnn.curves_figure(tiny_data, 5, "none"),
        rnn.curves_figure(tiny_data, 8, "skip"),
        rnn.cliff_figure(tiny_data, 8, 1, ["none", "clip_norm", "skip"]),
    ]
    for fig in figures:
        assert isinstance(fig, Figure)
        assert png_bytes(fig, dpi=40).startswith(b"\x89PNG")


def test_setup_round_trips_through_json_values():
    assert rnn.setup_from(rnn.setup_dict(TINY)) == TINY


def test_run_stats_of_a_hand_made_run():
    run = {
        "steps_run": 50,
        "acted": [5, 0],
        "test_mse": [1.0, 0.5, None],
        "norm_max": [2.0, None, 4.0],
    }
    stats = rnn.run_stats(run)
    assert stats == {
        "steps_run": 50,
        "acted_share": 0.1,
        "last_mse": 0.5,
        "peak_norm": 4.0,
        "median_norm": 3.0,
    }
