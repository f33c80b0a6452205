"""gradlab.adaptive: the threshold policies and agc_, against their sources' rules.

Each reference below restates its source in plain Python floats (float64) with the
statistics module, from the paper or the reference code named in its docstring; none of
them calls gradlab. The one deliberate difference the policies document, that a NaN or
infinite statistic never enters, is written into the references too. The guard tests at
the end run ``StepGuard`` with each policy: skip mode cannot ratchet, the σ rule after a
level shift, and norms of 1e-8 to 1e-5. Compilation is tested in test_adaptive_compile.py.
"""

from __future__ import annotations

import io
import math
import random
import statistics
from collections import deque

import pytest
import torch

import gradlab.adaptive as adaptive
from gradlab import StepGuard
from gradlab.adaptive import AutoClip, SigmaSkip, ThresholdPolicy, ZClip, agc_
from gradlab.sync import HostReadCounter

INF = math.inf
BAD = (math.nan, math.inf, -math.inf)
_INT_OF = {4: torch.int32, 8: torch.int64}


# -------------------------------------------------------------------- references


def percentile(values, p):
    """numpy.percentile(values, p), method "linear": r = p/100 (n - 1), interpolated."""
    s = sorted(values)
    r = p / 100 * (len(s) - 1)
    lo, hi = math.floor(r), math.ceil(r)
    return s[lo] + (r - lo) * (s[hi] - s[lo])


class RefAutoClip:
    """Seetharaman et al. 2020, Algorithm 1, and pseeth/autoclip's autoclip.py:

    grad_history.append(obs_grad_norm)
    clip_value = np.percentile(grad_history, clip_percentile)

    The history is every norm so far, the current one included; finite ones only here.
    """

    def __init__(self, percentile):
        self.p, self.history = percentile, []

    def threshold(self, x):
        values = [*self.history, x] if math.isfinite(x) else self.history
        return percentile(values, self.p) if values else INF

    def update(self, x, taken):
        if math.isfinite(x):
            self.history.append(x)


class RefQuantileClip:
    """HesitantlyHuman/autoclip, QuantileClip._clip_global (global_threshold=True):

    threshold = torch.quantile(history, quantile)      # inf while the history is empty
    new_grad_norm = clip_grad_norm_(parameters, max_norm=threshold)
    history = torch.hstack((history, new_grad_norm))[-history_length:]

    The current norm is not in its own threshold; finite norms only here.
    """

    def __init__(self, quantile, history_length):
        self.q, self.history = quantile, deque(maxlen=history_length)

    def threshold(self, x):
        return percentile(self.history, 100 * self.q) if self.history else INF

    def update(self, x, taken):
        if math.isfinite(x):
            self.history.append(x)


class RefZClip:
    """bluorion-com/ZClip, zclip/zclip.py, mode="zscore", clip_option="adaptive_scaling",
    clip_factor=1, skip_update_on_spike=False, in Python floats as there:

    warm-up: buffer.append(norm); at warmup_steps: mean = sum/len, var = sum((x-mean)^2)/len
    z = (norm - mean) / (std + eps); if z > z_thresh: clip_val = mean + z_thresh*std/(z/z_thresh)
    effective clip = min(clip_val or norm, max_grad_norm); EMA fed clip_val or norm:
    mean = a*mean + (1-a)*v; var = a*var + (1-a)*(v - mean)^2 (the new mean)

    ``threshold`` returns the clip bound (inf where none); finite norms only enter.
    """

    def __init__(self, alpha, z_thresh, warmup, eps, max_norm=None):
        self.alpha, self.zt, self.warmup, self.eps = alpha, z_thresh, warmup, eps
        self.max_norm = INF if max_norm is None else max_norm
        self.buffer, self.mean, self.var = [], None, None

    def clip_val(self, x):
        std = self.var**0.5
        z = (x - self.mean) / (std + self.eps)
        if z > self.zt:
            eta = z / self.zt
            return self.mean + (self.zt * std) / eta
        return None

    def threshold(self, x):
        if self.mean is None:
            return self.max_norm
        v = self.clip_val(x)
        return min(INF if v is None else v, self.max_norm)

    def update(self, x, taken):
        if not math.isfinite(x):
            return
        if self.mean is None:
            self.buffer.append(x)
            if len(self.buffer) >= self.warmup:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((b - self.mean) ** 2 for b in self.buffer) / len(self.buffer)
            return
        v = self.clip_val(x)
        v = x if v is None else v
        self.mean = self.alpha * self.mean + (1 - self.alpha) * v
        self.var = self.alpha * self.var + (1 - self.alpha) * (v - self.mean) ** 2


class RefSigma:
    """The σ rule on a window of the last ``window`` values that entered: every finite
    one (steps="all"), or those of taken steps (steps="taken")."""

    def __init__(self, k, window, min_count, steps="all"):
        self.k, self.min_count, self.steps = k, min_count, steps
        self.values = deque(maxlen=window)

    def threshold(self, x):
        if len(self.values) < self.min_count:
            return INF
        return statistics.fmean(self.values) + self.k * statistics.stdev(self.values)

    def update(self, x, taken):
        if math.isfinite(x) and (self.steps == "all" or taken):
            self.values.append(x)


