"""gradlab.adaptive: the threshold policies and agc_, against the papers' equations.

The references below are written from each paper's equations in plain Python floats
(float64) with the statistics module, and for AGC as a float64 loop over units; none
of them calls gradlab. Compilation is tested in test_adaptive_compile.py.
"""

from __future__ import annotations

import io
import math
import random
import statistics
from collections import deque

import pytest
import torch

from gradlab.adaptive import AutoClip, SigmaSkip, ThresholdPolicy, ZClip, agc_
from gradlab.sync import HostReadCounter

INF = math.inf
BAD = (math.nan, math.inf, -math.inf)
_INT_OF = {4: torch.int32, 8: torch.int64}


# -------------------------------------------------------------------- references


class RefAutoClip:
    """Seetharaman et al. 2020, restricted to the last `window` accepted, finite values."""

    def __init__(self, quantile, window):
        self.q, self.values = quantile, deque(maxlen=window)

    def threshold(self, x):
        if not self.values:
            return INF
        s = sorted(self.values)
        r = self.q * (len(s) - 1)
        lo, hi = math.floor(r), math.ceil(r)
        return s[lo] + (r - lo) * (s[hi] - s[lo])

    def update(self, x, accepted):
        if accepted and math.isfinite(x):
            self.values.append(x)


class RefZClip:
    """Kumar et al. 2025: EMA mean and variance, z-score, adaptive scaling, warm-up."""

    def __init__(self, alpha, z_thresh, warmup, eps, max_norm=None):
        self.alpha, self.zt, self.warmup, self.eps, self.max_norm = (
            alpha,
            z_thresh,
            warmup,
            eps,
            max_norm,
        )
        self.buffer, self.mu, self.var = [], None, None

    def threshold(self, x):
        if self.mu is None:
            return INF if self.max_norm is None else self.max_norm
        sigma = math.sqrt(self.var)
        z = (x - self.mu) / (sigma + self.eps)
        if z > self.zt:
            eta = z / self.zt  # the paper's form: mu + z_thresh * sigma / eta
            return self.mu + self.zt * sigma / eta
        return INF

    def update(self, x, accepted):
        if not (accepted and math.isfinite(x)):
            return
        if self.mu is None:
            self.buffer.append(x)
            if len(self.buffer) == self.warmup:
                self.mu = statistics.fmean(self.buffer)
                self.var = statistics.pvariance(self.buffer, self.mu)
            return
        clipped = min(x, self.threshold(x))
        self.mu = self.alpha * self.mu + (1 - self.alpha) * clipped
        self.var = self.alpha * self.var + (1 - self.alpha) * (clipped - self.mu) ** 2


class RefSigmaSkip:
    """OLMo-core's σ rule on the last `window` accepted, finite values."""

    def __init__(self, k, window, min_count):
        self.k, self.min_count, self.values = k, min_count, deque(maxlen=window)

    def threshold(self, x):
        if len(self.values) < self.min_count:
            return INF
        return statistics.fmean(self.values) + self.k * statistics.stdev(self.values)

    def update(self, x, accepted):
        if accepted and math.isfinite(x):
            self.values.append(x)


# name: (gradlab class, reference class, small kwargs)
POLICIES = {
    "autoclip": (AutoClip, RefAutoClip, dict(quantile=0.9, window=16)),
    "autoclip_median": (AutoClip, RefAutoClip, dict(quantile=0.5, window=7)),
    "zclip": (ZClip, RefZClip, dict(alpha=0.9, z_thresh=2.0, warmup=6, eps=1e-6)),
    "zclip_max_norm": (
        ZClip,
        RefZClip,
        dict(alpha=0.97, z_thresh=2.5, warmup=5, eps=1e-6, max_norm=3.0),
    ),
    "sigmaskip": (SigmaSkip, RefSigmaSkip, dict(k=2.0, window=12, min_count=5)),
}
DEFAULTS = {
    "autoclip": (AutoClip, RefAutoClip, dict(quantile=0.9, window=1000), 1300),
    "zclip": (ZClip, RefZClip, dict(alpha=0.97, z_thresh=2.5, warmup=25, eps=1e-6), 300),
    "sigmaskip": (SigmaSkip, RefSigmaSkip, dict(k=6.0, window=128, min_count=64), 300),
}


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


