"""The Part IV checks accept correct answers and reject the typical wrong ones.

Correct answers are written here independently (with numpy, with torch, in float32);
gradlab's own ZClip, wrapped into one step, must pass the ZClip check as well, since
the check restates its documented formulas. Wrong answers must be rejected with a
verdict that names the mistake.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradlab.adaptive import ZClip
from gradlab_book import exercises_thresholds as ex

# ------------------------------------------------------------ warm-up threshold


def threshold_numpy(norms, percentile=90):
    values = [float(v) for v in norms]
    finite = [v for v in values if math.isfinite(v)]
    return float(np.percentile(finite, percentile)) if finite else math.inf


def threshold_torch(norms, percentile=90):
    if isinstance(norms, torch.Tensor):
        t = norms.detach().to(torch.float64).reshape(-1)
    else:
        t = torch.tensor([float(v) for v in norms], dtype=torch.float64)
    t = t[torch.isfinite(t)]
    return torch.quantile(t, percentile / 100) if t.numel() else torch.tensor(math.inf)


def threshold_float32(norms, percentile=90):
    t = torch.as_tensor([float(v) for v in norms], dtype=torch.float32)
    t = t[torch.isfinite(t)]
    return torch.quantile(t, percentile / 100) if t.numel() else math.inf


@pytest.mark.parametrize("fn", [threshold_numpy, threshold_torch, threshold_float32])
def test_warmup_threshold_accepts(fn, capsys):
    assert ex.check_warmup_threshold(fn) is True
    assert capsys.readouterr().out == "All 17 cases pass.\n"


def _keeps_inf(norms, percentile=90):
    values = np.array([float(v) for v in norms])
    values = values[~np.isnan(values)]
    return float(np.percentile(values, percentile)) if values.size else math.inf


def _no_filter(norms, percentile=90):
    return float(np.percentile([float(v) for v in norms], percentile))


def _method(name):
    def fn(norms, percentile=90):
        finite = [float(v) for v in norms if math.isfinite(float(v))]
        return float(np.percentile(finite, percentile, method=name)) if finite else math.inf

    return fn


def _fraction(norms, percentile=90):
    return threshold_numpy(norms, percentile / 100)


def _nan_when_empty(norms, percentile=90):
    finite = [float(v) for v in norms if math.isfinite(float(v))]
    return float(np.percentile(finite, percentile)) if finite else math.nan


def _raises_when_empty(norms, percentile=90):
    finite = [float(v) for v in norms if math.isfinite(float(v))]
    return float(np.percentile(finite, percentile))


def _wrong_default(norms, percentile=95):
    return threshold_numpy(norms, percentile)


def _sorts_in_place(norms, percentile=90):
    if isinstance(norms, list) and norms and isinstance(norms[0], float):
        norms.sort()
    return threshold_numpy(norms, percentile)


def _mean(norms, percentile=90):
    finite = [float(v) for v in norms if math.isfinite(float(v))]
    return sum(finite) / len(finite) if finite else math.inf


def _returns_a_list(norms, percentile=90):
    return [threshold_numpy(norms, percentile)]


def _only_lists(norms, percentile=90):
    return threshold_numpy([v for v in norms if v == v and v != math.inf], percentile)


@pytest.mark.parametrize(
    "fn, fragments",
    [
        (_keeps_inf, ["two +inf among 50", "counts the infinite norms"]),
        (_no_filter, ["one NaN among 50", "made your threshold NaN"]),
        (_method("lower"), ["Case 1 of 17", "the lower of the two nearest"]),
        (_method("higher"), ["Case 1 of 17", "the higher of the two nearest"]),
        (_method("inverted_cdf"), ["Case 1 of 17", "an order statistic"]),
        (_fraction, ["the 0.9th percentile, not the 90th"]),
        (_nan_when_empty, ["no finite norm at all", "return math.inf"]),
        (_raises_when_empty, ["raised IndexError", "return math.inf"]),
        (_wrong_default, ["called without percentile", "must use 90"]),
        (_sorts_in_place, ["modified the window"]),
        (_mean, ["the mean of the finite norms"]),
        (_returns_a_list, ["must return one number", "an object of type list"]),
    ],
)
def test_warmup_threshold_rejects(fn, fragments, capsys):
    assert ex.check_warmup_threshold(fn) is False
    out = capsys.readouterr().out
    assert "fails" in out or "raised" in out
    for fragment in fragments:
        assert fragment in out, out


def test_warmup_threshold_not_implemented_and_not_a_function(capsys):
    def stub(norms, percentile=90):
        raise NotImplementedError

    assert ex.check_warmup_threshold(stub) is False
    assert capsys.readouterr().out.startswith("Not implemented yet")
    assert ex.check_warmup_threshold(3.0) is False
    assert "Expected a function" in capsys.readouterr().out


def test_threshold_reference_is_numpy_percentile():
    gen = np.random.default_rng(7)
    for n in (1, 2, 5, 50, 333):
        values = gen.lognormal(size=n).tolist()
        for q in (0, 12.5, 50, 90, 99, 100):
            assert ex._threshold64(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)
    assert ex._threshold64([math.nan, math.inf], 90) == math.inf


def test_window_cases_hold_what_they_say():
    cases = ex._window_cases()
    assert len(cases) == 17
    kinds = {c.kind for c in cases}
    assert kinds == {"list", "tuple", "float32", "float64", "numpy", "0-dim tensors"}
    assert any(any(math.isnan(v) for v in c.values) for c in cases)
    assert any(any(math.isinf(v) for v in c.values) for c in cases)
    assert any(not c.values for c in cases)


# -------------------------------------------------------------------- ZClip step


def _zclip_answer(threshold, x, mean, var, alpha, clip_at):
    # The answers' common end: the threshold they report, and the EMA of x clipped at
    # clip_at (where an answer clips is where several of them go wrong); a non-finite x
    # leaves the statistics as they were.
    if not math.isfinite(x):
        return threshold, mean, var
    x_hat = min(x, clip_at)
    new_mean = alpha * mean + (1 - alpha) * x_hat
    return threshold, new_mean, alpha * var + (1 - alpha) * (x_hat - new_mean) ** 2


def zclip_math(x, mean, var, alpha=0.97, z_thresh=2.5, eps=1e-6, max_norm=None):
    std = math.sqrt(var)
    z = (x - mean) / (std + eps)
    tau = mean + z_thresh**2 * std / z if z > z_thresh else math.inf
    capped = tau if max_norm is None else min(tau, max_norm)
    return _zclip_answer(capped, x, mean, var, alpha, clip_at=tau)


def zclip_torch(x, mean, var, alpha=0.97, z_thresh=2.5, eps=1e-6, max_norm=None):
    x, mean, var = (torch.as_tensor(v, dtype=torch.float64) for v in (x, mean, var))
    std = var.sqrt()
    z = (x - mean) / (std + eps)
    over = z > z_thresh
    tau = torch.where(over, mean + z_thresh**2 * std / torch.where(over, z, 1.0), math.inf)
    x_hat = torch.minimum(x, tau)
    m = alpha * mean + (1 - alpha) * x_hat
    v = alpha * var + (1 - alpha) * (x_hat - m) ** 2
    ok = torch.isfinite(x)
    capped = tau if max_norm is None else tau.clamp(max=max_norm)
    return capped, torch.where(ok, m, mean), torch.where(ok, v, var)


def zclip_gradlab(x, mean, var, alpha=0.97, z_thresh=2.5, eps=1e-6, max_norm=None):
    """gradlab's ZClip, its state set to (mean, var) just after a warm-up of one step."""
    policy = ZClip(alpha, z_thresh, warmup=1, eps=eps, max_norm=max_norm, dtype=torch.float64)
    state = policy.state_dict()
    state["state"]["mean"] = torch.tensor(float(mean), dtype=torch.float64)
    state["state"]["var"] = torch.tensor(float(var), dtype=torch.float64)
    state["state"]["count"] = torch.tensor(1)
    policy.load_state_dict(state)
    stat = torch.as_tensor(x, dtype=torch.float64)
    tau = policy.threshold(stat)
    policy.update(stat, False)  # a skipped step enters as well: taken is not used
    after = policy.state_dict()["state"]
    return tau, after["mean"], after["var"]