class RefOLMoCore:
    """allenai/OLMo-core, src/olmo_core/optim/skip_step_optimizer.py, SkipStepOptimizer:

    latest_loss / latest_grad_norm setters: append; keep the last rolling_interval_length + 1
    get_step_factor: if len(losses) < max(2, rolling_interval_length // 2): take;
      std, mean = torch.std_mean(values[:-1]);
      take iff (loss - mean) <= sigma_factor * std and (norm - mean) <= sigma_factor * std

    Values are appended every step, skipped or not; finite ones only here (OLMo-core
    appends NaN too). ``take(loss, norm)`` sets both, then returns the step factor.
    """

    def __init__(self, rolling_interval_length=128, sigma_factor=6):
        self.length, self.sigma = rolling_interval_length, sigma_factor
        self.losses, self.norms = [], []

    def _append(self, values, x):
        if math.isfinite(x):
            values.append(x)
            del values[: max(0, len(values) - (self.length + 1))]

    def _within(self, values, x):
        mean, std = statistics.fmean(values[:-1]), statistics.stdev(values[:-1])
        return (x - mean) <= self.sigma * std

    def take(self, loss, norm):
        self._append(self.losses, loss)
        self._append(self.norms, norm)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return False  # NaN compares false there, an infinite one is over
        if len(self.losses) < max(2, self.length // 2):
            return True
        return self._within(self.losses, loss) and self._within(self.norms, norm)


# name: (gradlab policy of a dtype, its reference)
POLICIES = {
    "autoclip": (lambda dt: AutoClip(dtype=dt), lambda: RefAutoClip(10.0)),
    "autoclip_p90": (lambda dt: AutoClip(percentile=90.0, dtype=dt), lambda: RefAutoClip(90.0)),
    "autoclip_window": (
        lambda dt: AutoClip(percentile=90.0, window=16, dtype=dt),
        lambda: RefQuantileClip(0.9, 16),
    ),
    "autoclip_window_median": (
        lambda dt: AutoClip(percentile=50.0, window=7, dtype=dt),
        lambda: RefQuantileClip(0.5, 7),
    ),
    "zclip": (
        lambda dt: ZClip(alpha=0.9, z_thresh=2.0, warmup=6, eps=1e-6, dtype=dt),
        lambda: RefZClip(0.9, 2.0, 6, 1e-6),
    ),
    "zclip_max_norm": (
        lambda dt: ZClip(alpha=0.97, z_thresh=2.5, warmup=5, max_norm=3.0, dtype=dt),
        lambda: RefZClip(0.97, 2.5, 5, 1e-6, max_norm=3.0),
    ),
    "sigma_all": (
        lambda dt: SigmaSkip(k=2.0, window=12, min_count=5, dtype=dt),
        lambda: RefSigma(2.0, 12, 5, "all"),
    ),
    "sigma_taken": (
        lambda dt: SigmaSkip(k=2.0, window=12, min_count=5, steps="taken", dtype=dt),
        lambda: RefSigma(2.0, 12, 5, "taken"),
    ),
}
#: Policies whose state every finite statistic enters, taken or not.
EVERY_STEP = [name for name in POLICIES if name != "sigma_taken"]


def spiky_stream(n, seed=0):
    """Positive norms around a slow drift, with occasional spikes of 5 to 50 times."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        x = (1.0 + 0.5 * math.sin(i / 17)) * math.exp(rng.gauss(0.0, 0.25))
        if rng.random() < 0.07:
            x *= rng.uniform(5.0, 50.0)
        out.append(x)
    return out


def with_bad(stream, seed=0, every=23):
    """``stream`` with NaN, inf and -inf put in at about one step in ``every``."""
    rng = random.Random(seed)
    return [rng.choice(BAD) if rng.random() < 1 / every else x for x in stream]


def taken_flags(n, seed=1, p=0.85):
    rng = random.Random(seed)
    return [rng.random() < p for _ in range(n)]


def make(name, dtype=torch.float64):
    return POLICIES[name][0](dtype)


def run(policy, stream, taken=None, dtype=torch.float64):
    """Thresholds of ``policy`` over the stream, as one tensor (threshold, then update)."""
    out = []
    for i, x in enumerate(stream):
        stat = torch.tensor(x, dtype=dtype)
        out.append(policy.threshold(stat))
        policy.update(stat, torch.tensor(True if taken is None else taken[i]))
    return torch.stack(out) if out else torch.empty(0, dtype=policy.dtype)


def state_bits(policy):
    """The state as integer views, so that equality is equality of bits (NaN included).
    AutoClip's whole history is cut to its filled slots: the padding may grow."""
    state = policy.state_dict()["state"]
    bits = {}
    for name, t in state.items():
        if name == "history":
            filled = t[: int(state["count"])]
            assert torch.all(t[int(state["count"]) :] == INF)
            t = filled
        bits[name] = t.view(_INT_OF[t.element_size()]) if t.is_floating_point() else t
    return bits


def assert_same_state(a, b):
    sa, sb = state_bits(a), state_bits(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def assert_same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(_INT_OF[a.element_size()]), b.view(_INT_OF[b.element_size()]))


def copy_of(name, policy):
    twin = make(name, policy.dtype)
    twin.load_state_dict(policy.state_dict())
    return twin


# ------------------------------------------------------------ against references


def test_reference_percentile_is_numpys():
    np = pytest.importorskip("numpy")
    rng = random.Random(2)
    for n in (1, 2, 3, 10, 101):
        values = [rng.lognormvariate(0, 1) for _ in range(n)]
        for p in (0.0, 10.0, 37.5, 90.0, 100.0):
            assert percentile(values, p) == pytest.approx(np.percentile(values, p), rel=1e-15)


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_thresholds_match_reference(name, dtype):
    policy, ref = make(name, dtype), POLICIES[name][1]()
    stream = [float(torch.tensor(x, dtype=dtype)) for x in with_bad(spiky_stream(200, 3), 3)]
    taken = taken_flags(len(stream), seed=4)
    rel = 1e-12 if dtype == torch.float64 else 2e-5
    n_finite = 0
    for x, ok in zip(stream, taken, strict=True):
        want = ref.threshold(x)
        if name.startswith("sigma"):  # skip mode: what is over is not taken
            ok = ok and x <= want
        stat = torch.tensor(x, dtype=dtype)
        got = policy.threshold(stat)
        assert got.shape == () and got.dtype == dtype
        assert float(got) == pytest.approx(want, rel=rel), (x, want)
        n_finite += math.isfinite(want)
        policy.update(stat, torch.tensor(ok))
        ref.update(x, ok)
    # The stream exercised the adaptive thresholds (ZClip's is finite only on spikes).
    assert n_finite >= (5 if name == "zclip" else 50)


def test_autoclip_default_is_the_papers_rule():
    policy, ref = AutoClip(), RefAutoClip(10.0)  # p = 10, the whole history
    assert policy.state_dict()["config"] == {"percentile": 10.0, "window": None}
    # float32 state, the usual dtype of a norm; 2500 steps make the history grow twice.
    for x in with_bad(spiky_stream(2500, seed=5), seed=5):
        stat = torch.tensor(x)
        x = float(stat)
        assert float(policy.threshold(stat)) == pytest.approx(ref.threshold(x), rel=1e-6)
        policy.update(stat, torch.tensor(False))  # skipped or not, it enters
        ref.update(x, False)
    assert policy.state_dict()["state"]["history"].numel() == 4096


def test_autoclip_first_steps_follow_algorithm_1():
    policy = AutoClip(percentile=50.0, dtype=torch.float64)
    steps = [(4.0, 4.0), (2.0, 3.0), (9.0, 4.0), (math.nan, 4.0), (1.0, 3.0)]
    for x, want in steps:  # the median of the history, this norm included
        stat = torch.tensor(x, dtype=torch.float64)
        assert float(policy.threshold(stat)) == want
        policy.update(stat, torch.tensor(True))
    assert AutoClip().threshold(torch.tensor(math.nan)) == INF  # nothing in the history


def test_quantile_clip_defaults_match_reference():
    """AutoClip(percentile=90, window=1000): QuantileClip(quantile=0.9, history_length=1000)."""
    policy, ref = AutoClip(percentile=90.0, window=1000), RefQuantileClip(0.9, 1000)
    # AutoClip's ranks q * (n - 1) are float32, as in torch.quantile: off by up to half an
    # ulp of 999, so the weight by ~3e-5.
    for x in spiky_stream(1300, seed=5):
        stat = torch.tensor(x)
        assert float(policy.threshold(stat)) == pytest.approx(ref.threshold(float(stat)), rel=1e-4)
        policy.update(stat, torch.tensor(False))
        ref.update(float(stat), False)


def test_zclip_defaults_match_reference_over_300_steps():
    """ZClip() is the reference's ZClip(alpha=0.97, z_thresh=2.5, eps=1e-6, warmup_steps=25)
    with max_grad_norm=None, to 1e-12 on 300 norms with NaN, inf and spikes."""
    policy, ref = ZClip(dtype=torch.float64), RefZClip(0.97, 2.5, 25, 1e-6)
    assert policy.state_dict()["config"] == {
        "alpha": 0.97,
        "z_thresh": 2.5,
        "warmup": 25,
        "eps": 1e-6,
        "max_norm": None,
    }
    clipped = 0
    for x, ok in zip(with_bad(spiky_stream(300, 6), 6), taken_flags(300, 6), strict=True):
        stat = torch.tensor(x, dtype=torch.float64)
        tau, want = float(policy.threshold(stat)), ref.threshold(x)
        assert tau == pytest.approx(want, rel=1e-12)
        clipped += x > tau
        policy.update(stat, torch.tensor(ok))
        ref.update(x, ok)
        if ref.mean is not None:
            state = policy.state_dict()["state"]
            assert float(state["mean"]) == pytest.approx(ref.mean, rel=1e-12)
            assert float(state["var"]) == pytest.approx(ref.var, rel=1e-12)
    assert clipped >= 10


def test_zclip_max_norm_caps_at_every_step_as_the_reference():
    policy, ref = (
        ZClip(warmup=5, max_norm=1.0, dtype=torch.float64),
        RefZClip(0.97, 2.5, 5, 1e-6, 1.0),
    )
    for x in spiky_stream(60, seed=7):
        stat = torch.tensor(x, dtype=torch.float64)
        tau = float(policy.threshold(stat))
        assert tau == pytest.approx(ref.threshold(x), rel=1e-12) and tau <= 1.0
        policy.update(stat, True)
        ref.update(x, True)
    # The cap is on the threshold, not on what enters: the EMA follows the norms (~1-6).
    assert float(policy.state_dict()["state"]["mean"]) == pytest.approx(ref.mean, rel=1e-12)
    assert ref.mean > 1.0


def test_zclip_huge_finite_norm_keeps_the_variance_finite():
    """One float32 norm of 3e19 in the warm-up: float32 squares overflow (9e38), so the
    variance went to inf and ZClip never clipped again. float64 statistics, as the
    reference's Python floats, keep it finite and equal to float64 maths."""
    stream = spiky_stream(400, seed=8)
    stream[10] = 3e19
    stream = [float(torch.tensor(x)) for x in stream]  # float32 norms
    policy, ref = ZClip(), RefZClip(0.97, 2.5, 25, 1e-6)  # float32, the default
    for x in stream:
        stat = torch.tensor(x)
        tau = float(policy.threshold(stat))
        assert tau == pytest.approx(ref.threshold(x), rel=1e-6)  # rounded to float32
        policy.update(stat, torch.tensor(True))
        ref.update(x, True)
        state = policy.state_dict()["state"]
        if ref.var is not None:
            assert math.isfinite(float(state["var"]))
            assert float(state["var"]) == pytest.approx(ref.var, rel=1e-12)
            assert float(state["mean"]) == pytest.approx(ref.mean, rel=1e-12)
    # The spike's variance decays as 0.97**t: 3.5e37 * 0.97**375 is still far above 1.
    assert 1e30 < ref.var < 1e35


def test_zclip_clips_spikes_and_feeds_back_the_clipped_value():
    policy, ref = ZClip(warmup=5, dtype=torch.float64), RefZClip(0.97, 2.5, 5, 1e-6)
    for x in [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02]:
        policy.update(torch.tensor(x, dtype=torch.float64), torch.tensor(True))
        ref.update(x, True)
    spike = torch.tensor(40.0, dtype=torch.float64)
    tau = policy.threshold(spike)
    mu, sigma = ref.mean, math.sqrt(ref.var)
    z = (40.0 - mu) / (sigma + 1e-6)
    assert float(tau) == pytest.approx(mu + 2.5**2 * sigma / z, rel=1e-12)
    assert mu < float(tau) < mu + 2.5 * sigma  # adaptive scaling: below the z line
    policy.update(spike, torch.tensor(False))  # a skipped spike enters too, clipped
    ref.update(40.0, False)
    assert float(policy.state_dict()["state"]["mean"]) == pytest.approx(ref.mean, rel=1e-12)
    assert ref.mean < 1.1  # the spike entered the EMA clipped, not at 40


def test_sigmaskip_defaults_are_olmo_cores():
    """SigmaSkip() on the norm and on the loss is SkipStepOptimizer(rolling_interval_length=128,
    sigma_factor=6): every decision alike, from the first step on."""
    norm_rule, loss_rule = SigmaSkip(dtype=torch.float64), SigmaSkip(dtype=torch.float64)
    assert norm_rule.state_dict()["config"] == {
        "k": 6.0,
        "window": 128,
        "min_count": 63,
        "steps": "all",
    }
    ref = RefOLMoCore(128, 6)
    rng = random.Random(9)
    norms = spiky_stream(600, seed=9)
    losses = [2.0 + 0.1 * rng.gauss(0, 1) + (5.0 if rng.random() < 0.02 else 0.0) for _ in norms]
    skipped = 0
    for norm, loss in zip(norms, losses, strict=True):
        n, f = torch.tensor(norm, dtype=torch.float64), torch.tensor(loss, dtype=torch.float64)
        take = bool(n <= norm_rule.threshold(n)) and bool(f <= loss_rule.threshold(f))
        assert take == ref.take(loss, norm)
        skipped += not take
        norm_rule.update(n, torch.tensor(take))
        loss_rule.update(f, torch.tensor(take))
    assert 5 <= skipped <= 100


def test_olmo_core_start_counts_the_current_step():
    """OLMo-core starts when its list, this step included, holds max(2, L // 2) values."""
    for window, first in ((128, 63), (64, 31), (10, 4), (6, 2), (4, 2)):
        policy = SigmaSkip(k=0.0, window=window, dtype=torch.float64)
        for i in range(first):
            assert policy.threshold(torch.tensor(5.0)) == INF, (window, i)
            policy.update(torch.tensor(float(i % 2)), True)
        assert policy.threshold(torch.tensor(5.0)) < INF


def exact_quantile(values: torch.Tensor, q: float) -> tuple[float, float]:
    """The linear-interpolation quantile of ``values``, in float64, and the gap between
    the two order statistics it interpolates."""
    ordered = sorted(values.double().tolist())
    rank = q * (len(ordered) - 1)
    below = math.floor(rank)
    low, high = ordered[below], ordered[math.ceil(rank)]
    return low + (rank - below) * (high - low), high - low


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("q", [0.0, 0.37, 0.9, 1.0])
def test_windowed_autoclip_is_torch_quantile(dtype, q):
    policy = AutoClip(percentile=100 * q, window=10, dtype=dtype)
    seen = []
    for x in spiky_stream(40, seed=6):
        stat = torch.tensor(x, dtype=dtype)
        got = policy.threshold(stat)
        if seen:
            window = torch.stack(seen[-10:])
            want = torch.quantile(window, policy.percentile / 100)
            if dtype == torch.float64:
                assert_same_bits(got, want)
            else:  # torch 2.13 rounds the rank to float32 (off by up to half an ulp of
                # a rank below 10), 2.14 does not: both near the float64 quantile
                exact, spread = exact_quantile(window, policy.percentile / 100)
                bound = 2 * torch.finfo(dtype).eps * (abs(exact) + 10 * spread)
                assert abs(got.double().item() - exact) <= bound, (got, exact)
                assert abs(want.double().item() - exact) <= bound, (want, exact)
        policy.update(stat, torch.tensor(True))
        seen.append(stat)


def test_thresholds_before_enough_history():
    x = torch.tensor(5.0)
    assert AutoClip(window=10).threshold(x) == INF
    assert AutoClip().threshold(x) == 5.0  # the paper's history holds this norm already
    assert ZClip().threshold(x) == INF
    assert ZClip(max_norm=2.0).threshold(x) == 2.0
    sigma = SigmaSkip(window=8, min_count=4)
    for v in (1.0, 2.0, 3.0):
        sigma.update(torch.tensor(v), torch.tensor(False))
        assert sigma.threshold(x) == INF
    sigma.update(torch.tensor(4.0), torch.tensor(False))
    assert math.isfinite(sigma.threshold(x))


def test_constant_stream_has_no_nan():
    for policy in (
        AutoClip(),
        AutoClip(window=4),
        ZClip(warmup=3),
        ZClip(warmup=3, eps=0.0),
        SigmaSkip(window=4, min_count=2),
    ):
        thresholds = run(policy, [2.0] * 10 + [3.0, 2.0], dtype=torch.float32)
        assert not thresholds.isnan().any(), policy


# --------------------------------------------------------------- what enters


@pytest.mark.parametrize("name", EVERY_STEP)
def test_taken_does_not_matter_where_every_step_enters(name):
    stream = with_bad(spiky_stream(80, seed=10), seed=10)
    everything = run(make(name), stream)
    assert_same_bits(run(make(name), stream, [False] * len(stream)), everything)
    assert_same_bits(run(make(name), stream, taken_flags(len(stream), seed=11)), everything)


def test_sigma_taken_leaves_skipped_steps_out():
    stream = spiky_stream(60, seed=12)
    taken = taken_flags(len(stream), seed=13, p=0.6)
    policy = make("sigma_taken")
    for x, ok in zip(stream, taken, strict=True):
        before = copy_of("sigma_taken", policy)
        policy.update(torch.tensor(x, dtype=torch.float64), torch.tensor(ok))
        if not ok:
            assert_same_state(policy, before)
    # ... and so its thresholds are those of the stream of taken steps alone.
    kept = [x for x, ok in zip(stream, taken, strict=True) if ok]
    everything = run(make("sigma_taken"), stream, taken)
    assert_same_bits(
        everything[[i for i, ok in enumerate(taken) if ok]], run(make("sigma_taken"), kept)
    )


@pytest.mark.parametrize("name", list(POLICIES))
def test_threshold_has_no_side_effect(name):
    policy = make(name)
    for x in with_bad(spiky_stream(40, seed=14), seed=14):
        stat = torch.tensor(x, dtype=torch.float64)
        before = copy_of(name, policy)
        policy.threshold(stat)
        assert_same_state(policy, before)
        policy.update(stat, torch.tensor(True))


# ---------------------------------------------------------- NaN leaves no trace


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
def test_non_finite_step_leaves_no_trace(name, bad):
    stream = spiky_stream(26, seed=7)
    clean = run(make(name), stream)
    for i in range(len(stream) + 1):  # every position, warm-up included
        policy = make(name)
        got = run(policy, stream[:i])
        before = copy_of(name, policy)
        for ok in (True, False):
            policy.update(torch.tensor(bad, dtype=torch.float64), torch.tensor(ok))
            assert_same_state(policy, before)
        got = torch.cat([got, run(policy, stream[i:])])
        assert_same_bits(got, clean)


def test_too_large_for_float32_counts_as_infinite():
    stream = spiky_stream(20, seed=8)
    for name in POLICIES:
        clean = run(make(name, torch.float32), stream)
        got = run(make(name, torch.float32), [*stream[:9], 1e300, *stream[9:]], dtype=torch.float64)
        assert_same_bits(torch.cat([got[:9], got[10:]]), clean)


def test_whole_history_grows_without_losing_a_value(monkeypatch):
    monkeypatch.setattr(adaptive, "_HISTORY_START", 4)
    policy, ref = AutoClip(percentile=37.0, dtype=torch.float64), RefAutoClip(37.0)
    sizes = set()
    for x in with_bad(spiky_stream(70, seed=15), seed=15, every=5):
        stat = torch.tensor(x, dtype=torch.float64)
        assert float(policy.threshold(stat)) == pytest.approx(ref.threshold(x), rel=1e-12)
        policy.update(stat, torch.tensor(True))
        ref.update(x, True)
        sizes.add(policy.state_dict()["state"]["history"].numel())
    history = policy.state_dict()["state"]["history"]
    assert history[: len(ref.history)].tolist() == sorted(ref.history)
    assert sizes == {4, 8, 16, 32, 64, 128}  # doubled when the calls (NaN included) filled it


# ------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_checkpoint_round_trip_resumes_bit_for_bit(name, dtype, monkeypatch):
    monkeypatch.setattr(adaptive, "_HISTORY_START", 8)  # the whole history grows too
    stream = with_bad(spiky_stream(70, seed=11), seed=11)
    taken = taken_flags(len(stream), seed=12)
    whole = run(make(name, dtype), stream, taken, dtype)
    for cut in (3, 31):  # in warm-up (or an unfilled window), and after it
        first = make(name, dtype)
        run(first, stream[:cut], taken[:cut], dtype)
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)
        run(first, stream[cut:], taken[cut:], dtype)  # the saved copy must not move
        buffer.seek(0)
        resumed = make(name, dtype)
        resumed.load_state_dict(torch.load(buffer))
        assert_same_bits(run(resumed, stream[cut:], taken[cut:], dtype), whole[cut:])