def acceptance(n, seed=1, p=0.85):
    rng = random.Random(seed)
    return [rng.random() < p for _ in range(n)]


def make(name, dtype=torch.float64):
    cls, _, kwargs = POLICIES[name]
    return cls(**kwargs, dtype=dtype)


def run(policy, stream, accepted=None, dtype=torch.float64):
    """Thresholds of ``policy`` over the stream, as one tensor (threshold, then update)."""
    out = []
    for i, x in enumerate(stream):
        stat = torch.tensor(x, dtype=dtype)
        out.append(policy.threshold(stat))
        ok = True if accepted is None else accepted[i]
        policy.update(stat, torch.tensor(ok))
    return torch.stack(out)


def state_bits(policy):
    """The state as integer views, so that equality is equality of bits (NaN included)."""
    bits = {}
    for name, t in policy.state_dict()["state"].items():
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


# ------------------------------------------------------------ against references


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_thresholds_match_reference(name, dtype):
    cls, ref_cls, kwargs = POLICIES[name]
    stream = [float(torch.tensor(x, dtype=dtype)) for x in spiky_stream(150, seed=3)]
    accepted = acceptance(len(stream), seed=4)
    policy, ref = cls(**kwargs, dtype=dtype), ref_cls(**kwargs)
    rel = 1e-12 if dtype == torch.float64 else 2e-5
    n_finite = 0
    for x, ok in zip(stream, accepted, strict=True):
        if name == "sigmaskip":  # skip mode: what is over is not accepted
            ok = ok and not x > ref.threshold(x)
        stat = torch.tensor(x, dtype=dtype)
        got = policy.threshold(stat)
        want = ref.threshold(x)
        assert got.shape == () and got.dtype == dtype
        assert float(got) == pytest.approx(want, rel=rel), (x, want)
        n_finite += math.isfinite(want)
        policy.update(stat, torch.tensor(ok))
        ref.update(x, ok)
    # The stream exercised the adaptive thresholds (ZClip's is finite only on spikes).
    assert n_finite >= (5 if cls is ZClip else 50)


