"""Norms under tensor, pipeline and expert parallelism: gloo and DTensor on the CPU.

A module-scoped fixture starts one world of 4 ranks (``parallel_workers.py``) and runs
every scenario in it:

* DTensor gradients of every placement, made from seeded full tensors: Shard(0),
  Shard(1), Replicate and Partial on a 2-rank TP mesh and on 4 ranks, 2-D placements
  on a 2 x 2 mesh, and DTensors of three meshes in one call;
* a real tensor-parallel model (``parallelize_module``: Colwise, Rowwise and
  SequenceParallel, whose LayerNorm gradients are Partial) on 2 and 4 ranks, and FSDP2 x
  TP on the 2 x 2 mesh (``_StridedShard``), against the unsharded model in float64;
* pipeline stages holding different layers, reduced over the PP group;
* experts split over an EP group beside replicated dense tensors (``total_norm``'s
  parts), torchtitan-style experts on their own mesh, and EP x PP.

Every norm is compared with the float64 norm of the full gradients, gathered by torch
(``DTensor.full_tensor()``) or rebuilt from the seeds, never with gradlab; each layout
also has a control that counts some entries twice or not at all, and differs.
"""

from __future__ import annotations

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
import parallel_workers as pw  # noqa: E402
from clip_helpers import math_norm, same_bits  # noqa: E402

P_VALUES = pw.P_VALUES
RTOL = {torch.float32: 2e-6, torch.float64: 1e-13, torch.bfloat16: 2e-6}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the 4 ranks saw, scenario by scenario (one spawn for the module)."""
    out = str(tmp_path_factory.mktemp("parallel"))
    return dw.start(out, timeout_s=420, module="parallel_workers")


def _scenario(ranks, name):
    missing = [r for r, res in enumerate(ranks) if name not in res]
    if missing:
        pytest.fail(f"ranks {missing} saved nothing for {name!r}: {ranks[0]['__error__']}")
    for r, res in enumerate(ranks):
        if "error" in res[name]:
            pytest.fail(f"rank {r} raised in {name!r}:\n{res[name]['error']}")
    return [res[name] for res in ranks]


def _agreed(values):
    """The one value every rank holds, bit for bit."""
    assert all(same_bits(values[0], v) for v in values), f"ranks disagree: {values}"
    return float(values[0])


def _differs(value, reference, rel=1e-3):
    return abs(float(value) - reference) > rel * reference


# ------------------------------------------------------------- DTensor placements


@pytest.mark.parametrize("dtype", pw.DTYPES, ids=str)
@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("case", list(pw.CASES))
def test_dtensor_norm_counts_every_entry_once(ranks, case, p, dtype):
    res = _scenario(ranks, "placements")
    full = res[0]["full", case, str(dtype)]
    for r in res:
        assert all(same_bits(a, b) for a, b in zip(full, r["full", case, str(dtype)], strict=True))
    reference = math_norm(full, p)
    got = _agreed([r["gradlab", case, str(dtype), p] for r in res])
    assert got == pytest.approx(reference, rel=RTOL[dtype])
    assert res[0]["gradlab", case, str(dtype), p].dtype == (
        torch.float32 if dtype == torch.bfloat16 else dtype
    )


def test_the_cases_cover_the_placements(ranks):
    res = _scenario(ranks, "placements")
    seen = {s for case in pw.CASES for s in res[0]["placements", case]}
    for text in ("Shard(dim=0)", "Shard(dim=1)", "Replicate()", "Partial(sum)"):
        assert any(text in s for s in seen), text
    assert "(Shard(dim=0), Partial(sum))" in seen and "(Replicate(), Shard(dim=1))" in seen


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("case", list(pw.CASES))
def test_a_norm_blind_to_placements_is_wrong(ranks, case, p):
    """The control: local values summed over the world count replicas 2-4 times."""
    res = _scenario(ranks, "placements")
    reference = math_norm(res[0]["full", case, "torch.float32"], p)
    naive = float(res[0]["naive", case, p])
    if p == math.inf:  # a copy counted twice has the same maximum: only addends differ
        return
    assert _differs(naive, reference)


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, 8.0])
@pytest.mark.parametrize("case", ["tp", "world", "2d"])
def test_torchs_dtensor_norm_agrees(ranks, case, p):
    res = _scenario(ranks, "placements")
    torch_norm = res[0]["torch", case, p]
    got = float(res[0]["gradlab", case, "torch.float32", p])
    reference = math_norm(res[0]["full", case, "torch.float32"], p)
    if p == 8.0 and torch_norm is not None:
        # torch takes n^8 directly; gradlab's scaled form is a rounding away
        assert float(torch_norm) == pytest.approx(got, rel=1e-5)
        return
    assert torch_norm is not None
    assert float(torch_norm) == pytest.approx(got, rel=2e-6)
    assert float(torch_norm) == pytest.approx(reference, rel=2e-6)


def test_dtensors_of_several_meshes_in_one_call(ranks):
    """torch's get_total_norm refuses (it stacks norms of two meshes); gradlab reduces
    each mesh's domain on its own (test_dtensor_norm_counts_every_entry_once[meshes])."""
    res = _scenario(ranks, "placements")
    assert all(res[0]["torch", "meshes", p] is None for p in (1.0, 2.0, 3.0, 8.0))
    assert all(res[0]["torch", "2d", p] is not None for p in (1.0, 2.0, 3.0))


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("case", list(pw.CASES))
def test_a_nonfinite_entry_on_one_rank_reaches_every_rank(ranks, case, value):
    res = _scenario(ranks, "placements")
    shard_slot, partial_slot = pw.BAD_SLOTS[case]
    for slot in (s for s in (shard_slot, partial_slot) if s is not None):
        for bad in range(dw.WORLD):
            # "tp" is two TP groups of 2 (two replicas of a TP model): a NaN reaches its
            # own group, and leaves the other alone.
            reach = [bad - bad % 2, bad - bad % 2 + 1] if case == "tp" else range(dw.WORLD)
            others = [r for r in range(dw.WORLD) if r not in reach]
            for p in pw.BAD_P:
                assert all(
                    math.isfinite(res[r]["bad", case, slot, bad, str(value), p]) for r in others
                )
                seen = [res[r]["bad", case, slot, bad, str(value), p] for r in reach]
                if math.isnan(value):
                    assert all(math.isnan(n) for n in seen), (slot, bad, p, seen)
                else:
                    assert all(n == math.inf for n in seen), (slot, bad, p, seen)