def test_load_state_dict_refuses_another_policy():
    saved = AutoClip(window=8).state_dict()
    with pytest.raises(ValueError, match="window"):
        AutoClip(window=9).load_state_dict(saved)
    with pytest.raises(ValueError, match="window"):
        AutoClip().load_state_dict(saved)
    with pytest.raises(ValueError, match="config"):
        AutoClip(window=8).load_state_dict({"state": saved["state"]})
    with pytest.raises(ValueError, match=r"torch\.float64 tensor"):
        AutoClip(window=8, dtype=torch.float64).load_state_dict(saved)
    broken = {"config": saved["config"], "state": {"values": saved["state"]["values"]}}
    with pytest.raises(ValueError, match="count"):
        AutoClip(window=8).load_state_dict(broken)
    with pytest.raises(ValueError, match="shape"):
        wrong = {"config": saved["config"], "state": {**saved["state"], "values": torch.ones(9)}}
        AutoClip(window=8).load_state_dict(wrong)
    history = AutoClip().state_dict()
    history["state"]["count"] = torch.tensor(2000)
    with pytest.raises(ValueError, match="count"):
        AutoClip().load_state_dict(history)
    with pytest.raises(ValueError, match="steps"):
        SigmaSkip().load_state_dict(SigmaSkip(steps="taken").state_dict())


