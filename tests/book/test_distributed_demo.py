"""The chapter's two-process demo (gradlab_book.distributed_demo), run once per module.

Its numbers are checked against independent computations in this process: float64
norms of the whole seeded gradient and of its halves, the unsharded model's float64
gradient, a single-process replay of the DDP runs, and the rules of a MAX and a SUM.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from gradlab_book import distributed_demo as dd  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """Run the demo as the chapter does (a subprocess, one spawn): (stdout, summary, ranks)."""
    out = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "gradlab_book.distributed_demo", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads((out / "demo.json").read_text())
    return done.stdout, data["summary"], data["ranks"]


def _norm64(tensors, p):
    return float(torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in tensors]), p))


def test_report_has_every_section_and_nothing_variable(demo):
    stdout, summary, _ = demo
    for n in range(1, 7):
        assert f"== {n}." in stdout
    assert dd.report(summary) == stdout.rstrip("\n")
    for word in ("port", "pid", "127.0.0.1", "localhost", " at 0x", "seconds", "tcp://"):
        assert word not in stdout.lower()


@pytest.mark.parametrize("key, p", [("1", 1.0), ("2", 2.0), ("inf", math.inf)])
def test_primitives_local_and_global_norms(demo, key, p):
    _, s, _ = demo
    full = dd.full_gradient()
    local = s["primitives"]["local"][key]
    for r in range(dd.WORLD):
        assert local[r] == pytest.approx(_norm64(dd.shard(full, r), p), rel=1e-6)
    glob = s["primitives"]["global"][key]
    assert glob[0] == glob[1]  # the same bits on both ranks
    assert glob[0] == pytest.approx(_norm64(full, p), rel=1e-6)
    if p != math.inf:
        assert max(local) < glob[0] * (1 - 1e-3)  # the halves are real halves


def test_primitives_decisions(demo):
    _, s, _ = demo
    full = dd.full_gradient()
    rank_norms = [_norm64(dd.shard(full, r), 2.0) for r in range(dd.WORLD)]
    total = _norm64(full, 2.0)
    for d in s["primitives"]["decisions"].values():
        tau = d["tau"]
        alone = [tau / (n + 1e-6) >= 1 for n in rank_norms]
        assert d["alone"] == alone
        assert d["agreed"] == [all(alone)] * dd.WORLD
        assert d["by_global_norm"] == [tau / (total + 1e-6) >= 1] * dd.WORLD
    between = s["primitives"]["decisions"]["between"]
    assert len(set(between["alone"])) == 2  # the ranks disagree alone
    above = s["primitives"]["decisions"]["above_both"]
    assert above["agreed"] == [True, True] and above["by_global_norm"] == [False, False]


def test_nan_through_max(demo):
    _, s, ranks = demo
    nan = s["nan_max"]
    for bad in ("0", "1"):
        assert math.isnan(nan[bad]["sum"])
        assert math.isnan(nan[bad]["max_with_flag"])
        assert math.isnan(nan[bad]["gradlab_inf"])
    # as measured on gloo: a NaN on rank 0 survives MAX, on rank 1 it is lost
    assert math.isnan(nan["0"]["max"])
    assert nan["1"]["max"] == 1.0
    assert s["nan_max_ranks_agree"]
    assert all(math.isnan(r["nan_max"]["1"]["gradlab_inf"]) for r in ranks)


def _ddp_replay(rule: str, world: int = dd.WORLD) -> tuple[list[list[float]], list[list[bool]]]:
    """One process, float64, no DDP: each rank's model, with the averaged gradient."""
    models = [dd.make_mlp(0).double() for _ in range(world)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    skipped: list[list[bool]] = [[] for _ in range(world)]
    for step in range(dd.STEPS):
        losses, grads = [], []
        for r, m in enumerate(models):
            x, y = dd.batch(r, step)
            m.zero_grad()
            loss = nn.functional.mse_loss(m(x.double()), y.double())
            loss.backward()
            losses.append(float(loss.detach()))
            grads.append([p.grad.clone() for p in m.parameters()])
        mean = [sum(gs) / world for gs in zip(*grads, strict=True)]
        keeps = [math.isfinite(v) and v < dd.LOSS_MAX for v in losses]
        if rule == "reduced":
            keeps = [all(keeps)] * world
        for r, (m, opt) in enumerate(zip(models, opts, strict=True)):
            for p, g in zip(m.parameters(), mean, strict=True):
                p.grad = g.clone()
            if keeps[r]:
                opt.step()
            skipped[r].append(not keeps[r])
    params = [[float(v) for p in m.parameters() for v in p.detach().reshape(-1)] for m in models]
    return params, skipped


@pytest.mark.parametrize("rule", ["local", "reduced"])
def test_ddp_runs_against_a_float64_replay(demo, rule):
    _, s, ranks = demo
    d = s["ddp"][rule]
    params, skipped = _ddp_replay(rule)
    assert d["skipped"] == skipped
    for r in range(dd.WORLD):
        got = ranks[r]["ddp"][rule]["params"]
        assert max(abs(a - b) for a, b in zip(got, params[r], strict=True)) < 1e-4
    replay_diff = max(abs(a - b) for a, b in zip(params[0], params[1], strict=True))
    if rule == "local":
        assert not d["bitwise_identical"]
        assert d["max_param_diff"] == pytest.approx(replay_diff, rel=1e-3)
        assert d["max_param_diff"] > 0.1
        assert d["skipped"][0][dd.SPIKE_STEP] is False and d["skipped"][1][dd.SPIKE_STEP]
    else:
        assert d["bitwise_identical"] and d["max_param_diff"] == 0.0 and replay_diff == 0.0
        assert all(sk[dd.SPIKE_STEP] for sk in d["skipped"])
    assert d["norms_identical"]


def _fsdp_reference() -> torch.Tensor:
    model = dd.make_mlp(1, dd.FSDP_HIDDEN, dd.FSDP_OUT).double()
    losses = []
    for r in range(dd.WORLD):
        x, y = dd.fsdp_batch(r)
        losses.append(nn.functional.mse_loss(model(x.double()), y.double()))
    (sum(losses) / dd.WORLD).backward()
    return model


@pytest.mark.parametrize("key, p", [("2", 2.0), ("inf", math.inf)])
def test_fsdp_shard_norms_and_the_global_norm(demo, key, p):
    _, s, _ = demo
    model = _fsdp_reference()
    f = s["fsdp"]
    assert f["placements"] == ["(Shard(dim=0),)"]
    assert f["numel"] == sum(q.numel() for q in model.parameters())
    # FSDP2 shards every parameter by rows (torch.chunk along dim 0)
    shards = [
        [torch.chunk(q.grad, dd.WORLD, dim=0)[r] for q in model.parameters()]
        for r in range(dd.WORLD)
    ]
    assert f["shard_numel"] == [sum(t.numel() for t in sh) for sh in shards]
    d = f[key]
    for r in range(dd.WORLD):
        assert d["local"][r] == pytest.approx(_norm64(shards[r], p), rel=1e-5)
    whole = _norm64([q.grad for q in model.parameters()], p)
    assert d["reference"] == pytest.approx(whole, rel=1e-12)
    for r in range(dd.WORLD):
        assert d["gradlab"][r] == pytest.approx(whole, rel=1e-5)
        assert d["torch"][r] == pytest.approx(whole, rel=1e-5)
    assert d["gradlab"][0] == d["gradlab"][1]
    if p == 2.0:
        assert max(d["local"]) < whole * 0.9
        assert math.isnan(d["nan_torch"][0]) and math.isnan(d["nan_gradlab"][1])
    else:
        # torch's inf-norm of DTensors reduces by a plain MAX: the NaN is lost
        assert all(math.isfinite(v) for v in d["nan_torch"])
        assert all(math.isnan(v) for v in d["nan_gradlab"])


def test_guard_section(demo):
    _, s, _ = demo
    local, group = s["guard"]["local"], s["guard"]["group"]
    assert [d[dd.SPIKE_STEP] for d in local["decisions"]] == ["kept", "skipped"]
    assert not local["bitwise_identical"] and local["max_param_diff"] > 0.1
    assert [d[dd.SPIKE_STEP] for d in group["decisions"]] == ["skipped", "skipped"]
    assert group["decisions"][0] == group["decisions"][1]
    assert group["bitwise_identical"] and group["max_param_diff"] == 0.0
    # the guard's local run is the local-rule run of section 3
    assert local["max_param_diff"] == s["ddp"]["local"]["max_param_diff"]


def _flat64(tensors):
    return torch.cat([t.double().reshape(-1) for t in tensors])


@pytest.mark.parametrize("bad", ["0", "1"])
def test_nccl_row_is_ieee_maxnum(demo, bad):
    # NCCL reduces float MAX with fmaxf (IEEE 754 maxNum): a NaN operand loses to the
    # other one, whichever rank holds it; numpy's fmax has the same rule
    np = pytest.importorskip("numpy")
    _, s, _ = demo
    values = [math.nan if r == int(bad) else 1.0 for r in range(dd.WORLD)]
    want = float(np.fmax.reduce(np.array(values, dtype=np.float32)))
    assert want == 1.0
    assert s["nan_max_nccl"][bad] == want
    assert dd.nccl_max([math.nan, math.nan]) != dd.nccl_max([math.nan, math.nan])  # both NaN
    assert dd.nccl_max([2.0, math.nan, 3.0]) == 3.0


def test_parallel_section_counts_each_entry_once(demo):
    stdout, s, _ = demo
    full = dd.parallel_model()
    par = s["parallel"]
    world = dd.WORLD
    tp_whole = _flat64(full["tp_sharded"] + full["tp_copies"])
    copies = _flat64(full["tp_copies"])
    want = {
        "tp": float(tp_whole.norm()),
        "pp": float(_flat64(full["stage0"] + full["stage1"]).norm()),
        "ep": float(_flat64(full["dense"] + full["experts"]).norm()),
    }
    for layout, ref in want.items():
        assert par[layout]["reference"] == [pytest.approx(ref, rel=1e-12)] * world
        assert par[layout]["total_norm"][0] == par[layout]["total_norm"][1]
        assert par[layout]["total_norm"][0] == pytest.approx(ref, rel=1e-6)
    # the mistakes: the TP copies counted on both ranks, the EP dense part twice
    twice = math.sqrt(float(tp_whole.square().sum() + copies.square().sum()))
    assert par["tp"]["copies_twice"] == [pytest.approx(twice, rel=1e-6)] * world
    assert par["tp"]["megatron"] == [pytest.approx(want["tp"], rel=1e-6)] * world
    dense = _flat64(full["dense"])
    ep_twice = math.sqrt(want["ep"] ** 2 + float(dense.square().sum()))
    assert par["ep"]["dense_twice"] == [pytest.approx(ep_twice, rel=1e-6)] * world
    # alone, each rank sees only its part: every local norm is below the whole
    for layout in ("pp", "ep"):
        assert max(par[layout]["alone"]) < want[layout]
    # stage r alone is exactly stage r's layers
    for r in range(world):
        stage = float(_flat64(full[f"stage{r}"]).norm())
        assert par["pp"]["alone"][r] == pytest.approx(stage, rel=1e-6)
    # a NaN in rank 1's expert: NaN on both ranks through the inf-norm
    assert all(math.isnan(v) for v in par["ep"]["nan_inf_norm"])
    assert "WRONG" not in stdout
