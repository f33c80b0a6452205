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

TINY = rnn.Setup(steps=40, n_test=64, eval_every=10, stride=5, calibration_steps=20)
THRESHOLDS = {"norm": 0.5, "value": 0.2, "zero": 2.0, "skip": 3.0}
INF = dict.fromkeys(THRESHOLDS, math.inf)


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


def test_batched_forward_is_each_models_own_forward():
    """One bmm per step for all models gives what torch.nn.RNN gives for each."""
    setup = rnn.Setup(hidden=8)
    models = [rnn.make_model(s, setup) for s in (0, 1, 2)]
    for m in models:  # biases off zero, so that both biases are exercised
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    x, _ = rnn.addition_batch(4, 9, torch.Generator().manual_seed(1))
    params = [torch.stack(ps) for ps in zip(*(list(m.parameters()) for m in models), strict=True)]
    with torch.no_grad():
        shared = rnn.forward(params, x)
        own = rnn.forward(params, x.unsqueeze(0).expand(3, -1, -1, -1))
        for k, m in enumerate(models):
            expected = m(x).squeeze(-1)
            assert torch.allclose(shared[k], expected, atol=1e-6)
            assert torch.allclose(own[k], expected, atol=1e-6)


def _reference(length, lr, control, seed, thresholds, setup, steps):
    """One run with torch.nn.RNN, torch.nn.utils and a float64 norm: no gradlab."""
    model = rnn.make_model(seed, setup)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr)
    stream = torch.Generator().manual_seed(10_000 + seed)
    x_test, y_test = rnn.test_set(length, setup)
    mse = []
    for step in range(steps + 1):
        if step % setup.eval_every == 0:
            with torch.no_grad():
                mse.append(torch.nn.functional.mse_loss(model(x_test), y_test).item())
        if step == steps:
            break
        x, y = rnn.addition_batch(setup.batch, length, stream)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        norm = math.sqrt(sum((p.grad.double() ** 2).sum().item() for p in params))
        if control == "clip_norm":
            torch.nn.utils.clip_grad_norm_(params, thresholds["norm"])
        elif control == "clip_value":
            torch.nn.utils.clip_grad_value_(params, thresholds["value"])
        elif control in ("zero", "skip") and norm + 1e-6 > thresholds[control]:
            continue  # plain SGD: a zeroed gradient moves nothing, as a skipped step
        opt.step()
    return mse


@pytest.mark.parametrize("control", rnn.CONTROLS)
def test_each_run_of_a_group_is_the_run_torch_trains_alone(control):
    setup = replace(TINY, eval_every=10)
    (calm,) = rnn.train_group(6, [(0.1, "none", 1)], None, setup, 30, record=True)
    norms, maxes = calm["step_norms"], calm["step_max_abs"]
    # Thresholds inside the run's own range, so that each control acts on some steps.
    # The first norm is the run's largest; a zero or skip below the norms at the start
    # would act on every step (the parameters never move), so theirs is just under it.
    thresholds = {
        "norm": float(np.median(norms)),
        "value": float(np.median(maxes)),
        "zero": 0.9 * norms[0],
        "skip": 0.9 * norms[0],
    }
    runs = [(0.1, control, 1), (0.3, "none", 2), (0.2, "clip_norm", 1)]
    got = rnn.train_group(6, runs, thresholds, setup, steps=30)[0]
    want = _reference(6, 0.1, control, 1, thresholds, setup, 30)
    assert got["test_mse"] == pytest.approx(want, rel=1e-4)
    if control != "none":
        assert 0 < sum(got["acted"]) < 30, "the threshold must act on some steps only"


def test_train_group_rejects_unknown_controls_and_missing_thresholds():
    with pytest.raises(ValueError, match="control"):
        rnn.train_group(5, [(0.1, "clip", 0)], THRESHOLDS, TINY)
    with pytest.raises(ValueError, match="thresholds"):
        rnn.train_group(5, [(0.1, "zero", 0)], None, TINY)