# -------------------------------------------------------------- host and device


@pytest.mark.parametrize("name", list(POLICIES))
def test_no_host_reads(name, monkeypatch):
    monkeypatch.setattr(adaptive, "_HISTORY_START", 4)  # growth reads nothing either
    policy = make(name, torch.float32)
    stats = [*spiky_stream(30, seed=13), math.nan, math.inf]
    tensors = [torch.tensor(x) for x in stats]
    flags = [torch.tensor(ok) for ok in taken_flags(len(stats), seed=14)]
    with HostReadCounter() as reads:
        for stat, ok in zip(tensors, flags, strict=True):
            policy.threshold(stat)
            policy.update(stat, ok)
    assert reads.count == 0


def test_policies_follow_the_statistic_device():
    for name in POLICIES:
        policy = make(name, torch.float32)
        assert isinstance(policy, ThresholdPolicy)
        stat = torch.tensor(1.0, device="meta")  # a device other than the CPU, anywhere
        tau = policy.threshold(stat)
        policy.update(stat, torch.tensor(True, device="meta"))
        assert tau.device.type == "meta" and tau.shape == ()
        assert policy.device.type == "meta"
        assert all(t.device.type == "meta" for t in policy.state_dict()["state"].values())
        fresh = make(name, torch.float32)
        assert fresh.to("cpu") is fresh and fresh.to("meta").device.type == "meta"