N_ZCLIP = len(ex._zclip_cases())


def test_zclip_cases_hold_what_they_say():
    cases = ex._zclip_cases()
    assert N_ZCLIP == 18
    capped = [c for c in cases if c.max_norm is not None]
    assert len(capped) == 4 and any(math.isnan(c.x) for c in capped)
    assert any(c.tensors for c in cases) and sum(c.defaults for c in cases) == 1


@pytest.mark.parametrize("fn", [zclip_math, zclip_torch, zclip_gradlab])
def test_zclip_step_accepts(fn, capsys):
    assert ex.check_zclip_step(fn) is True
    assert capsys.readouterr().out == f"All {N_ZCLIP} cases pass.\n"


def _zclip_mistake(**mistake):
    def fn(x, mean, var, alpha=0.97, z_thresh=2.5, eps=1e-6, max_norm=None):
        values = (float(x), float(mean), float(var), alpha, z_thresh, eps, max_norm)
        return ex._zclip64(*values, **mistake)

    return fn


def _zclip_le_test(x, mean, var, alpha=0.97, z_thresh=2.5, eps=1e-6, max_norm=None):
    std = math.sqrt(var)
    z = (x - mean) / (std + eps)
    tau = math.inf if z <= z_thresh else mean + z_thresh**2 * std / z
    capped = tau if max_norm is None else min(tau, max_norm)
    return _zclip_answer(capped, x, mean, var, alpha, clip_at=tau)


