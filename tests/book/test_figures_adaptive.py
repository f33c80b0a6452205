"""Tests of gradlab_book.figures.adaptive (Part IV: adaptive thresholds and AGC)."""

from __future__ import annotations

import io
import json
import math
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.text import Text

from gradlab.adaptive import AutoClip, SigmaSkip, ZClip
from gradlab_book.figures import adaptive
from gradlab_book.plots import png_bytes

F64 = torch.float64


@pytest.fixture(scope="module")
def traces() -> dict:
    return adaptive.load_traces()


def _small_traces(traces: dict, n: int = 80) -> dict:
    return {
        "mlp": {"norms": traces["mlp"]["norms"][:n], "corrupted": traces["mlp"]["corrupted"][:n]},
        "tanh": {"norms": traces["tanh"]["norms"][:n]},
    }


# --------------------------------------------------------------------------- traces


def test_load_traces_turns_null_into_nan(tmp_path):
    data = {
        "mlp": {"norms": [1.0, None, 2.0], "corrupted": [False, True, False]},
        "tanh": {"norms": [3.0, 4.0], "losses": [1.0, 1.0]},
    }
    path = tmp_path / "t.json"
    path.write_text(__import__("json").dumps(data))
    loaded = adaptive.load_traces(path)
    assert np.isnan(loaded["mlp"]["norms"][1]) and loaded["mlp"]["corrupted"][1]
    assert loaded["tanh"]["norms"].tolist() == [3.0, 4.0]


def test_recorded_traces_have_the_documented_shape(traces):
    for name in adaptive.TRACES:
        norms = traces[name]["norms"]
        assert len(norms) == 600 and np.all(np.isfinite(norms)) and np.all(norms > 0)
    assert traces["mlp"]["corrupted"].sum() > 10
    tanh = traces["tanh"]["norms"]
    assert np.median(tanh[:100]) > 5 * np.median(tanh[-100:])  # the norm drifts down


def test_tanh_trace_is_seeded():
    a = adaptive.tanh_trace(steps=5, depth=3, width=4)
    b = adaptive.tanh_trace(steps=5, depth=3, width=4)
    c = adaptive.tanh_trace(seed=1, steps=5, depth=3, width=4)
    assert a == b and a != c


# --------------------------------------------------------------------------- replay


@pytest.mark.parametrize("mode", ["clip", "skip"])
def test_replay_autoclip_window_matches_a_float64_reference(mode):
    """The windowed variant: the median of the last 4 finite norms before the step,
    every finite norm entering whether its step was taken or not (no ratchet in skip)."""
    norms = [1.0, 2.0, 3.0, 10.0, 2.5, math.nan, 40.0, 1.5]
    result = adaptive.replay(AutoClip(percentile=50, window=4, dtype=F64), norms, mode)
    window: list[float] = []
    for t, x in enumerate(norms):
        expected = statistics.median(window[-4:]) if window else math.inf
        assert result["threshold"][t] == pytest.approx(expected)
        # The guard compares a policy's threshold without clip's 1e-6 (keep_by_norm, eps=0).
        assert result["acted"][t] == (not expected / x >= 1.0)
        if math.isfinite(x):
            window.append(x)
    assert result["acted"][3] and result["acted"][6]  # 10 and 40 are over their medians
    if mode == "clip":
        assert result["accepted"].tolist() == [math.isfinite(x) for x in norms]
    else:
        assert result["accepted"].tolist() == [not a for a in result["acted"]]
    assert np.array_equal(result["boundary"], result["threshold"])


def test_replay_autoclip_whole_history_is_the_papers_rule():
    """Seetharaman et al.'s Algorithm 1: append the norm, then clip at the p-th percentile
    of the whole history, numpy's linear interpolation (the authors' autoclip.py)."""
    gen = np.random.default_rng(5)
    norms = gen.lognormal(size=60)
    norms[[7, 30]] = [math.nan, math.inf]
    result = adaptive.replay(AutoClip(dtype=F64), norms, "clip")
    history: list[float] = []
    for t, x in enumerate(norms):
        if math.isfinite(x):
            history.append(float(x))
        expected = float(np.percentile(history, 10)) if history else math.inf
        assert result["threshold"][t] == pytest.approx(expected, rel=1e-12)
    assert 0.8 < result["acted"].mean() < 0.95  # p = 10: about 90% of the steps clipped