def test_statistic_inputs():
    policy = SigmaSkip(window=4, min_count=2)
    loss = torch.tensor([2.0], requires_grad=True) * 1.5  # a loss with a graph, one element
    policy.update(loss, True)
    policy.update(3.5, torch.tensor([False]))
    policy.update(math.nan, True)  # a Python float, NaN too, and leaves no trace
    assert float(policy.threshold(loss)) == pytest.approx(3.25 + 6 * math.sqrt(0.125))
    assert not policy.threshold(loss).requires_grad
    with pytest.raises(ValueError, match="stat"):
        policy.threshold(torch.ones(2))
    with pytest.raises(ValueError, match="stat"):
        policy.threshold("1.0")
    for name in POLICIES:  # every policy checks taken, whether it uses it or not
        for wrong in (torch.tensor(1.0), torch.ones(2, dtype=torch.bool), 1):
            with pytest.raises(ValueError, match="taken"):
                make(name).update(torch.tensor(1.0), wrong)


@pytest.mark.parametrize(
    ("make_policy", "argument"),
    [
        (lambda: AutoClip(percentile=101.0), "percentile"),
        (lambda: AutoClip(percentile=-1.0), "percentile"),
        (lambda: AutoClip(percentile=math.nan), "percentile"),
        (lambda: AutoClip(window=0), "window"),
        (lambda: AutoClip(window=2.0), "window"),
        (lambda: AutoClip(dtype=torch.float16), "dtype"),
        (lambda: ZClip(alpha=1.0), "alpha"),
        (lambda: ZClip(alpha=-0.1), "alpha"),
        (lambda: ZClip(z_thresh=0.0), "z_thresh"),
        (lambda: ZClip(z_thresh=math.inf), "z_thresh"),
        (lambda: ZClip(warmup=0), "warmup"),
        (lambda: ZClip(eps=-1.0), "eps"),
        (lambda: ZClip(max_norm=-1.0), "max_norm"),
        (lambda: SigmaSkip(k=-1.0), "k"),
        (lambda: SigmaSkip(k=True), "k"),
        (lambda: SigmaSkip(window=1), "window"),
        (lambda: SigmaSkip(min_count=1), "min_count"),
        (lambda: SigmaSkip(window=8, min_count=9), "min_count"),
        (lambda: SigmaSkip(steps="accepted"), "steps"),
    ],
)
def test_policy_arguments_are_checked(make_policy, argument):
    with pytest.raises(ValueError, match=argument):
        make_policy()