# The review's wrong answers (book-review-2026-12-b-parts-IV-V, section 4), written out.
def _feeds_the_boundary(x, mean, var, alpha=0.97, z_thresh=2.5, eps=1e-6, max_norm=None):
    tau, _, _ = zclip_math(x, mean, var, alpha, z_thresh, eps, max_norm)
    return _zclip_answer(tau, x, mean, var, alpha, clip_at=mean + z_thresh * math.sqrt(var))


def _eps_in_the_root(x, mean, var, alpha=0.97, z_thresh=2.5, eps=1e-6, max_norm=None):
    std = math.sqrt(var + eps)
    z = (x - mean) / std
    tau = mean + z_thresh**2 * std / z if z > z_thresh else math.inf
    capped = tau if max_norm is None else min(tau, max_norm)
    return _zclip_answer(capped, x, mean, var, alpha, clip_at=tau)


def _inf_meets_no_threshold(x, mean, var, alpha=0.97, z_thresh=2.5, eps=1e-6, max_norm=None):
    if math.isinf(x):
        return (math.inf if max_norm is None else max_norm), mean, var
    return zclip_math(x, mean, var, alpha, z_thresh, eps, max_norm)


def _ema_before_threshold(x, mean, var, alpha=0.97, z_thresh=2.5, eps=1e-6, max_norm=None):
    if math.isfinite(x):
        mean = alpha * mean + (1 - alpha) * x
        var = alpha * var + (1 - alpha) * (x - mean) ** 2
    std = math.sqrt(var)
    z = (x - mean) / (std + eps)
    tau = mean + z_thresh**2 * std / z if z > z_thresh else math.inf
    return (tau if max_norm is None else min(tau, max_norm)), mean, var


def _feeds_the_capped_threshold(x, mean, var, alpha=0.97, z_thresh=2.5, eps=1e-6, max_norm=None):
    tau, _, _ = zclip_math(x, mean, var, alpha, z_thresh, eps, max_norm)
    return _zclip_answer(tau, x, mean, var, alpha, clip_at=tau)


def _without_max_norm(x, mean, var, alpha=0.97, z_thresh=2.5, eps=1e-6):
    return zclip_math(x, mean, var, alpha, z_thresh, eps)


def _zclip_no_defaults(x, mean, var, alpha, z_thresh, eps, max_norm=None):
    return zclip_math(x, mean, var, alpha, z_thresh, eps, max_norm)


def _zclip_only_tau(x, mean, var, alpha=0.97, z_thresh=2.5, eps=1e-6, max_norm=None):
    return zclip_math(x, mean, var, alpha, z_thresh, eps, max_norm)[0]


