"""Tests of gradlab_book.figures.thresholds (Part IV: choosing and monitoring a threshold).

The computations are checked against numpy and float64 arithmetic written here, and
the guarded training runs against a plain loop with torch.nn.utils.clip_grad_norm_.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from gradlab_book import demos
from gradlab_book.figures import adaptive
from gradlab_book.figures import thresholds as th
from gradlab_book.plots import png_bytes


@pytest.fixture(scope="module")
def traces() -> dict:
    return adaptive.load_traces()


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------- small helpers


def test_over_is_the_guard_rule_in_float64():
    # the 1e-6 counts: a norm just under the threshold is already over it
    norms = [0.5, 1.0 - 2e-6, 1.0 - 0.5e-6, 1.0, 3.0, math.inf, math.nan, 0.0]
    expected = [not (1.0 / (n + 1e-6) >= 1.0) for n in norms]
    assert th.over(norms, 1.0).tolist() == expected
    assert expected == [False, False, True, True, True, True, True, False]
    # no threshold: only the non-finite norms are over (inf / inf is NaN, not >= 1)
    assert th.over(norms, math.inf).tolist() == [False] * 5 + [True, True, False]


@pytest.mark.parametrize("percentile", [0, 50, 90, 99, 100])
def test_early_threshold_is_the_percentile_of_the_finite_warmup(percentile):
    gen = np.random.default_rng(3)
    norms = gen.lognormal(size=120)
    norms[[4, 17]] = math.nan
    norms[9] = math.inf
    warmup = 40
    window = norms[:warmup]
    finite = np.sort(window[np.isfinite(window)])
    r = percentile / 100 * (len(finite) - 1)
    lo, hi = math.floor(r), math.ceil(r)
    by_hand = finite[lo] + (r - lo) * (finite[hi] - finite[lo])
    got = th.early_threshold(norms, percentile, warmup)
    assert got == pytest.approx(by_hand, rel=1e-12)
    assert th.early_threshold([math.nan, math.inf], percentile, 2) == math.inf
    assert th.early_threshold([], percentile, 10) == math.inf


def test_drift_rates_by_hand(traces):
    for name in adaptive.TRACES:
        norms = traces[name]["norms"]
        for percentile, warmup in [(90, 50), (50, 25), (99, 200)]:
            rates = th.drift_rates(norms, percentile, warmup, span=100)
            tau = np.percentile(norms[:warmup], percentile)
            flags = [not (tau / (float(n) + 1e-6) >= 1.0) for n in norms]
            assert rates["threshold"] == pytest.approx(tau, rel=1e-12)
            assert rates["early"] == pytest.approx(np.mean(flags[warmup : warmup + 100]))
            assert rates["late"] == pytest.approx(np.mean(flags[-100:]))


def test_the_recorded_tanh_threshold_goes_to_sleep(traces):
    """The chapter's claim: a threshold from the first 50 steps never acts at the end."""
    rates = th.drift_rates(traces["tanh"]["norms"], 90, 50)
    assert rates["early"] > 0.05 and rates["late"] == 0.0
    mlp = th.drift_rates(traces["mlp"]["norms"], 90, 50)
    assert mlp["late"] > 2 * mlp["early"] > 0.2


def test_rolling_rate_and_silent_stretch_by_loop():
    gen = np.random.default_rng(0)
    flags = gen.random(300) < 0.1
    flags[150:260] = False
    width = 50
    rate = th.rolling_rate(flags, width)
    for t in range(len(flags)):
        if t < width - 1:
            assert math.isnan(rate[t])
        else:
            assert rate[t] == pytest.approx(flags[t - width + 1 : t + 1].mean())
    quiet = th.silent_stretch(flags, 100)
    first = next(t for t in range(99, len(flags)) if not flags[t - 99 : t + 1].any())
    assert quiet == first
    assert th.silent_stretch(np.ones(200, dtype=bool), 100) is None
    assert np.isnan(th.rolling_rate([True] * 3, 5)).all()