def test_autoclip_arguments_are_keywords():
    """AutoClip(0.9, 100) meant a quantile and a window before: refused, not reread."""
    with pytest.raises(TypeError):
        AutoClip(0.9, 100)
    with pytest.raises(TypeError):
        AutoClip(quantile=0.9)


# ------------------------------------------------------------ with StepGuard


def guarded(policy, norms, mode="skip", losses=None, loss_policy=None):
    """``StepGuard(mode, threshold=policy)`` over one float64 parameter whose gradient has
    each norm in turn: the decisions, and the norms the guard measured."""
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    optimizer = torch.optim.SGD([p], lr=0.0)
    guard = StepGuard(optimizer, mode=mode, threshold=policy, loss_threshold=loss_policy)
    decisions, seen = [], []
    for i, x in enumerate(norms):
        p.grad = torch.tensor([x], dtype=torch.float64)
        kw = {} if losses is None else {"loss": torch.tensor(losses[i], dtype=torch.float64)}
        record = guard.step(**kw)
        decisions.append(record.decision)
        seen.append(record.total_norm)
    return decisions, seen


def share(decisions, what):
    return sum(d == what for d in decisions) / len(decisions)


def test_skip_mode_cannot_ratchet():
    """On stationary, healthy norms, AutoClip at the 90th percentile skips about 10% of
    the steps at every stage of a 30,000-step run. Fed only the taken norms (the old
    rule), it skipped 84% of the first 3,000 steps and 92% of the last 1,000."""
    rng = random.Random(16)
    norms = [abs(rng.gauss(1.0, 0.1)) for _ in range(30_000)]
    decisions, _ = guarded(AutoClip(percentile=90.0, window=1000), norms)
    for start in range(0, len(norms), 3000):
        assert 0.07 < share(decisions[start : start + 3000], "skipped") < 0.13, start
    # The paper's whole history, over 3,000 steps (its buffer doubles twice).
    decisions, _ = guarded(AutoClip(percentile=90.0), norms[:3000])
    for start in range(0, 3000, 1000):
        assert 0.06 < share(decisions[start : start + 1000], "skipped") < 0.14, start


