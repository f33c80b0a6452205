"""Norms, clip and ignore across processes: gloo on the CPU, 2 and 4 ranks, one spawn.

A module-scoped fixture starts one world of 4 ranks (with two 2-rank groups inside it)
and runs every scenario of ``dist_workers.py`` in it; each test below checks one
scenario's results. The references are single-process: float64 maths on the
concatenated tensors, gradlab on the whole tensors, or the unsharded model.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import gradlab

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)
if not dist.is_gloo_available():
    pytest.skip("torch.distributed has no gloo backend in this build", allow_module_level=True)

import dist_workers as dw  # noqa: E402  (needs torch.distributed)

SIZES = dw.SIZES
P_VALUES = dw.NORM_TYPES


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the 4 ranks saw, scenario by scenario (one spawn for the module)."""
    results = dw.start(str(tmp_path_factory.mktemp("dist")), timeout_s=300)
    return results


def _scenario(ranks, name):
    missing = [r for r, res in enumerate(ranks) if name not in res]
    if missing:
        pytest.fail(f"ranks {missing} saved nothing for {name!r}: {ranks[0]['__error__']}")
    for r, res in enumerate(ranks):
        if "error" in res[name]:
            pytest.fail(f"rank {r} raised in {name!r}:\n{res[name]['error']}")
    return [res[name] for res in ranks]


def _members(size):
    """The groups of ``size`` ranks, as lists of global ranks, in group-rank order."""
    return [list(range(dw.WORLD))] if size == dw.WORLD else [[0, 1], [2, 3]]


def _same(a, b) -> bool:
    """Bitwise equality of tensors (NaN equal to NaN), or plain equality."""
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(dw_bits(a), dw_bits(b))
    return a == b


def dw_bits(t):
    t = t.detach().reshape(-1).contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _math_norm(tensors, p) -> float:
    """The p-norm of the concatenated entries, in float64 maths (scaled: no overflow)."""
    x = torch.cat([t.reshape(-1).double() for t in tensors]).abs()
    if x.numel() == 0:
        return 0.0
    m = float(x.max())
    if p == math.inf or m == 0:
        return m
    return m * float(((x / m) ** p).sum()) ** (1 / p)


# ------------------------------------------------- arguments (one process, no spawn)


@pytest.mark.parametrize(
    "call",
    [
        lambda ps, **kw: gradlab.get_total_norm([p.grad for p in ps], **kw),
        lambda ps, **kw: gradlab.clip_grad_norm_(ps, 1.0, **kw),
        lambda ps, **kw: gradlab.grad_ignore_norm_(ps, 1.0, **kw),
        lambda ps, **kw: gradlab.grad_ignore_value_(ps, 1.0, **kw),
    ],
    ids=["get_total_norm", "clip_grad_norm_", "grad_ignore_norm_", "grad_ignore_value_"],
)
def test_process_group_is_checked_before_any_gradient_changes(call):
    params = dw.with_grads(dw.make_tensors(torch.float32, "large"))
    before = [p.grad.clone() for p in params]
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        call(params, process_group=object())
    assert all(_same(p.grad, b) for p, b in zip(params, before, strict=True))