@pytest.mark.parametrize(
    "fn, fragments",
    [
        (_zclip_mistake(adaptive=False), ["Case 2 of", "Adaptive scaling"]),
        (_zclip_mistake(always_finite=True), ["Case 1 of", "tau is inf when z <= z_thresh"]),
        (_zclip_mistake(feed_raw=True), ["wrong:    new_mean, new_var", "clipped value"]),
        (_zclip_mistake(old_mean=True), ["wrong:    new_var", "uses the new mean"]),
        (_zclip_mistake(std_is_var=True), ["square root of the variance"]),
        (_zclip_mistake(no_eps=True), ["std + eps, not std"]),
        (_zclip_mistake(swapped=True), ["alpha weights the old statistics"]),
        (_zclip_mistake(update_nonfinite=True), ["x is NaN", "unchanged"]),
        (_zclip_le_test, ["x is NaN", "wrong:    tau", "not `not z <= z_thresh`"]),
        (_feeds_the_boundary, ["Case 2 of", "not min(x, mean + z_thresh * std)"]),
        (_eps_in_the_root, ["eps is added to the standard deviation, outside the root"]),
        (_inf_meets_no_threshold, ["x is +inf", "a finite number, not inf"]),
        (_ema_before_threshold, ["Case 2 of", "*before* this step"]),
        (_feeds_the_capped_threshold, ["max_norm=4", "*before* the cap"]),
        (_zclip_mistake(no_cap=True), ["max_norm=4", "caps the threshold at every step"]),
        (_zclip_mistake(cap_spikes_only=True), ["max_norm=1", "not only on spikes"]),
        (_without_max_norm, ["max_norm=4", "raised TypeError", "takes max_norm=None"]),
        (_zclip_no_defaults, ["called with the defaults", "raised TypeError"]),
        (_zclip_only_tau, ["Return the three values as a tuple"]),
    ],
)
def test_zclip_step_rejects(fn, fragments, capsys):
    assert ex.check_zclip_step(fn) is False
    out = capsys.readouterr().out
    for fragment in fragments:
        assert fragment in out, out


def test_zclip_step_not_implemented(capsys):
    def stub(x, mean, var, alpha=0.97, z_thresh=2.5, eps=1e-6):
        raise NotImplementedError

    assert ex.check_zclip_step(stub) is False
    assert capsys.readouterr().out.startswith("Not implemented yet")


def test_zclip_reference_by_hand():
    """The worked example of the chapter: mean 5, std 1, a spike of 15."""
    tau, mean, var = ex._zclip64(15.0, 5.0, 1.0, 0.97, 2.5, 1e-6)
    z = 10.0 / (1.0 + 1e-6)
    assert tau == pytest.approx(5.0 + 6.25 / z, rel=1e-15)
    assert mean == pytest.approx(0.97 * 5.0 + 0.03 * tau, rel=1e-15)
    assert var == pytest.approx(0.97 + 0.03 * (tau - mean) ** 2, rel=1e-15)
    assert ex._zclip64(math.nan, 5.0, 1.0, 0.97, 2.5, 1e-6) == (math.inf, 5.0, 1.0)
    assert ex._zclip64(math.inf, 5.0, 1.0, 0.97, 2.5, 1e-6) == (5.0, 5.0, 1.0)
    # max_norm caps the threshold; the EMA takes x clipped at the uncapped one
    tau, mean, _ = ex._zclip64(15.0, 5.0, 1.0, 0.97, 2.5, 1e-6, 4.0)
    assert tau == 4.0 and mean == pytest.approx(0.97 * 5.0 + 0.03 * (5.0 + 6.25 / z))
    tau, mean, _ = ex._zclip64(5.5, 5.0, 1.0, 0.97, 2.5, 1e-6, 1.0)
    assert tau == 1.0 and mean == pytest.approx(0.97 * 5.0 + 0.03 * 5.5, rel=1e-15)


def test_output_is_deterministic(capsys):
    for check, fn in [
        (ex.check_warmup_threshold, _keeps_inf),
        (ex.check_zclip_step, _zclip_mistake(no_eps=True)),
    ]:
        check(fn)
        first = capsys.readouterr().out
        check(fn)
        assert capsys.readouterr().out == first
        assert " at 0x" not in first


def test_every_check_has_a_docstring_saying_what_is_checked():
    for name in ex.__all__:
        doc = getattr(ex, name).__doc__ or ""
        assert len(doc) > 200, name