def test_train_group_records_windows_evaluations_and_probes():
    run, other = rnn.train_group(5, [(0.1, "clip_norm", 0), (0.1, "zero", 0)], THRESHOLDS, TINY, 23)
    assert run["steps_run"] == 23 and run["eval_steps"] == [0, 10, 20, 23]
    assert len(run["norm_max"]) == len(run["acted"]) == 5  # 4 full windows and 3 steps
    assert all(0 <= a <= 5 for a in run["acted"])
    assert run["solved_at"] is None and not run["diverged"]
    assert all(len(v) == 3 for v in run["probe"].values())
    assert "probe" not in other


def test_the_probe_is_the_mse_after_a_clipped_step():
    """Probe 0 of a run: recompute by hand, moving nn.RNN's parameters by lr * tau
    along -g/||g|| (the gradient of the first batch) and evaluating on the test set."""
    lr, tau = 0.1, THRESHOLDS["norm"]
    run = rnn.train_group(5, [(lr, "none", 3)], THRESHOLDS, TINY, 5)[0]
    model = rnn.make_model(3, TINY)
    x, y = rnn.addition_batch(TINY.batch, 5, torch.Generator().manual_seed(10_003))
    torch.nn.functional.mse_loss(model(x), y).backward()
    norm = math.sqrt(sum((p.grad.double() ** 2).sum().item() for p in model.parameters()))
    x_test, y_test = rnn.test_set(5, TINY)
    with torch.no_grad():
        before = torch.nn.functional.mse_loss(model(x_test), y_test).item()
        for p in model.parameters():
            p -= lr * tau * p.grad / norm
        after = torch.nn.functional.mse_loss(model(x_test), y_test).item()
    probe = run["probe"]
    assert probe["norm"][0] == pytest.approx(norm, rel=1e-4)
    assert probe["mse"][0] == pytest.approx(before, rel=1e-4)
    assert probe["along"][0] == pytest.approx(after, rel=1e-4)
    assert probe["random"][0] != probe["along"][0]


def test_train_group_is_deterministic():
    runs = [(0.3, c, 2) for c in rnn.CONTROLS]
    assert rnn.train_group(6, runs, THRESHOLDS, TINY) == rnn.train_group(6, runs, THRESHOLDS, TINY)


def test_infinite_thresholds_change_nothing():
    runs = [(0.05, c, 1) for c in rnn.CONTROLS]
    base, *others = rnn.train_group(5, runs, INF, TINY)
    assert not base["diverged"]
    for run in others:
        assert run["test_mse"] == base["test_mse"], run["control"]
        assert run["norm_max"] == base["norm_max"], run["control"]
        assert sum(run["acted"]) == 0, run["control"]


def test_zero_thresholds_act_on_every_step():
    zeros = dict.fromkeys(THRESHOLDS, 0.0)
    for run in rnn.train_group(5, [(0.1, c, 0) for c in rnn.CONTROLS[1:]], zeros, TINY, 10):
        assert sum(run["acted"]) == 10, run["control"]


def test_a_run_stops_when_solved_or_diverged():
    easy = replace(TINY, success_mse=100.0)
    (run,) = rnn.train_group(5, [(0.1, "none", 0)], None, easy)
    assert run["solved_at"] == 0 == run["steps_run"]  # solved at the first evaluation
    wild, calm = rnn.train_group(10, [(1e4, "none", 0), (0.01, "none", 0)], None, TINY)
    assert wild["diverged"] and wild["solved_at"] is None
    assert wild["test_mse"][-1] is None and wild["steps_run"] < TINY.steps
    assert calm["steps_run"] == TINY.steps and not calm["diverged"]


def test_calibrate_pools_the_calm_runs_only():
    th = rnn.calibrate(5, TINY)
    runs = [(TINY.calibration_lr, "none", s) for s in TINY.calibration_seeds]
    done = rnn.train_group(5, runs, None, TINY, TINY.calibration_steps, record=True)
    norms = [v for r in done for v in r["step_norms"]]
    maxes = [v for r in done for v in r["step_max_abs"]]
    assert all(s["calm"] for s in th["seeds"])
    assert th["norm"] == float(np.median(norms))
    assert th["value"] == float(np.median(maxes))
    assert th["zero"] == float(np.percentile(norms, TINY.zero_percentile))
    assert th["norm"] < th["zero"] <= th["skip"] <= max(norms)
    strict = replace(TINY, calm_ratio=1.0)  # no run stays at its own median
    with pytest.raises(RuntimeError, match="calm"):
        rnn.calibrate(5, strict)
    wild = replace(TINY, calibration_lr=1e4, calibration_seeds=(900, 901))
    with pytest.raises(RuntimeError, match="calm"):
        rnn.calibrate(5, wild)