def test_window_rows_by_hand():
    norms = [1.0, 2.0, math.nan, 4.0, 8.0, 3.0, 5.0]
    decisions = ["kept", "clipped", "skipped", "kept", "clipped", "clipped", "kept"]
    rows = th.window_rows(norms, decisions, every=3)
    assert [r["last"] for r in rows] == [3, 6, 7]
    assert rows[0]["median"] == 1.5 and rows[0]["largest"] == 2.0
    assert rows[0]["clip"] == pytest.approx(1 / 3) and rows[0]["skip"] == pytest.approx(1 / 3)
    assert rows[1]["median"] == 4.0 and rows[1]["clip"] == pytest.approx(2 / 3)
    assert rows[2] == {"last": 7, "median": 5.0, "largest": 5.0, "clip": 0.0, "skip": 0.0}


# ----------------------------------------------------------------------- the runs


def test_batches_spoil_only_the_named_steps():
    x, y = th.make_data()
    clean = list(th.batches(x, y, 12, seed=2))
    spoiled = list(th.batches(x, y, 12, seed=2, bad=(3,), nan=(7,)))
    for (s, xa, ya), (t, xb, yb) in zip(clean, spoiled, strict=True):
        assert s == t
        if s == 3:
            assert torch.equal(xa, xb) and torch.equal(yb, ya * th.BAD_SCALE)
        elif s == 7:
            assert torch.equal(ya, yb) and math.isnan(float(xb[0, 0]))
            assert torch.equal(xa.flatten()[1:], xb.flatten()[1:])
        else:
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert xa.shape == (th.RUN["batch"], th.RUN["d_in"])


def _torch_loop(lr, threshold, steps, bad=(), nan=()):
    """The run of th.train written with torch.nn.utils: clip, skip non-finite steps."""
    x, y = th.make_data()
    model = demos.small_mlp(th.RUN["d_in"], th.RUN["hidden"], 1, seed=0)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=th.RUN["momentum"])
    norms, decisions = [], []
    for _, xb, yb in th.batches(x, y, steps, 0, bad, nan):
        demos.backward(model, xb, yb)
        grads = [p.grad for p in params]
        total = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])
        ).item()
        norms.append(total)
        if not math.isfinite(total):
            decisions.append("skipped")
        else:
            over = not (threshold / (total + 1e-6) >= 1.0)
            torch.nn.utils.clip_grad_norm_(params, threshold)
            decisions.append("clipped" if over else "kept")
            opt.step()
        opt.zero_grad(set_to_none=True)
    return model, np.array(norms), decisions, th.final_loss(model, x, y)


