"""Tests of gradlab_book.figures.adaptive (Part IV: adaptive thresholds and AGC)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

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


def test_replay_autoclip_matches_a_float64_reference():
    norms = [1.0, 2.0, 3.0, 10.0, 2.5, math.nan, 40.0, 1.5]
    result = adaptive.replay(AutoClip(0.5, 4, dtype=F64), norms, "clip")
    window: list[float] = []
    for t, x in enumerate(norms):
        expected = statistics.median(window[-4:]) if window else math.inf
        assert result["threshold"][t] == pytest.approx(expected)
        # The guard compares a policy's threshold without clip's 1e-6 (keep_by_norm, eps=0).
        assert result["acted"][t] == (not expected / x >= 1.0)
        if math.isfinite(x):  # clip mode: every finite step is accepted
            window.append(x)
    assert result["accepted"].tolist() == [math.isfinite(x) for x in norms]
    assert np.array_equal(result["boundary"], result["threshold"])


def test_replay_skip_mode_keeps_skipped_steps_out():
    norms = [1.0, 1.1, 0.9, 1.0, 50.0, 1.05, 0.95]
    result = adaptive.replay(SigmaSkip(3.0, 10, 3, dtype=F64), norms, "skip")
    assert result["acted"].tolist() == [False] * 4 + [True, False, False]
    kept = [1.0, 1.1, 0.9, 1.0]
    expected = statistics.fmean(kept) + 3.0 * statistics.stdev(kept)
    assert result["threshold"][5] == pytest.approx(expected)


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
        ("autoclip", dict(quantile=0.9, window=50)),
        ("zclip", dict(alpha=0.97, z_thresh=2.5)),
        ("sigma", dict(k=4.0, window=32)),
    ]:
        make, mode = adaptive.POLICIES[kind]
        ours = adaptive.replay(make(**params), stream, mode)
        ref = adaptive.replay(make(**params), clean, mode)
        assert ours["acted"][70] and not ours["accepted"][70]
        assert np.array_equal(ours["threshold"][71:], ref["threshold"][70:]), kind


def test_policy_grid_and_rows(traces):
    small = _small_traces(traces)
    grid = adaptive.policy_grid("autoclip", small, quantile=[0.5, 0.9], window=[10])
    assert set(grid) == {(0.5, 10), (0.9, 10)}
    rows = adaptive.grid_rows(grid, small, late=40)
    low, high = rows
    assert low["mlp"] > high["mlp"]  # a lower quantile clips more
    acted = grid[(0.5, 10)]["mlp"]["acted"]
    corrupted = small["mlp"]["corrupted"]
    assert low["caught"] == int((acted & corrupted).sum())
    assert low["healthy"] == int((acted & ~corrupted).sum())
    assert low["tanh_late"] == pytest.approx(grid[(0.5, 10)]["tanh"]["acted"][40:].mean())


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
        "autoclip": adaptive.policy_grid("autoclip", small, quantile=[0.9], window=[20]),
        "zclip": adaptive.policy_grid("zclip", small, alpha=[0.9], z_thresh=[2.0]),
        "sigma": adaptive.policy_grid("sigma", small, k=[2.0], window=[16]),
    }
    figures = [
        adaptive.autoclip_figure(0.9, 20, grids["autoclip"], small),
        adaptive.zclip_figure(0.9, 2.0, grids["zclip"], small),
        adaptive.sigma_skip_figure(2.0, 16, grids["sigma"], small),
        adaptive.stale_threshold_figure(small, calibrate=20),
    ]
    for fig in figures:
        assert isinstance(fig, Figure)
        assert png_bytes(fig).startswith(b"\x89PNG")


def test_agc_figures_render():
    base, scaled = adaptive.rescaled_mlp()
    runs = {
        "reference": adaptive.train_agc(base, "clip", steps=12),
        "clip": adaptive.train_agc(scaled, "clip", steps=12),
        0.1: adaptive.train_agc(scaled, "agc", steps=12, clip_factor=0.1),
    }
    x, y = adaptive.agc_data()
    torch.nn.functional.mse_loss(scaled(x[:16]), y[:16]).backward()
    fig = adaptive.agc_figure(0.1, adaptive.unit_ratios(scaled), runs)
    assert png_bytes(fig).startswith(b"\x89PNG")
    fig = adaptive.agc_curves_figure({"a": runs["clip"], "b": runs[0.1]}, "title")
    assert png_bytes(fig).startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "make, mode",
    [
        (lambda: AutoClip(0.9, 20), "clip"),
        (lambda: ZClip(0.9, 2.0), "clip"),
        (lambda: SigmaSkip(2.0, 16, 8), "skip"),
    ],
    ids=["autoclip", "zclip", "sigma"],
)
def test_replay_decides_as_step_guard_does(traces, make, mode):
    """replay() calls a policy as StepGuard(threshold=policy) does: same decisions."""
    from gradlab.guard import StepGuard

    norms = traces["mlp"]["norms"][:80].astype(np.float32)
    norms[40] = math.nan
    p = torch.zeros(1)
    optimizer = torch.optim.SGD([p], lr=0.0)
    try:
        guard = StepGuard(optimizer, mode=mode, threshold=make(), max_consecutive_skips=None)
    except (TypeError, ValueError):
        pytest.skip("this StepGuard takes no threshold policy")
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
    guard = StepGuard(torch.optim.SGD([p], lr=0.0), mode="clip", threshold=AutoClip(0.9, 20))
    decisions = []
    for x in norms:
        p.grad = torch.tensor([float(x)])
        decisions.append(guard.step().decision != "kept")
    assert adaptive.replay(AutoClip(0.9, 20), norms, "clip")["acted"].tolist() == decisions
    assert sum(decisions) > 0  # the tie is clipped, as torch's clip_grad_norm_ would