@pytest.mark.parametrize("case", list(pw.CASES))
def test_clip_and_ignore_by_the_global_norm(ranks, case):
    res = _scenario(ranks, "placements")
    # the gradients clipped keep their placements, Partial addends included
    assert res[0]["clip_placements", case] == res[0]["placements", case]
    full = res[0]["full", case, "torch.float32"]
    ref = math_norm(full, 2.0)
    coef = min(1.0, 0.5 * ref / (ref + 1e-6))
    norms = [r["clip", case][0] for r in res]
    assert _agreed(norms) == pytest.approx(ref, rel=2e-6)
    for got, want in zip(res[0]["clip", case][1], full, strict=True):
        torch.testing.assert_close(got.double(), want.double() * coef, rtol=3e-6, atol=1e-7)
    # 0.95 x the global norm: every rank zeroes; 1.05 x: every rank keeps.
    assert all(bool((g == 0).all()) for r in res for g in r["ignore_over", case])
    for r in res:
        for got, want in zip(r["ignore_under", case], full, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    # the largest entry, over all ranks, reaches the threshold: every rank zeroes
    peak = max(float(t.abs().max()) for t in full if t.numel())
    assert all(float(r["value", case][0]) == peak for r in res)
    assert all(bool((g == 0).all()) for r in res for g in r["value", case][1])


def test_dtensor_norms_make_no_host_read(ranks):
    res = _scenario(ranks, "placements")
    assert all(r["host_reads"] == [] for r in res)


# ------------------------------------------------------------ real TP, FSDP2 x TP


def _check_model_run(res, p):
    """gradlab's norm: the gathered gradient's, and the unsharded float64 model's."""
    got = _agreed([r["gradlab", p] for r in res])
    assert got == pytest.approx(math_norm(res[0]["gathered"], p), rel=2e-6)
    assert got == pytest.approx(math_norm(res[0]["reference"], p), rel=2e-5)
    torch_norm = res[0].get(("torch", p))
    if torch_norm is not None:
        assert float(torch_norm) == pytest.approx(got, rel=1e-5)


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("size", [2, dw.WORLD])
def test_tensor_parallel_model(ranks, size, p):
    res = [r[size] for r in _scenario(ranks, "tp")]
    placements = res[0]["placements"]
    # LayerNorm under SequenceParallel: Partial; Colwise: Shard(0); Rowwise: Shard(1)
    # and its bias Replicate.
    for text in ("Partial(sum)", "Shard(dim=0)", "Shard(dim=1)", "Replicate()"):
        assert any(text in s for s in placements), (text, placements)
    _check_model_run(res, p)


@pytest.mark.parametrize("size", [2, dw.WORLD])
def test_tensor_parallel_clip(ranks, size):
    res = [r[size] for r in _scenario(ranks, "tp")]
    ref = math_norm(res[0]["reference"], 2.0)
    _agreed([r["clip"] for r in res])
    coef = min(1.0, 0.5 * ref / (ref + 1e-6))
    for got, want in zip(res[0]["clipped"], res[0]["reference"], strict=True):
        torch.testing.assert_close(got.double(), want * coef, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("p", P_VALUES)
def test_fsdp_times_tp_2d_mesh(ranks, p):
    res = _scenario(ranks, "fsdp_tp")
    placements = res[0]["placements"]
    assert any(s.startswith("(_StridedShard(dim=0") for s in placements), placements
    assert any(s == "(Shard(dim=0), Replicate())" for s in placements), placements
    assert any(s == "(Shard(dim=0), Shard(dim=1))" for s in placements), placements
    _check_model_run(res, p)


def test_fsdp_times_tp_clip(ranks):
    res = _scenario(ranks, "fsdp_tp")
    ref = math_norm(res[0]["reference"], 2.0)
    _agreed([r["clip"] for r in res])
    coef = min(1.0, 0.5 * ref / (ref + 1e-6))
    for r in res:
        for got, want in zip(r["clipped"], r["reference"], strict=True):
            torch.testing.assert_close(got.double(), want * coef, rtol=2e-5, atol=1e-6)


# -------------------------------------------------------------------- pipeline


def _all_stages(res):
    """The full gradients of every stage, from one rank of each."""
    by_stage = {r["stage"]: r["full"] for r in res}
    assert sorted(by_stage) == [0, 1]
    return by_stage[0] + by_stage[1]


@pytest.mark.parametrize("p", P_VALUES)
def test_pipeline_stages_are_summed_over_the_pp_group(ranks, p):
    res = _scenario(ranks, "pp")
    whole = _all_stages(res)
    reference = math_norm(whole, p)
    for key in ("gradlab", "parts", "megatron"):
        got = _agreed([r[key, p] for r in res])
        assert got == pytest.approx(reference, rel=2e-6), key
    # the controls: a stage alone, and the replicated tensors counted on every TP rank
    for r in res:
        stage = [t for t in r["full"]]
        assert float(r["stage_only", p]) == pytest.approx(math_norm(stage, p), rel=2e-6)
        assert _differs(r["stage_only", p], reference) or p == math.inf
    if p != math.inf:
        assert _differs(res[0]["double", p], reference)


def test_groups_that_would_count_twice_are_refused(ranks):
    res = _scenario(ranks, "pp")
    for r in res:
        assert "a DTensor's mesh and process_group share the ranks" in r.get("refused", "")
        for got, want in zip(r["refused_untouched"], r["full"], strict=True):
            assert same_bits(got, want)
        assert "the groups of parts[0][1] share the ranks" in r.get("refused_parts", "")


def test_a_guard_over_the_pipeline_group_sums_the_stages(ranks):
    """StepGuard(grads="sharded", process_group=pp) with DTensor stages: the meshes reduce
    over TP, the guard over PP; a group the meshes already cover adds nothing, and a world
    group that mixes both is refused (which ranks hold other stages cannot be told)."""
    for res in _scenario(ranks, "pp"):
        assert res["beyond_pp"] and res["beyond_tp"]
        assert "already reduce over" in res["beyond_world"]
        assert "pipeline group" in res["beyond_world"]
        assert res["guard_norm"] == float(res["gradlab", 2.0])


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_pipeline_nonfinite_on_one_stage_reaches_every_stage(ranks, value):
    res = _scenario(ranks, "pp")
    for p in pw.BAD_P:
        seen = [r["bad", str(value), p] for r in res]
        if math.isnan(value):
            assert all(math.isnan(n) for n in seen), (p, seen)
        else:
            assert all(n == math.inf for n in seen), (p, seen)


def test_pipeline_clip_and_ignore_decide_alike(ranks):
    res = _scenario(ranks, "pp")
    whole = _all_stages(res)
    ref = math_norm(whole, 2.0)
    coef = min(1.0, 0.5 * ref / (ref + 1e-6))
    assert _agreed([r["clip"] for r in res]) == pytest.approx(ref, rel=2e-6)
    for r in res:
        for got, want in zip(r["clipped"], r["full"], strict=True):
            torch.testing.assert_close(got.double(), want.double() * coef, rtol=3e-6, atol=1e-7)
    # the threshold lies between each stage's norm and the global one: all zero
    assert _agreed([r["ignore"] for r in res]) == pytest.approx(ref, rel=2e-6)
    for r in res:
        assert float(r["stage_only", 2.0]) < 0.5 * (float(r["stage_only", 2.0]) + ref)
        assert all(bool((g == 0).all()) for g in r["ignored"])


# ---------------------------------------------------------------------- experts


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("size", dw.SIZES)
def test_experts_reduced_over_the_ep_group_dense_counted_once(ranks, size, p):
    res = _scenario(ranks, "ep")
    reference = math_norm(pw.dense_grads() + pw.expert_grads(), p)
    assert _agreed([r["parts", size, p] for r in res]) == pytest.approx(reference, rel=2e-6)
    if p != math.inf:  # the control: dense grads counted on each EP rank
        assert _differs(res[0]["double", size, p], reference)


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("size", dw.SIZES)
def test_a_nonfinite_expert_on_one_rank_reaches_every_rank(ranks, size, value):
    res = _scenario(ranks, "ep")
    for bad in range(size):
        for p in pw.BAD_P:
            seen = [r["bad", size, bad, str(value), p] for r in res]
            if math.isnan(value):
                assert all(math.isnan(n) for n in seen), (bad, p, seen)
            else:
                assert all(n == math.inf for n in seen), (bad, p, seen)


@pytest.mark.parametrize("size", dw.SIZES)
def test_experts_clip_with_the_total_norm(ranks, size):
    res = _scenario(ranks, "ep")
    dense, experts = pw.dense_grads(), pw.expert_grads()
    ref = math_norm(dense + experts, 2.0)
    coef = min(1.0, 0.5 * ref / (ref + 1e-6))
    assert _agreed([r["clip", size][0] for r in res]) == pytest.approx(ref, rel=2e-6)
    for r in range(dw.WORLD):
        members = [list(range(dw.WORLD))] if size == dw.WORLD else [[0, 1], [2, 3]]
        index = next(m.index(r) for m in members if r in m)
        want = dense + pw.my_experts(experts, size, index)
        for got, w in zip(res[r]["clip", size][1], want, strict=True):
            torch.testing.assert_close(got.double(), w.double() * coef, rtol=3e-6, atol=1e-7)
    assert all(r["host_reads", size] == [] for r in res)


@pytest.mark.parametrize("p", P_VALUES)
def test_experts_on_their_own_mesh_torchtitan_style(ranks, p):
    res = _scenario(ranks, "ep")
    full = res[0]["meshes_full"]
    assert _agreed([r["meshes", p] for r in res]) == pytest.approx(math_norm(full, p), rel=2e-6)
    assert res[0]["meshes_torch"] is None  # torch cannot stack norms of two meshes


@pytest.mark.parametrize("p", P_VALUES)
def test_experts_times_pipeline(ranks, p):
    res = _scenario(ranks, "ep")
    whole = []
    for stage in (0, 1):
        whole += pw.dense_grads(stage) + pw.expert_grads(stage)
    reference = math_norm(whole, p)
    assert _agreed([r["ep_pp", p] for r in res]) == pytest.approx(reference, rel=2e-6)
    if p != math.inf:
        assert _differs(res[0]["ep_pp_double", p], reference)


# ------------------------------------------------- total_norm in one process (no spawn)


def _grads():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in ((3, 4), (5,), (0,), (2, 2, 2))]


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, 8.0, math.inf])
def test_total_norm_of_local_parts_is_torchs_norm(p):
    grads = _grads()
    got = gradlab.distributed.total_norm([(grads, None)], p)
    if p <= 4:  # torch's bits
        assert same_bits(got, torch.nn.utils.get_total_norm(grads, p))
    assert float(got) == pytest.approx(math_norm(grads, p), rel=2e-6)
    split = gradlab.distributed.total_norm([(grads[:2], None), (grads[2:], None)], p)
    assert float(split) == pytest.approx(math_norm(grads, p), rel=2e-6)