def level_shift(seed=17):
    """Norms around 1 for 200 steps, then around 3 for 300 (a new level, not a spike)."""
    rng = random.Random(seed)
    return [abs(rng.gauss(1.0 if t < 200 else 3.0, 0.05 if t < 200 else 0.15)) for t in range(500)]


def test_sigma_all_resumes_after_a_level_shift_and_taken_locks_out():
    norms = level_shift()
    everything, seen = guarded(SigmaSkip(), norms)  # steps="all", OLMo-core's
    after = everything[200:]
    assert "skipped" not in everything[:200]
    assert after[0] == "skipped" and after.index("kept") <= 10  # resumes within a few
    assert share(after, "skipped") < 0.05
    ref = RefOLMoCore(128, 6)  # and it decides as OLMo-core does, step by step
    assert everything == ["kept" if ref.take(0.0, x) else "skipped" for x in seen]
    only_taken, _ = guarded(SigmaSkip(steps="taken"), norms)
    assert only_taken[:200] == everything[:200]
    assert set(only_taken[200:]) == {"skipped"}  # locked out: the new level never enters


def test_sigma_on_loss_and_norm_is_olmo_cores_skip():
    rng = random.Random(18)
    norms = spiky_stream(400, seed=18)
    losses = [2.0 + 0.1 * rng.gauss(0, 1) + (3.0 if rng.random() < 0.03 else 0.0) for _ in norms]
    decisions, seen = guarded(SigmaSkip(), norms, losses=losses, loss_policy=SigmaSkip())
    ref = RefOLMoCore(128, 6)
    want = ["kept" if ref.take(f, x) else "skipped" for f, x in zip(losses, seen, strict=True)]
    assert decisions == want and want.count("skipped") >= 3


SCALES = [1e-8, 1e-7, 1e-5]


def small_trace(scale, n=400, seed=19):
    """Healthy norms of about ``scale``, and a spike of 20 times at every 25th step."""
    rng = random.Random(seed)
    out = [scale * abs(rng.gauss(1.0, 0.1)) for _ in range(n)]
    return [20 * x if t % 25 == 24 else x for t, x in enumerate(out)]


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("mode", ["skip", "clip"])
def test_policies_work_for_tiny_norms(scale, mode):
    """The guard compares a policy's threshold without torch's +1e-6, which at these
    scales would put every step over (every step skipped, or clipped)."""
    acted = "skipped" if mode == "skip" else "clipped"
    norms = small_trace(scale)
    spikes = [t % 25 == 24 for t in range(len(norms))]
    # Percentiles: about 1 - p/100 of the steps act.
    for policy, rate in ((AutoClip(), 0.9), (AutoClip(percentile=90.0, window=100), 0.1)):
        decisions, _ = guarded(policy, norms, mode)
        assert abs(share(decisions[50:], acted) - rate) < 0.06, policy
    # The σ rule: exactly the spikes act, once it has started.
    decisions, _ = guarded(SigmaSkip(window=20), norms, mode)
    assert [d == acted for d in decisions[10:]] == spikes[10:]
    # ZClip, its eps (absolute, as in the reference) scaled with the norms: every spike
    # acts, and every step acts as the reference decides.
    eps = 1e-6 * scale
    decisions, seen = guarded(ZClip(eps=eps, dtype=torch.float64), norms, mode)
    ref, want = RefZClip(0.97, 2.5, 25, eps), []
    for x in seen:
        want.append(x > ref.threshold(x))
        ref.update(x, True)
    assert [d == acted for d in decisions] == want
    assert all(w for w, spike in zip(want[25:], spikes[25:], strict=True) if spike)


# ------------------------------------------------------------------------- agc_


SHAPES = [(6, 5), (3, 4, 2, 2), (7,), (), (0,), (0, 3), (4, 0), (2, 9)]


def agc_params(dtype=torch.float64, seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i, shape in enumerate(shapes):
        p = torch.nn.Parameter((torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype))
        # Gradients on very different scales, so that some units clip and some do not.
        scale = 10.0 ** (i % 4 - 3)
        grad = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
        p.grad = grad.to(dtype)
        params.append(p)
    return params


def reference_agc(params, clip_factor, eps, exclude=()):
    """A float64 loop over units, from the paper's equation."""
    out = []
    for p in params:
        w, g = p.detach().double(), p.grad.double().clone()
        if any(p is e for e in exclude):
            out.append(g)
            continue
        units = [(w, g)] if w.dim() <= 1 else list(zip(w, g, strict=True))
        for w_i, g_i in units:
            g_norm = math.sqrt(sum(v * v for v in g_i.flatten().tolist()))
            w_norm = math.sqrt(sum(v * v for v in w_i.flatten().tolist()))
            bound = clip_factor * max(w_norm, eps)
            if math.isfinite(g_norm) and g_norm > bound:
                g_i.mul_(bound / g_norm)
        out.append(g)
    return out


@pytest.mark.parametrize(
    ("dtype", "rel"),
    [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)],
)
@pytest.mark.parametrize("foreach", [None, True, False])
def test_agc_matches_reference(dtype, rel, foreach):
    params = agc_params(dtype)
    want = reference_agc(params, 0.05, 1e-3)
    clipped = agc_(params, clip_factor=0.05, eps=1e-3, foreach=foreach)
    n_units = 0
    for p, w in zip(params, want, strict=True):
        assert p.grad.dtype == dtype
        torch.testing.assert_close(p.grad.double(), w, rtol=rel, atol=0.0)
        n_units += p.shape[0] if p.dim() > 1 else 1
    assert clipped.dtype == torch.int64 and 0 < int(clipped) < n_units