def test_replay_sigma_steps_all_and_taken_against_statistics():
    """OLMo-core's window (every step enters, skipped or not) and the accepted-only
    variant, each against a float64 window written here."""
    norms = [1.0, 1.1, 0.9, 1.0, 50.0, 1.05, 0.95, 1.02]
    for steps in ("all", "taken"):
        result = adaptive.replay(SigmaSkip(3.0, 10, 3, steps=steps, dtype=F64), norms, "skip")
        window: list[float] = []
        for t, x in enumerate(norms):
            if len(window) >= 3:
                expected = statistics.fmean(window) + 3.0 * statistics.stdev(window)
            else:
                expected = math.inf
            assert result["threshold"][t] == pytest.approx(expected, rel=1e-12), (steps, t)
            skipped = not x <= expected
            assert result["acted"][t] == skipped
            if steps == "all" or not skipped:
                window.append(x)
        assert result["acted"][4]  # the spike is skipped either way
    spread = adaptive.replay(SigmaSkip(3.0, 10, 3, dtype=F64), norms, "skip")["threshold"]
    narrow = adaptive.replay(SigmaSkip(3.0, 10, 3, steps="taken", dtype=F64), norms, "skip")
    assert spread[5] > 40 > narrow["threshold"][5]  # the skipped spike widened OLMo's window


def test_replay_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        adaptive.replay(AutoClip(), [1.0], "ignore")


def test_zclip_boundary_is_mu_plus_z_sigma():
    policy = ZClip(0.9, 2.0, warmup=2, dtype=F64)
    assert adaptive.zclip_boundary(policy) == math.inf
    for x in (4.0, 6.0):
        policy.update(torch.tensor(x, dtype=F64), torch.tensor(True))
    assert adaptive.zclip_boundary(policy) == pytest.approx(5.0 + 2.0 * (1.0 + 1e-6))
    # a norm just above the boundary is clipped, one just below is not
    edge = adaptive.zclip_boundary(policy)
    assert math.isfinite(float(policy.threshold(torch.tensor(edge * 1.001, dtype=F64))))
    assert float(policy.threshold(torch.tensor(edge * 0.999, dtype=F64))) == math.inf


def test_nan_in_a_trace_leaves_every_later_decision_unchanged(traces):
    stream = traces["mlp"]["norms"][:150].copy()
    stream[70] = math.nan
    clean = np.delete(stream, 70)
    for kind, params in [
        ("autoclip", dict(percentile=90.0, window=50)),
        ("autoclip", dict(percentile=10.0, window="all")),
        ("zclip", dict(alpha=0.97, z_thresh=2.5)),
        ("sigma", dict(k=4.0, window=32, steps="all")),
        ("sigma", dict(k=4.0, window=32, steps="taken")),
    ]:
        make, mode = adaptive.POLICIES[kind]
        ours = adaptive.replay(make(**params), stream, mode)
        ref = adaptive.replay(make(**params), clean, mode)
        assert ours["acted"][70] and not ours["accepted"][70]
        assert np.array_equal(ours["threshold"][71:], ref["threshold"][70:]), kind


def test_policy_grid_and_rows(traces):
    small = _small_traces(traces)
    grid = adaptive.policy_grid("autoclip", small, percentile=[50, 90], window=[10])
    assert set(grid) == {(50, 10), (90, 10)}
    rows = adaptive.grid_rows(grid, small, late=40)
    low, high = rows
    assert low["mlp"] > high["mlp"]  # a lower percentile clips more
    acted = grid[(50, 10)]["mlp"]["acted"]
    corrupted = small["mlp"]["corrupted"]
    assert low["caught"] == int((acted & corrupted).sum())
    assert low["healthy"] == int((acted & ~corrupted).sum())
    assert low["tanh_late"] == pytest.approx(grid[(50, 10)]["tanh"]["acted"][40:].mean())
    with pytest.raises(ValueError, match="kind"):
        adaptive.policy_grid("quantile", small, percentile=[50])


def test_fixed_threshold_rates():
    norms = np.array([0.5] * 9 + [1.0] + [5.0] * 10 + [0.5] * 10)
    tau, shares = adaptive.fixed_threshold_rates(norms, calibrate=10, percentile=90, parts=3)
    assert tau == pytest.approx(0.55) and shares == pytest.approx([0.1, 1.0, 0.0])


# ------------------------------------------------------------------------------ AGC