@pytest.mark.parametrize("name", list(DEFAULTS))
def test_defaults_match_reference(name):
    cls, ref_cls, kwargs, n = DEFAULTS[name]
    policy, ref = cls(), ref_cls(**kwargs)  # the documented defaults are these
    config = policy.state_dict()["config"]
    assert {key: config[key] for key in kwargs} == kwargs
    # float32 state, the usual dtype of a norm. AutoClip's ranks q * (n - 1) are float32,
    # as in torch.quantile: off by up to half an ulp of 999, so the weight by ~3e-5.
    rel = 1e-4 if cls is AutoClip else 2e-5
    for x in spiky_stream(n, seed=5):
        stat = torch.tensor(x)
        assert float(policy.threshold(stat)) == pytest.approx(ref.threshold(float(stat)), rel=rel)
        policy.update(stat, torch.tensor(True))
        ref.update(float(stat), True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("q", [0.0, 0.37, 0.9, 1.0])
def test_autoclip_is_torch_quantile_bit_for_bit(dtype, q):
    policy = AutoClip(quantile=q, window=10, dtype=dtype)
    seen = []
    for x in spiky_stream(40, seed=6):
        stat = torch.tensor(x, dtype=dtype)
        got = policy.threshold(stat)
        if seen:
            assert_same_bits(got, torch.quantile(torch.stack(seen[-10:]), q))
        policy.update(stat, torch.tensor(True))
        seen.append(stat)


def test_zclip_clips_spikes_and_feeds_back_the_clipped_value():
    policy, ref = ZClip(warmup=5, dtype=torch.float64), RefZClip(0.97, 2.5, 5, 1e-6)
    for x in [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02]:
        policy.update(torch.tensor(x, dtype=torch.float64), torch.tensor(True))
        ref.update(x, True)
    spike = torch.tensor(40.0, dtype=torch.float64)
    tau = policy.threshold(spike)
    mu, sigma = ref.mu, math.sqrt(ref.var)
    z = (40.0 - mu) / (sigma + 1e-6)
    assert float(tau) == pytest.approx(mu + 2.5**2 * sigma / z, rel=1e-12)
    assert mu < float(tau) < mu + 2.5 * sigma  # adaptive scaling: below the z line
    policy.update(spike, torch.tensor(True))
    ref.update(40.0, True)
    assert float(policy.state_dict()["state"]["mean"]) == pytest.approx(ref.mu, rel=1e-12)
    assert ref.mu < 1.1  # the spike entered the EMA clipped, not at 40


def test_thresholds_before_enough_history():
    x = torch.tensor(5.0)
    assert AutoClip().threshold(x) == INF
    assert ZClip().threshold(x) == INF
    assert ZClip(max_norm=2.0).threshold(x) == 2.0
    sigma = SigmaSkip(window=8, min_count=4)
    for v in (1.0, 2.0, 3.0):
        sigma.update(torch.tensor(v), torch.tensor(True))
        assert sigma.threshold(x) == INF
    sigma.update(torch.tensor(4.0), torch.tensor(True))
    assert math.isfinite(sigma.threshold(x))


def test_constant_stream_has_no_nan():
    for policy in (AutoClip(window=4), ZClip(warmup=3), SigmaSkip(window=4, min_count=2)):
        thresholds = run(policy, [2.0] * 10 + [3.0, 2.0], dtype=torch.float32)
        assert not thresholds.isnan().any(), policy


# ---------------------------------------------------------- NaN leaves no trace


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
def test_non_finite_step_leaves_no_trace(name, bad):
    stream = spiky_stream(26, seed=7)
    clean = run(make(name), stream)
    for i in range(len(stream) + 1):  # every position, warm-up included
        got = run(make(name), [*stream[:i], bad, *stream[i:]])
        assert_same_bits(torch.cat([got[:i], got[i + 1 :]]), clean)


def test_too_large_for_float32_counts_as_infinite():
    stream = spiky_stream(20, seed=8)
    for name in POLICIES:
        clean = run(make(name, torch.float32), stream)
        got = run(make(name, torch.float32), [*stream[:9], 1e300, *stream[9:]], dtype=torch.float64)
        assert_same_bits(torch.cat([got[:9], got[10:]]), clean)


@pytest.mark.parametrize("name", list(POLICIES))
def test_rejected_steps_leave_state_bit_identical(name):
    stream = spiky_stream(60, seed=9)
    accepted = acceptance(len(stream), seed=10, p=0.6)
    policy = make(name)
    for x, ok in zip(stream, accepted, strict=True):
        stat = torch.tensor(x, dtype=torch.float64)
        before = make(name)
        before.load_state_dict(policy.state_dict())
        policy.threshold(stat)  # no side effects
        assert_same_state(policy, before)
        policy.update(stat, torch.tensor(ok))
        if not ok:
            assert_same_state(policy, before)
    # ... and so the thresholds are those of the stream of accepted steps alone.
    kept = [x for x, ok in zip(stream, accepted, strict=True) if ok]
    everything = run(make(name), stream, accepted)
    assert_same_bits(everything[[i for i, ok in enumerate(accepted) if ok]], run(make(name), kept))


# ------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_checkpoint_round_trip_resumes_bit_for_bit(name, dtype):
    stream = spiky_stream(70, seed=11)
    accepted = acceptance(len(stream), seed=12)
    whole = run(make(name, dtype), stream, accepted, dtype)
    for cut in (3, 31):  # in warm-up (or an unfilled window), and after it
        first = make(name, dtype)
        run(first, stream[:cut], accepted[:cut], dtype)
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)
        run(first, stream[cut:], accepted[cut:], dtype)  # the saved copy must not move
        buffer.seek(0)
        resumed = make(name, dtype)
        resumed.load_state_dict(torch.load(buffer))
        assert_same_bits(run(resumed, stream[cut:], accepted[cut:], dtype), whole[cut:])


def test_load_state_dict_refuses_another_policy():
    saved = AutoClip(window=8).state_dict()
    with pytest.raises(ValueError, match="window"):
        AutoClip(window=9).load_state_dict(saved)
    with pytest.raises(ValueError, match="config"):
        AutoClip(window=8).load_state_dict({"state": saved["state"]})
    with pytest.raises(ValueError, match=r"torch\.float64 tensor"):
        AutoClip(window=8, dtype=torch.float64).load_state_dict(saved)
    broken = {"config": saved["config"], "state": {"values": saved["state"]["values"]}}
    with pytest.raises(ValueError, match="count"):
        AutoClip(window=8).load_state_dict(broken)