def test_total_norm_of_nothing_is_zero():
    assert same_bits(gradlab.distributed.total_norm([]), torch.tensor(0.0))
    assert same_bits(gradlab.distributed.total_norm([([], None)]), torch.tensor(0.0))


@pytest.mark.parametrize(
    ("parts", "match"),
    [
        (torch.ones(2), "parts must be a list"),
        (5, "parts must be a list"),
        ([torch.ones(2)], r"parts\[0\] must be a \(tensors, groups\) pair"),
        ([([torch.ones(2)], None, None)], r"parts\[0\] must be a \(tensors, groups\) pair"),
        ([([1.0], None)], r"parts\[0\]\[0\] must contain only tensors"),
        ([([torch.ones(2)], [None])], r"parts\[0\]\[1\]: a sequence of groups cannot hold None"),
    ],
)
def test_total_norm_refuses_malformed_parts(parts, match):
    with pytest.raises(ValueError, match=match):
        gradlab.distributed.total_norm(parts)


def test_total_norm_checks_groups_and_arguments():
    grads = _grads()
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        gradlab.distributed.total_norm([(grads, object())])
    with pytest.raises(ValueError, match="norm_type"):
        gradlab.distributed.total_norm([(grads, None)], 0.0)
    with pytest.raises(ValueError, match="foreach"):
        gradlab.distributed.total_norm([(grads, None)], foreach=1)
    bad = [g.clone() for g in grads]
    bad[0][0, 0] = math.nan
    with pytest.raises(RuntimeError, match="non-finite"):
        gradlab.distributed.total_norm([(bad, None)], error_if_nonfinite=True)