def test_rescaled_mlp_computes_the_same_function_with_scaled_gradients():
    base, scaled = adaptive.rescaled_mlp(scale=100.0)
    x, y = adaptive.agc_data()
    with torch.no_grad():
        assert torch.allclose(base(x), scaled(x), rtol=1e-5, atol=1e-6)
    for model in (base, scaled):
        torch.nn.functional.mse_loss(model(x[:16]), y[:16]).backward()
    factors = [float(q.grad.norm() / p.grad.norm()) for p, q in zip(base.parameters(),
               scaled.parameters(), strict=True)]  # fmt: skip
    assert factors == pytest.approx([0.01, 0.01, 100.0, 1.0, 1.0, 1.0], rel=1e-3)


def test_unit_ratios_are_row_norm_quotients():
    layer = torch.nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 2.0]]))
        layer.bias.zero_()
    layer.weight.grad = torch.tensor([[0.3, 0.4, 0.0], [0.0, 0.0, 1.0]])
    layer.bias.grad = torch.tensor([1.0, 0.0])
    rows = adaptive.unit_ratios(torch.nn.Sequential(layer))
    assert rows[0]["ratios"] == pytest.approx([0.1, 0.5])
    assert rows[1]["ratios"] == pytest.approx([1.0 / 1e-3])  # zero bias: eps


@pytest.mark.parametrize("method", ["none", "clip", "agc"])
def test_train_agc_is_seeded_and_leaves_the_model_alone(method):
    base, _ = adaptive.rescaled_mlp()
    before = [p.detach().clone() for p in base.parameters()]
    a = adaptive.train_agc(base, method, steps=5, clip_factor=0.1)
    b = adaptive.train_agc(base, method, steps=5, clip_factor=0.1)
    assert a == b and len(a["losses"]) == 5
    assert all(torch.equal(p, q) for p, q in zip(base.parameters(), before, strict=True))
    assert (a["clipped_share"] > 0) == (method == "agc")


def test_train_agc_records_divergence_as_inf():
    _, scaled = adaptive.rescaled_mlp(scale=100.0)
    run = adaptive.train_agc(scaled, "none", steps=60, lr=0.1)
    assert run["final"] == math.inf and run["losses"][-1] == math.inf
    assert len(run["losses"]) == 60


def test_train_agc_rejects_an_unknown_method():
    base, _ = adaptive.rescaled_mlp()
    with pytest.raises(ValueError, match="method"):
        adaptive.train_agc(base, "zclip")


# -------------------------------------------------------------------------- figures


def test_trace_figures_render(traces):
    small = _small_traces(traces, 60)
    grids = {
        "autoclip": adaptive.policy_grid("autoclip", small, percentile=[90], window=[20]),
        "zclip": adaptive.policy_grid("zclip", small, alpha=[0.9], z_thresh=[2.0]),
        "sigma": adaptive.policy_grid("sigma", small, k=[2.0], window=[16], steps=["all"]),
    }
    figures = [
        adaptive.autoclip_figure(90, 20, grids["autoclip"], small),
        adaptive.zclip_figure(0.9, 2.0, grids["zclip"], small),
        adaptive.sigma_skip_figure(2.0, 16, "all", grids["sigma"], small),
        adaptive.stale_threshold_figure(small, calibrate=20),
    ]
    for fig in figures:
        assert isinstance(fig, Figure)
        assert png_bytes(fig).startswith(b"\x89PNG")


def _point(kind: str, **params):
    figures = {
        "autoclip": adaptive.autoclip_figure,
        "zclip": adaptive.zclip_figure,
        "sigma": adaptive.sigma_skip_figure,
    }
    return figures[kind], params


@pytest.mark.parametrize(
    "kind, params",
    [
        ("autoclip", dict(percentile=0.0, window=1)),
        ("autoclip", dict(percentile=100.0, window=600)),
        ("autoclip", dict(percentile=99.9, window=5000)),
        ("autoclip", dict(percentile=1.0, window="all")),
        ("zclip", dict(alpha=0.0, z_thresh=0.5)),
        ("zclip", dict(alpha=0.999, z_thresh=6.0)),
        ("sigma", dict(k=0.0, window=2, steps="all")),
        ("sigma", dict(k=10.0, window=3, steps="taken")),
        ("sigma", dict(k=8.0, window=600, steps="all")),
    ],
)
def test_explorable_figures_draw_just_outside_their_sliders(traces, kind, params):
    """A value off the grid (issue 21 item 13) is replayed, not a KeyError or a crash."""
    small = _small_traces(traces, 70)
    figure_fn, params = _point(kind, **params)
    fig = figure_fn(**params, grid={}, traces=small)
    assert png_bytes(fig, dpi=40).startswith(b"\x89PNG")