def test_agc_foreach_and_loop_agree_bit_for_bit():
    a, b = agc_params(torch.float32, seed=1), agc_params(torch.float32, seed=1)
    assert int(agc_(a, foreach=True)) == int(agc_(b, foreach=False))
    for p, q in zip(a, b, strict=True):
        assert_same_bits(p.grad, q.grad)


def test_agc_exclude_and_inputs():
    params = agc_params(torch.float32, seed=2)
    head = params[0]
    before = head.grad.clone()
    want = reference_agc(params, 0.01, 1e-3, exclude=[head])
    agc_(iter(params), exclude=head)  # a generator, and a single tensor to exclude
    assert_same_bits(head.grad, before)
    for p, w in zip(params[1:], want[1:], strict=True):
        torch.testing.assert_close(p.grad.double(), w, rtol=1e-6, atol=0.0)
    single = agc_params(torch.float32, seed=3, shapes=[(5, 4)])[0]
    want = reference_agc([single], 0.01, 1e-3)[0]
    agc_(single)
    torch.testing.assert_close(single.grad.double(), want, rtol=1e-6, atol=0.0)
    nothing = torch.nn.Parameter(torch.ones(3))
    assert int(agc_([nothing])) == 0 and nothing.grad is None
    assert int(agc_([])) == 0


def test_agc_zero_and_non_finite_units():
    w = torch.nn.Parameter(torch.ones(5, 4))
    w.grad = torch.full((5, 4), 10.0)
    w.grad[0] = 0.0  # a zero unit: stays zero, never 0/0
    w.grad[1, 2] = math.nan  # a NaN unit: left exactly as it is
    w.grad[2, 0] = math.inf  # an infinite unit: left as it is (no inf * 0 = NaN)
    with torch.no_grad():
        w[3] = math.nan  # a NaN weight: no bound, left alone
    zero_w = torch.nn.Parameter(torch.zeros(3))  # zero weights: bound clip_factor * eps
    zero_w.grad = torch.ones(3)
    before = w.grad.clone()
    for foreach in (True, False):
        w.grad.copy_(before)
        zero_w.grad.fill_(1.0)
        assert int(agc_([w, zero_w], clip_factor=0.1, eps=1e-3, foreach=foreach)) == 2
        assert_same_bits(w.grad[:4], before[:4])
        torch.testing.assert_close(w.grad[4].norm(), torch.tensor(0.1 * 2.0))  # ‖W_4‖ = 2
        torch.testing.assert_close(zero_w.grad.norm(), torch.tensor(1e-4))
        assert not w.grad[4].isnan().any() and not w.grad[0].isnan().any()


def test_agc_no_host_reads():
    params = agc_params(torch.float32, seed=4)
    params[0].grad[1, 1] = math.nan
    for foreach in (True, False):
        with HostReadCounter() as reads:
            agc_(params, exclude=[params[1]], foreach=foreach)
        assert reads.count == 0


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        (dict(clip_factor=0.0), "clip_factor"),
        (dict(clip_factor=-1.0), "clip_factor"),
        (dict(clip_factor=math.inf), "clip_factor"),
        (dict(clip_factor="0.01"), "clip_factor"),
        (dict(eps=0.0), "eps"),
        (dict(eps=math.nan), "eps"),
        (dict(exclude=[1.0]), "exclude"),
        (dict(exclude=3), "exclude"),
        (dict(foreach="yes"), "foreach"),
    ],
)
def test_agc_arguments_are_checked(kwargs, argument):
    params = agc_params(torch.float32, seed=5)
    before = [p.grad.clone() for p in params]
    with pytest.raises(ValueError, match=argument):
        agc_(params, **kwargs)
    for p, b in zip(params, before, strict=True):
        assert_same_bits(p.grad, b)
    with pytest.raises(ValueError, match="parameters"):
        agc_(42)


# ------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(POLICIES))
def test_cuda_follows_the_device_without_syncing(name, monkeypatch):
    monkeypatch.setattr(adaptive, "_HISTORY_START", 4)  # the whole history grows on the GPU
    stream = [*spiky_stream(40, seed=15), math.nan, *spiky_stream(10, seed=16)]
    taken = taken_flags(len(stream), seed=16)
    want = run(make(name, torch.float32), stream, taken, dtype=torch.float32)
    policy = make(name, torch.float32)  # built on the CPU: its state follows the stat
    stats = [torch.tensor(x, device="cuda") for x in stream]
    flags = [torch.tensor(ok, device="cuda") for ok in taken]
    got = [policy.threshold(stats[0])]
    policy.update(stats[0], flags[0])
    assert policy.device.type == "cuda"
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # any wait for the GPU raises
    try:
        for stat, ok in zip(stats[1:], flags[1:], strict=True):
            got.append(policy.threshold(stat))
            policy.update(stat, ok)
    finally:
        torch.cuda.set_sync_debug_mode(old)
    torch.testing.assert_close(torch.stack(got).cpu(), want, rtol=1e-6, atol=0.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_agc_matches_cpu_without_syncing():
    cpu = agc_params(torch.float32, seed=17)
    cpu[0].grad[1, 1] = math.nan
    gpu = []
    for p in cpu:
        q = torch.nn.Parameter(p.detach().cuda())
        q.grad = p.grad.cuda()
        gpu.append(q)
    n_cpu = agc_(cpu)
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        n_gpu = agc_(gpu)
    finally:
        torch.cuda.set_sync_debug_mode(old)
    assert int(n_gpu) == int(n_cpu)
    for p, q in zip(cpu, gpu, strict=True):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=0.0, equal_nan=True)