@pytest.mark.parametrize(
    "fn",
    [
        gradlab.get_total_norm,
        gradlab.clip_grad_norm_,
        gradlab.grad_ignore_norm_,
        gradlab.grad_ignore_value_,
    ],
)
def test_process_group_is_keyword_only_and_local_by_default(fn):
    param = inspect.signature(fn).parameters["process_group"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is None


# ------------------------------------------------------------------ sharded by hand


@pytest.mark.parametrize("kind", list(dw.KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("size", SIZES)
def test_sharded_norm_is_the_norm_of_the_whole(ranks, size, p, dtype, kind):
    res = _scenario(ranks, "norms")
    key = ("norm", size, str(dtype), kind, p)
    full = dw.make_tensors(dtype, kind)
    expected = _math_norm(full, p)
    rtol = 2e-6 if dtype == torch.float32 else 1e-13
    for members in _members(size):
        values = [res[r][key] for r in members]
        assert all(_same(values[0], v) for v in values), f"ranks disagree: {values}"
        assert values[0].dtype == dtype
        assert float(values[0]) == pytest.approx(expected, rel=rtol)
        # The local norms alone are not the norm (the shards are real shards).
        local = [float(res[r][("local", size, str(dtype), kind, p)]) for r in members]
        if p <= 3.5:  # larger p are dominated by the largest entry, held by one rank
            assert max(local) < expected * (1 - 1e-3)


@pytest.mark.parametrize("kind", ["large", "tiny"])
def test_large_p_neither_overflows_nor_underflows_across_ranks(ranks, kind):
    """p = 100 in float32: sum_r n_r^p is inf ("large") or 0 ("tiny"); gradlab's is right."""
    res = _scenario(ranks, "norms")
    size, p = 4, 100.0
    local = [res[r][("local", size, "torch.float32", kind, p)] for r in range(size)]
    naive = torch.stack([n**p for n in local]).sum() ** (1 / p)
    assert float(naive) in (math.inf, 0.0)
    got = float(res[0][("norm", size, "torch.float32", kind, p)])
    assert got == pytest.approx(_math_norm(dw.make_tensors(torch.float32, kind), p), rel=2e-6)


def _concat(shards_by_rank):
    """Per tensor, the rank shards concatenated along dim 0."""
    return [torch.cat(pieces) for pieces in zip(*shards_by_rank, strict=True)]


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("size", SIZES)
def test_clip_with_process_group_matches_one_process(ranks, size, p):
    res = _scenario(ranks, "norms")
    full = dw.make_tensors(torch.float32, "normal")
    ref_norm = float(gradlab.get_total_norm(full, p))
    reference = dw.with_grads(full)
    expected_norm = gradlab.clip_grad_norm_(reference, 0.5 * ref_norm, p)
    for members in _members(size):
        norms = [res[r][("clip", size, p)][0] for r in members]
        assert all(_same(norms[0], n) for n in norms), "ranks clipped by different norms"
        assert float(norms[0]) == pytest.approx(float(expected_norm), rel=2e-6)
        clipped = _concat([res[r][("clip", size, p)][1] for r in members])
        for got, want in zip(clipped, reference, strict=True):
            torch.testing.assert_close(got, want.grad, rtol=3e-6, atol=0)


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("size", SIZES)
def test_ignore_with_process_group_decides_alike(ranks, size, p):
    res = _scenario(ranks, "norms")
    full = dw.make_tensors(torch.float32, "normal")
    for members in _members(size):
        # Threshold 0.95 x the global norm: every rank zeroes, though alone some keep.
        over = [res[r][("ignore_over", size, p)] for r in members]
        assert all(_same(over[0][0], o[0]) for o in over)
        assert all(bool((g == 0).all()) for o in over for g in o[1])
        alone_kept = [any(bool((g != 0).any()) for g in o[2]) for o in over]
        assert any(alone_kept), "the threshold does not separate local from global"
        # 1.05 x: every rank keeps its shard bit for bit.
        under = [res[r][("ignore_under", size, p)] for r in members]
        kept = _concat([u[1] for u in under])
        for got, want in zip(kept, full, strict=True):
            assert _same(got, want)


@pytest.mark.parametrize("size", SIZES)
def test_ignore_value_with_process_group(ranks, size):
    res = _scenario(ranks, "norms")
    full = dw.make_tensors(torch.float32, "normal")
    peak = float(gradlab.get_total_norm(full, math.inf))
    for members in _members(size):
        over = [res[r][("value_over", size)] for r in members]
        assert all(float(o[0]) == peak for o in over)
        assert all(bool((g == 0).all()) for o in over for g in o[1])
        assert any(any(bool((g != 0).any()) for g in o[2]) for o in over)
        under = _concat([res[r][("value_under", size)][1] for r in members])
        assert all(_same(g, w) for g, w in zip(under, full, strict=True))


@pytest.mark.parametrize("size", SIZES)
def test_collectives_are_no_host_reads(ranks, size):
    res = _scenario(ranks, "norms")
    assert all(res[r][("host_reads", size)] == [] for r in range(dw.WORLD))


# -------------------------------------------------------------- a NaN on one rank


@pytest.mark.parametrize("size", SIZES)
def test_gloo_max_and_min_drop_a_nan_depending_on_the_rank(ranks, size):
    """The pitfall: MAX/MIN of NaN keep it only when rank 0 holds it; SUM always does."""
    res = _scenario(ranks, "nonfinite")
    for members in _members(size):
        for bad in range(size):
            raw = [res[r][("raw", size, bad)] for r in members]
            assert all(math.isnan(x["sum"]) for x in raw)
            dropped = [not math.isnan(x["max"]) for x in raw]
            assert len(set(dropped)) == 1  # the same wrong answer everywhere
        lost = [
            bad for bad in range(size) if not math.isnan(res[members[0]][("raw", size, bad)]["max"])
        ]
        assert lost, "gloo's MAX propagated every NaN: the pitfall is gone"
        assert 0 not in lost  # as measured: a NaN on rank 0 survives, on rank 1 it is lost


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("size", SIZES)
def test_a_nonfinite_gradient_on_one_rank_reaches_every_rank(ranks, size, value):
    res = _scenario(ranks, "nonfinite")
    for members in _members(size):
        for bad in range(size):
            seen = [res[r][("bad", size, bad, str(value))] for r in members]
            for s in seen:
                for p in (2.0, math.inf, 100.0):
                    n = s["norm", p]
                    assert math.isnan(n) if math.isnan(value) else n == math.inf, (bad, p, n)
                assert s["ignore_norm_zero"] and s["ignore_value_zero"]
                assert not math.isfinite(s["clip_norm"])


# ------------------------------------------------------------------------------ DDP


@pytest.mark.parametrize("size", SIZES)
def test_ddp_clip_keeps_replicas_bitwise_identical(ranks, size):
    res = _scenario(ranks, "ddp")
    for members in _members(size):
        runs = [res[r][("clip", size)] for r in members]
        assert len({run["params"] for run in runs}) == 1
        assert len({run["state"] for run in runs}) == 1
        assert all(_same(runs[0]["norms"], run["norms"]) for run in runs)
        assert bool((runs[0]["norms"] > 0.1).all())  # clipping was active
        # ... and equal, up to the order of the additions, to one process on all batches
        ref_params, ref_norms = dw.ddp_clip_reference(size)
        torch.testing.assert_close(runs[0]["norms"].double(), ref_norms, rtol=1e-5, atol=0)
        for got, want in zip(runs[0]["values"], ref_params, strict=True):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("size", SIZES)
def test_ddp_local_skip_rule_diverges_reduced_one_does_not(ranks, size):
    res = _scenario(ranks, "ddp")
    for members in _members(size):
        local = [res[r][("local", size)] for r in members]
        assert len({tuple(run["skipped"]) for run in local}) > 1
        assert len({run["params"] for run in local}) > 1, "the control did not diverge"
        reduced = [res[r][("reduced", size)] for r in members]
        assert len({run["params"] for run in reduced}) == 1
        assert len({run["state"] for run in reduced}) == 1
        assert all(run["finite"] for run in reduced)
        skipped = reduced[0]["skipped"]
        assert skipped[dw.SPIKE_STEP] and skipped[dw.NAN_STEP]
        assert all(run["skipped"] == skipped for run in reduced)


# ---------------------------------------------------------------------------- FSDP2


@pytest.mark.parametrize("shape", list(dw.FSDP_SHAPES))
@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("size", SIZES)
def test_fsdp_global_norm(ranks, size, p, shape):
    res = _scenario(ranks, "fsdp")
    key = (size, shape, p)
    for members in _members(size):
        assert all(
            s.startswith("(Shard(dim=0)") for s in res[members[0]][("placements", size, shape)]
        )
        values = [res[r][("gradlab", *key)] for r in members]
        assert all(_same(values[0], v) for v in values)
        reference = float(res[members[0]][("reference", *key)])
        assert float(values[0]) == pytest.approx(reference, rel=2e-6)
        local = [float(res[r][("local", *key)]) for r in members]
        assert len(set(local)) > 1
        assert all(n <= float(values[0]) * (1 + 1e-6) for n in local)
        if p <= 3.5:
            assert max(local) < float(values[0])
        torch_norm = res[members[0]].get(("torch", *key))
        if torch_norm is None:  # torch's inf-norm raises on a rank with an empty shard
            assert p == math.inf and shape == "uneven"
            if size == dw.WORLD:
                assert 0 in res[members[-1]][("numel", size, shape)]
        elif p == 100.0 and shape == "even":
            assert float(torch_norm) == 0.0  # torch: n_r^100 underflows in float32
        elif p == 100.0:  # torch takes n_r^100 directly, gradlab scales: a rounding apart
            assert float(torch_norm) == pytest.approx(float(values[0]), rel=2e-6)
        else:  # up to p = 4 (and the inf-norm), torch's bits
            assert _same(values[0], torch_norm), (values[0], torch_norm)


@pytest.mark.parametrize("shape", list(dw.FSDP_SHAPES))
@pytest.mark.parametrize("size", SIZES)
def test_fsdp_clip_with_the_global_norm(ranks, size, shape):
    res = _scenario(ranks, "fsdp")
    for members in _members(size):
        norms = [res[r][("clip", size, shape)][0] for r in members]
        assert all(_same(norms[0], n) for n in norms)
        _, got, want = res[members[0]][("clip", size, shape)]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape", list(dw.FSDP_SHAPES))
@pytest.mark.parametrize("size", SIZES)
def test_fsdp_second_phases_take_torchs_dtensor_norm(ranks, size, shape):
    """clip_grads_with_norm_ / grad_ignore_with_norm_ accept torch's DTensor norm."""
    res = _scenario(ranks, "fsdp")
    for members in _members(size):
        for r in members:
            for name in ("with_norm", "value"):
                got, want = res[r][(name, size, shape)]
                for g, w in zip(got, want, strict=True):
                    torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-7)
            assert res[r][("ignore_with_norm", size, shape)]


@pytest.mark.parametrize("size", SIZES)
def test_fsdp_nan_on_one_rank(ranks, size):
    """gradlab: NaN everywhere. torch's inf-norm goes through DTensor's MAX and loses it."""
    res = _scenario(ranks, "fsdp")
    for members in _members(size):
        for shape in dw.FSDP_SHAPES:
            for r in members:
                assert math.isnan(res[r][("nan_gradlab", size, shape, 2.0)])
                assert math.isnan(res[r][("nan_gradlab", size, shape, math.inf)])
                assert res[r][("nan_ignored", size, shape)]
        assert math.isnan(res[members[0]][("nan_torch", size, "even", 2.0)])
        assert math.isfinite(res[members[0]][("nan_torch", size, "even", math.inf)])


@pytest.mark.parametrize("p", [1.0, 2.0, math.inf, 100.0])
def test_hsdp_norm_sums_the_shard_dim_only(ranks, p):
    res = _scenario(ranks, "hsdp")
    assert all(s.startswith("(Replicate(), Shard(dim=0))") for s in res[0]["placements"])
    values = [res[r][("gradlab", p)] for r in range(dw.WORLD)]
    assert all(_same(values[0], v) for v in values)
    assert float(values[0]) == pytest.approx(float(res[0][("reference", p)]), rel=2e-6)
    assert float(res[0][("torch", p)]) == pytest.approx(float(values[0]), rel=2e-6)


# ------------------------------------------------------ N steps, spike and NaN on one rank


@pytest.mark.parametrize("size", SIZES)
def test_steps_with_a_spike_and_a_nan_on_one_rank(ranks, size):
    res = _scenario(ranks, "steps")
    reference = dw.steps_reference(size)
    for members in _members(size):
        runs = [res[r][("reduced", size)] for r in members]
        # the replicated b: parameters and optimizer state bitwise identical on every rank
        assert len({run["b"] for run in runs}) == 1
        assert len({run["b_state"] for run in runs}) == 1
        assert runs[0]["b"] == dw.digest([reference["b"]])
        assert runs[0]["b_state"] == dw.digest(reference["state"][3:])
        # the sharded w: the shards put together are the single-process run
        w = torch.cat([run["w"] for run in runs])
        assert bool(torch.isfinite(w).all())
        assert _same(w, reference["w"])
        for i in range(2):  # exp_avg, exp_avg_sq
            state = torch.cat([run["w_state"][i] for run in runs])
            assert _same(state, reference["state"][i])
        # the control: each rank deciding alone lets b drift apart
        local = [res[r][("local", size)] for r in members]
        assert len({run["b"] for run in local}) > 1


# ------------------------------------------------------------ StepGuard(process_group=)


@pytest.mark.parametrize("optimizer", list(dw.GUARD_OPTIMIZERS))
@pytest.mark.parametrize("size", SIZES)
def test_guard_with_a_process_group_keeps_replicas_and_policies_identical(ranks, size, optimizer):
    res = _scenario(ranks, "guard")
    for members in _members(size):
        runs = [res[r][("ddp", size, optimizer, True)] for r in members]
        for key in ("params", "state", "policies", "decisions"):
            assert len({str(run[key]) for run in runs}) == 1, key
        assert all(run["finite"] for run in runs)
        decisions = runs[0]["decisions"]
        # rank 1's spiking loss, then its NaN, make every rank skip
        assert decisions[dw.GUARD_SPIKE_STEP] == "skipped"
        assert decisions[dw.GUARD_NAN_STEP] == "skipped"
        assert decisions.count("skipped") == 2
        # the control: each rank's own loss rule; rank 1 alone skips the spike
        local = [res[r][("ddp", size, optimizer, False)] for r in members]
        spiked = [run["decisions"][dw.GUARD_SPIKE_STEP] for run in local]
        assert spiked[1] == "skipped" and spiked.count("skipped") == 1
        assert len({run["params"] for run in local}) > 1, "the control did not diverge"
        assert len({run["policies"] for run in local}) > 1


@pytest.mark.parametrize("size", SIZES)
def test_guard_with_a_process_group_makes_no_host_read_when_fused(ranks, size):
    res = _scenario(ranks, "guard")
    for members in _members(size):
        for r in members:
            reads = res[r][("ddp", size, "fused", True)]["reads"]
            assert reads[1:] == [0] * (dw.GUARD_STEPS - 1), reads  # the first creates state


@pytest.mark.parametrize("size", SIZES)
def test_guard_over_sharded_grads_decides_on_the_global_norm(ranks, size):
    res = _scenario(ranks, "guard")
    reference = dw.guard_sharded_reference(size)
    expected = ["kept" if keep else "skipped" for keep in reference["taken"]]
    assert expected.count("skipped") == 2  # the spike and the NaN, on one rank's shard
    for members in _members(size):
        runs = [res[r][("sharded", size)] for r in members]
        assert all(run["decisions"] == expected for run in runs)
        assert _same(torch.cat([run["w"] for run in runs]), reference["w"])
        for i in range(3):  # exp_avg, exp_avg_sq, step
            if i == 2:
                assert all(_same(run["state"][2], reference["state"][2]) for run in runs)
                continue
            state = torch.cat([run["state"][i] for run in runs])
            assert _same(state, reference["state"][i])


def test_guard_process_group_arguments_are_checked():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match="grads='sharded' is for a guard with a process_group"):
        gradlab.StepGuard(opt, grads="sharded")
    with pytest.raises((RuntimeError, ValueError), match="process_group"):
        gradlab.StepGuard(opt, process_group=object(), grads="sharded")