def test_train_matches_a_plain_torch_loop():
    steps, bad, nan = 60, (20,), (35,)
    run = th.train(0.05, 1.5, steps=steps, bad=bad, nan=nan)
    model, norms, decisions, loss = _torch_loop(0.05, 1.5, steps, bad, nan)
    assert run["decisions"].tolist() == decisions
    assert {"kept", "clipped", "skipped"} <= set(decisions)
    finite = np.isfinite(norms)
    assert np.array_equal(finite, np.isfinite(run["norms"]))
    np.testing.assert_allclose(run["norms"][finite], norms[finite], rtol=1e-5)
    for p, q in zip(run["model"].parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert run["loss"] == pytest.approx(loss, rel=1e-4)


def test_every_step_clipped_depends_on_the_product_only():
    """(lr, tau) and (2 lr, tau / 2) are the same run, bit for bit, when all steps clip."""
    a, b = th.train(0.1, 0.2, steps=80), th.train(0.2, 0.1, steps=80)
    assert (a["decisions"] == "clipped").all() and (b["decisions"] == "clipped").all()
    for p, q in zip(a["model"].parameters(), b["model"].parameters(), strict=True):
        assert torch.equal(p, q)


def test_lr_sweep_rows_are_the_runs_summarised(monkeypatch):
    calls = []
    real = th.train

    def spy(lr, threshold, steps, seed):
        calls.append((lr, threshold, seed))
        return real(lr, threshold, steps, seed)

    monkeypatch.setattr(th, "train", spy)
    rows = th.lr_sweep([0.01, 0.3], 3.0, settle=10, steps=40, seed=2, prefix=5)
    assert [r["lr"] for r in rows] == [0.01, 0.3]
    for row in rows:
        fixed = real(row["lr"], 3.0, 40, 2)
        own = np.percentile(fixed["norms"][10:], 90)
        assert row["own_threshold"] == pytest.approx(own, rel=1e-12)
        assert row["fixed"]["clip"] == pytest.approx(np.mean(fixed["decisions"][10:] == "clipped"))
        assert row["fixed"]["loss"] == pytest.approx(fixed["loss"], rel=1e-6)
        assert row["fixed"]["prefix"] == fixed["norms"][:5].tolist()
        assert (row["lr"], math.inf, 2) in calls
    assert {seed for *_, seed in calls} == {2}
    assert rows[1]["fixed"]["clip"] > rows[0]["fixed"]["clip"]
    assert all(0.0 <= r[k]["skip"] <= 1.0 for r in rows for k in ("fixed", "own", "none"))


def test_calibrate_is_the_chapters_warmup_threshold():
    """The p90 of the finite norms of steps 51-100 of the logged run, by a plain torch loop
    (the NaN batch of step 81 skipped, nothing clipped)."""
    settings = th.SWEEP
    _, norms, decisions, _ = _torch_loop(settings["calibrate_lr"], math.inf, 100,
                                         settings["bad"], settings["nan"])  # fmt: skip
    window = norms[50:100]
    assert not np.isfinite(window).all()  # the NaN batch is in the window
    expected = np.percentile(window[np.isfinite(window)], 90)
    assert th.calibrate(0) == pytest.approx(expected, rel=1e-5)
    assert "clipped" not in decisions


def _synthetic_sweep():
    def row(lr, seed):
        return {
            "lr": lr,
            "own_threshold": 1.0 + seed,
            "fixed": {"loss": 0.1 * (seed + 1), "clip": 0.1 * seed, "skip": 0.0},
            "own": {"loss": None if seed == 4 else 2.0 * seed, "clip": 0.05, "skip": 0.0},
            "none": {"loss": 1e30 if seed >= 2 else 0.3, "clip": 0.0, "skip": 0.0},
        }

    seeds = [{"seed": s, "threshold": 1.5, "rows": [row(0.1, s), row(0.2, s)]} for s in range(5)]
    return {"settings": {"lrs": [0.1], "exercise_lrs": [0.2]}, "seeds": seeds}


def test_load_sweep_reads_null_as_inf(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(_synthetic_sweep()))
    data = th.load_sweep(path)
    assert data["seeds"][4]["rows"][0]["own"]["loss"] == math.inf
    assert data["seeds"][0]["rows"][0]["own"]["loss"] == 0.0


def test_sweep_table_medians_and_divergence_by_hand(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(_synthetic_sweep()))
    data = th.load_sweep(path)
    (line,) = th.sweep_table(data)
    assert line["lr"] == 0.1 and line["seeds"] == [0, 1, 2, 3, 4]
    assert line["fixed"]["loss"] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert line["fixed"]["median_loss"] == pytest.approx(0.3)
    assert line["fixed"]["median_clip"] == pytest.approx(0.2)
    assert line["own"]["diverged"] == 1 and line["own"]["median_loss"] == pytest.approx(4.0)
    # 1e30 is above DIVERGED: three of five diverged, so the median is inf
    assert line["none"]["diverged"] == 3 and line["none"]["median_loss"] == math.inf
    assert line["own_threshold"]["median"] == pytest.approx(3.0)
    (other,) = th.sweep_table(data, [0.2])
    assert other["lr"] == 0.2
    with pytest.raises(ValueError, match=r"no learning rate 0\.3"):
        th.sweep_table(data, [0.3])


def test_the_stored_sweep_says_what_the_chapter_says():
    """The chapter's headline, from the stored table: above half the steps clipped,
    re-tuning the threshold was worse than keeping it on every seed, and lowering the
    learning rate was better than either; no threshold diverged at 0.1 and above."""
    data = th.load_sweep()
    table = {line["lr"]: line for line in th.sweep_table(data)}
    for lr in (0.1, 0.2):
        fixed, own = table[lr]["fixed"], table[lr]["own"]
        assert fixed["median_clip"] > 0.5
        assert all(o > f for o, f in zip(own["loss"], fixed["loss"], strict=True))
        assert all(
            low < f for low, f in zip(table[0.01]["fixed"]["loss"], fixed["loss"], strict=True)
        )
        assert table[lr]["none"]["diverged"] == len(data["seeds"])


def test_new_run_builds_adam_or_refuses():
    _, optimizer = th.new_run(0.01, optimizer="adam")
    assert type(optimizer) is torch.optim.Adam and optimizer.defaults["lr"] == 0.01
    _, sgd = th.new_run(0.01)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == th.RUN["momentum"]
    with pytest.raises(ValueError, match="optimizer"):
        th.new_run(0.01, optimizer="lion")


def _adam_clipped_every_step(lr, tau, steps=120):
    """Adam on the chapter's MLP, every gradient clipped by torch.nn.utils.clip_grad_norm_."""
    x, y = th.make_data()
    model = demos.small_mlp(th.RUN["d_in"], th.RUN["hidden"], 1, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    clipped = 0
    for _, xb, yb in th.batches(x, y, steps, 0):
        demos.backward(model, xb, yb)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), tau)
        clipped += bool(total > tau)
        opt.step()
        opt.zero_grad()
    return th.final_loss(model, x, y), clipped