# ------------------------------------------------------------------ tables, figures


def _run(lr, control, seed, last, solved=None, diverged=False, acted=(0,), steps=100):
    return {
        "length": 20,
        "lr": lr,
        "control": control,
        "seed": seed,
        "eval_steps": [0, steps],
        "test_mse": [1.0, None if diverged else last],
        "norm_max": [1.0] * len(acted),
        "acted": list(acted),
        "steps_run": steps,
        "solved_at": solved,
        "diverged": diverged,
    }


@pytest.fixture
def hand_made():
    return {
        "setup": TINY,
        "lengths": [20],
        "lrs": [0.1, 0.3],
        "controls": ["none", "clip_norm"],
        "seeds": [0, 1],
        "thresholds": {"20": {"norm": 1.0, "value": 0.5, "zero": 2.0, "skip": 3.0}},
        "runs": [
            _run(0.1, "none", 0, 0.05),
            _run(0.1, "none", 1, 0.008, solved=100),
            _run(0.3, "none", 0, None, diverged=True, steps=30),
            _run(0.3, "none", 1, 0.02),
            _run(0.1, "clip_norm", 0, 0.09, acted=(10,)),
            _run(0.1, "clip_norm", 1, 0.07, acted=(30,)),
            _run(0.3, "clip_norm", 0, 0.009, solved=100, acted=(50,)),
            _run(0.3, "clip_norm", 1, 0.005, solved=100, acted=(70,)),
        ],
    }


def test_summary_and_best_rates_on_hand_made_runs(hand_made):
    s = rnn.summary(rnn.runs_of(hand_made, 20, "none", 0.3))
    assert (s["solved"], s["diverged"], s["stalled"]) == (0, 1, 1)
    assert s["last_mse"] == [math.inf, 0.02] and s["median_mse"] == math.inf
    assert s["acted_share"] == 0.0
    c = rnn.summary(rnn.runs_of(hand_made, 20, "clip_norm", 0.1))
    assert c["median_mse"] == pytest.approx(0.08) and c["acted_share"] == 0.2
    assert rnn.best_rates(hand_made, 20) == {"none": 0.1, "clip_norm": 0.3}
    lines = rnn.sweep_lines(hand_made, 20)
    assert lines[1].split()[1:] == ["1/2", "0d", "0/2", "0d"]
    assert lines[2].split()[1:] == ["0/2", "1d", "2/2", "0d"]
    assert lines[3].split()[1:] == ["0.1", "0.3"]


def test_direction_stats_on_hand_made_probes(hand_made):
    run = hand_made["runs"][4]
    run["probe"] = {
        "norm": [1.0, 5.0, 6.0, 7.0],  # the first is below the zero threshold, 2.0
        "mse": [0.5, 0.5, 0.5, None],
        "along": [0.9, 0.4, 0.3, 0.1],
        "random": [0.1, 0.6, 0.4, 0.1],
    }
    for other in hand_made["runs"]:
        if other["control"] == "clip_norm" and other is not run:
            other["probe"] = {k: [] for k in run["probe"]}
    stats = rnn.direction_stats(hand_made, 20)
    assert stats["n"] == 2
    assert stats["along_lower"] == 1.0 and stats["random_lower"] == 0.5
    assert stats["along_median"] == pytest.approx(-0.15)
    assert stats["random_median"] == pytest.approx(0.0)


def test_figures_draw(hand_made):
    figures = [
        rnn.sweep_figure(hand_made),
        rnn.cliff_figure(hand_made, 20, 0.3, 0),
    ]
    for fig in figures:
        assert isinstance(fig, Figure)
        assert png_bytes(fig, dpi=40).startswith(b"\x89PNG")


def test_setup_round_trips_through_json_values():
    assert rnn.setup_from(rnn.setup_dict(TINY)) == TINY