def test_a_point_off_the_grid_is_the_replay_the_grid_would_hold(traces):
    small = _small_traces(traces, 70)
    grid = adaptive.policy_grid("sigma", small, k=[3.0], window=[16], steps=["all"])
    fresh = adaptive._results("sigma", {}, small, k=3.0, window=16, steps="all")
    for name in adaptive.TRACES:
        for key in ("threshold", "acted", "accepted"):
            assert np.array_equal(fresh[name][key], grid[(3.0, 16, "all")][name][key])


def _agc_inputs(steps=12):
    base, scaled = adaptive.rescaled_mlp()
    runs = {
        "reference": adaptive.train_agc(base, "clip", steps=steps),
        "clip": adaptive.train_agc(scaled, "clip", steps=steps),
        0.1: adaptive.train_agc(scaled, "agc", steps=steps, clip_factor=0.1),
    }
    x, y = adaptive.agc_data()
    torch.nn.functional.mse_loss(scaled(x[:16]), y[:16]).backward()
    return adaptive.unit_ratios(scaled), runs


def test_agc_figures_render():
    ratios, runs = _agc_inputs()
    fig = adaptive.agc_figure(0.1, ratios, runs)
    assert png_bytes(fig).startswith(b"\x89PNG")
    assert "final loss" in fig.axes[1].get_title()
    fig = adaptive.agc_curves_figure({"a": runs["clip"], "b": runs[0.1]}, "title")
    assert png_bytes(fig).startswith(b"\x89PNG")


@pytest.mark.parametrize("rho", [1e-6, 0.001, 0.75, 1.0, 100.0])
def test_agc_figure_draws_just_outside_its_slider(rho):
    """A clip factor with no stored run draws the bound and says there is no run."""
    ratios, runs = _agc_inputs()
    fig = adaptive.agc_figure(rho, ratios, runs)
    assert png_bytes(fig, dpi=40).startswith(b"\x89PNG")
    assert "no training run" in fig.axes[1].get_title()


# ------------------------------------------------------------- readable on a phone

#: What a 375-px phone gives a figure in the book's page (the editions review measured
#: the explorables at about 340 px), and the smallest text height the book allows there.
PHONE_PX = 340
SMALLEST_PX = 11.0


def _text_heights_px(fig: Figure, dpi: float) -> list[tuple[str, float]]:
    """Every visible, non-empty text of the drawn figure with its height in CSS pixels on
    the phone: the frame is ``width * dpi`` px wide and shown at most ``PHONE_PX`` wide."""
    fig.savefig(io.BytesIO(), format="png", dpi=dpi)  # lays out and draws every text
    width_px = fig.get_figwidth() * dpi
    shrink = min(1.0, PHONE_PX / width_px)
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    return [(t.get_text(), t.get_fontsize() * dpi / 72 * shrink) for t in texts]


def _phone_figures(traces):
    small = _small_traces(traces, 80)
    ratios, runs = _agc_inputs()
    from gradlab_book.figures import thresholds as th

    return {
        "autoclip": adaptive.autoclip_figure(90, 100, {}, small),
        "autoclip, the paper's rule": adaptive.autoclip_figure(10, "all", {}, small),
        "zclip": adaptive.zclip_figure(0.97, 2.5, {}, small),
        "sigma": adaptive.sigma_skip_figure(6.0, 32, "taken", {}, small),
        "stale": adaptive.stale_threshold_figure(small, calibrate=20),
        "agc": adaptive.agc_figure(0.1, ratios, runs),
        "drift": th.drift_figure(90, 50, small),
    }


def test_explorable_text_is_at_least_11_px_on_a_phone(traces):
    """Issue 22 section 5: every text of every Part IV explorable, ticks and legends
    included, at least 11 px high at phone width, at the chapters' FRAME_DPI."""
    for name, fig in _phone_figures(traces).items():
        assert fig.get_figwidth() == adaptive.PANEL_WIDTH, name
        heights = _text_heights_px(fig, adaptive.FRAME_DPI)
        assert len(heights) > 10, name  # titles, labels, ticks, legend
        small = [(text, round(px, 1)) for text, px in heights if px < SMALLEST_PX]
        assert small == [], (name, small)


def test_the_old_layout_would_fail_the_phone_test(traces):
    """The check can fail: text of 7 points in a 6.8-inch figure at dpi 64 (the layout
    the editions review measured) is about 5 px high on a phone."""
    fig = Figure(figsize=(6.8, 2.9))
    ax = fig.subplots()
    ax.set_title("clipped 12%", fontsize=7)
    ax.plot([1, 2], [1, 2])
    heights = _text_heights_px(fig, 64)
    assert min(px for _, px in heights) < 6