def test_under_adam_a_run_that_clips_every_step_barely_depends_on_tau():
    """Review N3: Adam undoes a common rescale of the gradient (up to its eps), so tau and
    tau/2 give almost the same run, and (2 lr, tau/2) is another run. th.train agrees."""
    base, n_base = _adam_clipped_every_step(0.01, 0.1)
    half, n_half = _adam_clipped_every_step(0.01, 0.05)
    faster, _ = _adam_clipped_every_step(0.02, 0.05)
    assert n_base == n_half == 120
    assert half == pytest.approx(base, rel=1e-3)
    assert abs(faster - base) > 0.02 * base
    run = th.train(0.01, 0.1, steps=120, optimizer="adam")
    assert (run["decisions"] == "clipped").all()
    assert run["loss"] == pytest.approx(base, rel=1e-4)


def test_final_loss_is_inf_when_not_finite():
    x, y = th.make_data()
    model, _ = th.new_run(0.01)
    with torch.no_grad():
        model[0].weight.fill_(math.nan)
    assert th.final_loss(model, x, y) == math.inf


# ------------------------------------------------------------------------ figures


def test_figures_draw(traces, tmp_path):
    run = th.train(0.05, 1.5, steps=60, bad=(20,), nan=(35,))
    taus = [math.inf] * 30 + [1.5] * 30
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(_synthetic_sweep()))
    table = th.sweep_table(th.load_sweep(path), [0.1, 0.2])
    figures = [
        th.log_figure(run["norms"], run["decisions"], taus, every=20),
        th.lr_sweep_figure(table),
        th.lr_sweep_figure(th.sweep_table(th.load_sweep())),
        th.drift_figure(90, 50, traces),
    ]
    for fig in figures:
        assert isinstance(fig, Figure)
        assert png_bytes(fig, dpi=40)[:4] == b"\x89PNG"
    assert "no threshold: diverged at lr 0.1, 0.2" in figures[1].axes[1].get_title()


@pytest.mark.parametrize(
    "percentile, warmup", [(0, 1), (100, 50), (49, 25), (99.9, 200), (90, 0), (90, 600), (50, 601)]
)
def test_drift_figure_draws_just_outside_its_sliders(traces, percentile, warmup):
    """Issue 21 item 13: percentiles at the ends, a warm-up of none or of the whole trace."""
    fig = th.drift_figure(percentile, warmup, traces)
    assert png_bytes(fig, dpi=40)[:4] == b"\x89PNG"
    if warmup >= 600:
        assert "no threshold" in fig.axes[0].get_title()


@pytest.mark.parametrize(
    "percentile, warmup, name",
    [(101, 50, "percentile"), (-0.5, 50, "percentile"), (math.nan, 50, "percentile"),
     ("90", 50, "percentile"), (90, -5, "warmup"), (90, 2.5, "warmup"), (90, True, "warmup")],
)  # fmt: skip
def test_drift_figure_names_a_bad_argument(traces, percentile, warmup, name):
    """Issue 21 item 13: past the sliders' ends a clear ValueError, not numpy's message
    (or, for a negative warm-up, a threshold silently set from all but the last steps)."""
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        th.drift_figure(percentile, warmup, traces)
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        th.early_threshold(traces["mlp"]["norms"], percentile, warmup)