# -------------------------------------------------------------- host and device


@pytest.mark.parametrize("name", list(POLICIES))
def test_no_host_reads(name):
    policy = make(name, torch.float32)
    stats = [*spiky_stream(30, seed=13), math.nan, math.inf]
    tensors = [torch.tensor(x) for x in stats]
    flags = [torch.tensor(ok) for ok in acceptance(len(stats), seed=14)]
    with HostReadCounter() as reads:
        for stat, ok in zip(tensors, flags, strict=True):
            policy.threshold(stat)
            policy.update(stat, ok)
    assert reads.count == 0


def test_policies_follow_the_statistic_device():
    for policy in (AutoClip(window=4), ZClip(warmup=2), SigmaSkip(window=4, min_count=2)):
        assert isinstance(policy, ThresholdPolicy)
        stat = torch.tensor(1.0, device="meta")  # a device other than the CPU, anywhere
        tau = policy.threshold(stat)
        policy.update(stat, torch.tensor(True, device="meta"))
        assert tau.device.type == "meta" and tau.shape == ()
        assert policy.device.type == "meta"
        assert all(t.device.type == "meta" for t in policy.state_dict()["state"].values())
        fresh = type(policy)()
        assert fresh.to("cpu") is fresh and fresh.to("meta").device.type == "meta"


def test_statistic_inputs():
    policy = SigmaSkip(window=4, min_count=2)
    loss = torch.tensor([2.0], requires_grad=True) * 1.5  # a loss with a graph, one element
    policy.update(loss, True)
    policy.update(3.5, torch.tensor([True]))
    policy.update(math.nan, True)  # a Python float, NaN too, and leaves no trace
    assert float(policy.threshold(loss)) == pytest.approx(3.25 + 6 * math.sqrt(0.125))
    assert not policy.threshold(loss).requires_grad
    with pytest.raises(ValueError, match="stat"):
        policy.threshold(torch.ones(2))
    with pytest.raises(ValueError, match="stat"):
        policy.threshold("1.0")
    with pytest.raises(ValueError, match="accepted"):
        policy.update(loss, torch.tensor(1.0))


@pytest.mark.parametrize(
    ("make_policy", "argument"),
    [
        (lambda: AutoClip(quantile=1.5), "quantile"),
        (lambda: AutoClip(quantile=math.nan), "quantile"),
        (lambda: AutoClip(window=0), "window"),
        (lambda: AutoClip(window=2.0), "window"),
        (lambda: AutoClip(dtype=torch.float16), "dtype"),
        (lambda: ZClip(alpha=1.0), "alpha"),
        (lambda: ZClip(alpha=-0.1), "alpha"),
        (lambda: ZClip(z_thresh=0.0), "z_thresh"),
        (lambda: ZClip(warmup=0), "warmup"),
        (lambda: ZClip(eps=-1.0), "eps"),
        (lambda: ZClip(max_norm=-1.0), "max_norm"),
        (lambda: SigmaSkip(k=-1.0), "k"),
        (lambda: SigmaSkip(k=True), "k"),
        (lambda: SigmaSkip(window=1), "window"),
        (lambda: SigmaSkip(min_count=1), "min_count"),
        (lambda: SigmaSkip(window=8, min_count=9), "min_count"),
    ],
)
def test_policy_arguments_are_checked(make_policy, argument):
    with pytest.raises(ValueError, match=argument):
        make_policy()


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
def test_cuda_follows_the_device_without_syncing(name):
    stream = [*spiky_stream(40, seed=15), math.nan, *spiky_stream(10, seed=16)]
    want = run(make(name, torch.float32), stream, dtype=torch.float32)
    policy = make(name, torch.float32)  # built on the CPU: its state follows the stat
    stats = [torch.tensor(x, device="cuda") for x in stream]
    yes = torch.tensor(True, device="cuda")
    got = [policy.threshold(stats[0])]
    policy.update(stats[0], yes)
    assert policy.device.type == "cuda"
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # any wait for the GPU raises
    try:
        for stat in stats[1:]:
            got.append(policy.threshold(stat))
            policy.update(stat, yes)
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