def test_every_explorable_of_the_three_chapters_renders_at_frame_dpi():
    """The chapters pass FRAME_DPI to each explore(...) call, the dpi the phone test uses."""
    root = Path(__file__).resolve().parents[2] / "book" / "adaptive"
    for chapter in ("choosing_threshold", "adaptive_thresholds", "agc"):
        cells = json.loads((root / f"{chapter}.ipynb").read_text(encoding="utf-8"))["cells"]
        sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        calls = [source for source in sources if "explore(" in source]
        assert calls, chapter
        for source in calls:
            assert re.search(r"dpi=adaptive\.FRAME_DPI\b", source), (chapter, source)


@pytest.mark.parametrize(
    "make, mode",
    [
        (lambda: AutoClip(percentile=90.0, window=20), "clip"),
        (lambda: AutoClip(percentile=90.0, window=20), "skip"),
        (lambda: AutoClip(), "clip"),
        (lambda: ZClip(0.9, 2.0), "clip"),
        (lambda: ZClip(0.9, 2.0, max_norm=5.0), "skip"),
        (lambda: SigmaSkip(2.0, 16, 8), "skip"),
        (lambda: SigmaSkip(2.0, 16, 8, steps="taken"), "skip"),
    ],
    ids=[
        "autoclip",
        "autoclip-skip",
        "autoclip-paper",
        "zclip",
        "zclip-capped-skip",
        "sigma-all",
        "sigma-taken",
    ],
)
def test_replay_decides_as_step_guard_does(traces, make, mode):
    """replay() calls a policy as StepGuard(threshold=policy) does: same decisions."""
    from gradlab.guard import StepGuard

    norms = traces["mlp"]["norms"][:80].astype(np.float32)
    norms[40] = math.nan
    p = torch.zeros(1)
    optimizer = torch.optim.SGD([p], lr=0.0)
    guard = StepGuard(optimizer, mode=mode, threshold=make(), max_consecutive_skips=None)
    decisions = []
    for x in norms:
        p.grad = torch.tensor([float(x)])
        decisions.append(guard.step().decision != "kept")
    assert adaptive.replay(make(), norms, mode)["acted"].tolist() == decisions
    assert decisions[40]  # the NaN step is never kept


def test_replay_decides_as_step_guard_does_on_a_tie():
    """A constant trace puts AutoClip's threshold exactly on the norm, where the
    rounding of the rule decides: replay() must round as the guard does."""
    from gradlab.guard import StepGuard

    norms = np.full(30, 41.0, dtype=np.float32)
    p = torch.zeros(1)
    policy = AutoClip(percentile=90.0, window=20)
    guard = StepGuard(torch.optim.SGD([p], lr=0.0), mode="clip", threshold=policy)
    decisions = []
    for x in norms:
        p.grad = torch.tensor([float(x)])
        decisions.append(guard.step().decision != "kept")
    replayed = adaptive.replay(AutoClip(percentile=90.0, window=20), norms, "clip")
    assert replayed["acted"].tolist() == decisions
    assert sum(decisions) > 0  # the tie is clipped, as torch's clip_grad_norm_ would


@pytest.mark.parametrize(
    "kind, params, name",
    [
        ("autoclip", dict(percentile=100.5, window=100), "percentile"),
        ("autoclip", dict(percentile=90.0, window=0), "window"),
        ("zclip", dict(alpha=1.0, z_thresh=2.5), "alpha"),
        ("zclip", dict(alpha=0.97, z_thresh=0.0), "z_thresh"),
        ("sigma", dict(k=-1.0, window=32, steps="all"), "k"),
        ("sigma", dict(k=4.0, window=1, steps="all"), "window"),
        ("sigma", dict(k=4.0, window=32, steps="every"), "steps"),
    ],
)
def test_explorable_figures_name_a_bad_argument(traces, kind, params, name):
    """Issue 21 item 13: beyond what a policy accepts, the policy's ValueError names it."""
    figure_fn, params = _point(kind, **params)
    with pytest.raises(ValueError, match=rf"^{name} must"):
        figure_fn(**params, grid={}, traces=_small_traces(traces, 30))


@pytest.mark.parametrize("rho", [0.0, -0.1, math.nan, math.inf])
def test_agc_figure_names_a_bad_clip_factor(rho):
    ratios, runs = _agc_inputs(steps=3)
    with pytest.raises(ValueError, match=r"^clip_factor must be a positive, finite number"):
        adaptive.agc_figure(rho, ratios, runs)
