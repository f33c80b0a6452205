"""StepGuard's API: names, counters, bounded records, policies, limits, errors, compile."""

from __future__ import annotations

import math
from collections import deque

import pytest
import torch
from torch import nn

from gradlab import StepGuard, StepRecord, ThresholdPolicy
from gradlab.sync import HostReadCounter


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]


def _loss(model, batch, scale=1.0):
    x, y = batch
    return nn.functional.mse_loss(model(x), y * scale)


def _norm(model) -> float:
    """The total 2-norm of the gradients, in float64 (the reference)."""
    return torch.cat([p.grad.double().flatten() for p in model.parameters()]).norm().item()


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _adamw_fused(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, fused=True)


# -------------------------------------------------------------------------- names


def test_ignore_is_refused_naming_skip():
    opt = _adamw(_model().parameters())
    with pytest.raises(ValueError, match=r'"ignore" was renamed "skip"'):
        StepGuard(opt, mode="ignore")
    assert StepGuard(opt).mode == "skip"  # the default


# --------------------------------------------------------------- counters, records


@pytest.mark.parametrize("make", [_adamw, _adamw_fused], ids=["snapshot", "fused"])
@pytest.mark.parametrize("sync", [True, False])
def test_counters_last_history_and_callback(sync, make):
    model = _model()
    seen = []
    guard = StepGuard(
        make(model.parameters()),
        "clip",
        threshold=2.0,
        sync=sync,
        skip_above=50.0,
        history=2,
        on_record=seen.append,
    )
    scales = [1.0, 10.0, 1e4, 1.0, 1.0]  # kept, clipped, skipped, kept, kept
    norms = []
    for batch, scale in zip(_batches(5), scales, strict=True):
        _loss(model, batch, scale).backward()
        norms.append(_norm(model))
        guard.step()
        guard.optimizer.zero_grad()
    assert [n > 2.0 for n in norms] == [False, True, True, False, False]  # the premise
    assert (guard.taken, guard.clipped, guard.skipped, guard.num_steps) == (4, 1, 1, 5)
    assert len(guard.history) == 2 and guard.history[-1] is guard.last is seen[-1]
    assert [r.decision for r in seen] == ["kept", "clipped", "skipped", "kept", "kept"]
    assert [r.step for r in guard.history] == [3, 4]
    assert seen[1].total_norm == pytest.approx(norms[1], rel=1e-5)


def test_history_is_off_by_default_and_says_how_to_turn_it_on():
    guard = StepGuard(_adamw(_model().parameters()))
    with pytest.raises(RuntimeError, match="history=N"):
        _ = guard.history


def test_reading_counters_with_sync_false_is_a_host_read_and_step_is_not():
    model = _model()
    guard = StepGuard(_adamw_fused(model.parameters()), threshold=50.0, sync=False)
    for batch in _batches(3):
        _loss(model, batch).backward()
        guard.step()
        guard.optimizer.zero_grad()
    _loss(model, _batches(1, seed=3)[0], 1e4).backward()
    with HostReadCounter() as step_reads:
        guard.step()
    with HostReadCounter() as counter_reads:
        assert guard.skipped == 1
    assert step_reads.count == 0 and counter_reads.count == 1


def test_state_is_bounded():
    """O(1) state: no per-step growth however long the run (default: no history)."""
    model = _model()
    guard = StepGuard(_adamw_fused(model.parameters()), threshold=50.0, sync=False)
    x, y = _batches(1)[0]
    for _ in range(30):
        nn.functional.mse_loss(model(x), y).backward()
        guard.step()
        guard.optimizer.zero_grad()
    sizes = {k: len(v) for k, v in vars(guard).items() if isinstance(v, list | dict | deque)}
    assert all(n <= 5 for n in sizes.values()), sizes


# ------------------------------------------------------------- clip and skip worst


@pytest.mark.parametrize("sync", [True, False])
def test_clip_and_skip_above(sync):
    """Clip at threshold, skip above skip_above: against torch.nn.utils and a reference."""
    batches = _batches(4)
    scales = [10.0, 1e4, 1.0, 10.0]
    ref_model = _model()
    ref_opt = _adamw(ref_model.parameters())
    for batch, scale in zip(batches, scales, strict=True):
        if scale == 1e4:
            continue  # the reference never sees the batch that is skipped
        _loss(ref_model, batch, scale).backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
    model = _model()
    opt = _adamw(model.parameters())
    guard = StepGuard(opt, "clip", threshold=1.0, skip_above=100.0, sync=sync, history=4)
    for batch, scale in zip(batches, scales, strict=True):
        _loss(model, batch, scale).backward()
        guard.step()
        guard.optimizer.zero_grad()
    assert [r.decision for r in guard.history] == ["clipped", "skipped", "clipped", "clipped"]
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="skip_above"):
        StepGuard(opt, "skip", skip_above=10.0)


# ----------------------------------------------------------------------- policies


class _HalvingPolicy:
    """A fake policy: threshold = 2 x the last accepted statistic (first: ``start``)."""

    def __init__(self, start: float):
        self.level = torch.tensor(start)
        self.calls: list[tuple[float, bool]] = []

    def threshold(self, stat):
        return self.level * 1.0

    def update(self, stat, accepted):
        self.calls.append((float(stat), bool(accepted)))
        self.level = torch.where(accepted, 2 * stat.float(), self.level)

    def state_dict(self):
        return {"level": self.level.clone()}

    def load_state_dict(self, state):
        self.level = state["level"].clone()


@pytest.mark.parametrize("sync", [True, False])
def test_threshold_policy_decides_and_is_updated(sync):
    model = _model()
    policy = _HalvingPolicy(100.0)
    assert isinstance(policy, ThresholdPolicy)
    guard = StepGuard(_adamw(model.parameters()), threshold=policy, sync=sync, history=4)
    expected, level = [], 100.0
    for i, batch in enumerate(_batches(4)):
        _loss(model, batch, 3.0 if i == 2 else 1.0).backward()
        norm = _norm(model)
        keep = 1 - (level / (norm + 1e-6)) < 0 or level / (norm + 1e-6) >= 1
        expected.append("kept" if keep else "skipped")
        level = 2 * norm if keep else level
        guard.step()
        guard.optimizer.zero_grad()
    assert [r.decision for r in guard.history] == expected
    assert "skipped" in expected and expected[0] == "kept"
    assert [a for _, a in policy.calls] == [d == "kept" for d in expected]
    saved = guard.state_dict()
    other = StepGuard(_adamw(model.parameters()), threshold=_HalvingPolicy(1.0))
    other.load_state_dict(saved)
    assert other.threshold.level == policy.level
    with pytest.raises(ValueError, match=r"threshold: .*policy"):
        StepGuard(_adamw(model.parameters())).load_state_dict(saved)


@pytest.mark.parametrize("sync", [True, False])
def test_loss_threshold(sync):
    model = _model()
    policy = _HalvingPolicy(1e9)
    guard = StepGuard(
        _adamw(model.parameters()), threshold=50.0, loss_threshold=5.0, sync=sync, history=3
    )
    by_policy = StepGuard(
        _adamw(_model().parameters()), threshold=math.inf, loss_threshold=policy, sync=sync
    )
    losses = []
    for batch, scale in zip(_batches(3), [1.0, 4.0, 1.0], strict=True):
        loss = _loss(model, batch, scale)
        losses.append(loss.item())
        loss.backward()
        guard.step(loss=loss)
        guard.optimizer.zero_grad()
    assert [r.decision for r in guard.history] == [
        "kept" if v <= 5.0 else "skipped" for v in losses
    ]
    assert guard.skipped == 1
    with pytest.raises(ValueError, match=r"step\(loss=loss\)"):
        _loss(model, _batches(1)[0]).backward()
        guard.step()
    by_policy.optimizer.zero_grad()
    m = by_policy.optimizer.param_groups[0]["params"]
    (sum(p.sum() for p in m) ** 2).backward()
    by_policy.step(loss=torch.tensor(3.0))
    assert policy.calls == [(3.0, True)]


# --------------------------------------------------------------- closures, sparse


def test_sparse_is_refused_with_a_clear_message():
    emb = nn.Embedding(10, 3, sparse=True)
    with pytest.raises(ValueError, match="SparseAdam"):
        StepGuard(torch.optim.SparseAdam(emb.parameters()))
    guard = StepGuard(torch.optim.SGD(emb.parameters(), lr=0.1))
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse gradients"):
        guard.step()


# ------------------------------------------------------------------- clear errors


def test_clear_errors():
    model = _model()
    opt = _adamw(model.parameters())
    with pytest.raises(ValueError, match=r"threshold.*too large"):
        StepGuard(opt, threshold=10**400)
    with pytest.raises(ValueError, match="not a StepGuard state dict"):
        StepGuard(opt).load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="not a StepGuard state dict"):
        StepGuard(opt).load_state_dict({"history": []})
    saved = StepGuard(opt).state_dict() | {"num_steps": 3}
    with pytest.raises(ValueError, match=r"counts \[0, 0, 0\] .* add up to num_steps=3"):
        StepGuard(opt).load_state_dict(saved)

    class _Sched:
        def step(self):
            pass

    with pytest.raises(ValueError, match=r"its \.optimizer is another optimizer, or missing"):
        StepGuard(opt, scheduler=_Sched())
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_consecutive_skips"):
            StepGuard(opt, max_consecutive_skips=bad)
        with pytest.raises(ValueError, match="history"):
            StepGuard(opt, history=bad)
    with pytest.raises(ValueError, match="scaler"):
        StepGuard(opt, scaler=object())
    with pytest.raises(ValueError, match="loss_threshold"):
        StepGuard(opt, "none", loss_threshold=1.0)


class _Failing(torch.optim.SGD):
    def step(self, closure=None):
        super().step(closure)
        raise RuntimeError("boom")


@pytest.mark.parametrize("sync", [True, False])
def test_a_failing_optimizer_step_is_not_counted(sync):
    model = _model()
    opt = _Failing(model.parameters(), lr=0.1, momentum=0.9)
    guard = StepGuard(opt, threshold=1e9, sync=sync, history=3)
    _loss(model, _batches(1)[0]).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="boom"):
        guard.step()
    assert guard.num_steps == 0 and guard.history == [] and guard.last is None
    assert guard.taken == 0
    if not sync:  # the transaction rolled the partial step back
        assert all(map(torch.equal, before, model.parameters()))
        assert len(guard.optimizer.state) == 0


def test_step_record_output_and_tuple_behaviour():
    record = StepRecord(2, 1.5, "kept", output=0.25)
    assert tuple(record) == (2, 1.5, "kept") and record.output == 0.25


# ------------------------------------------------------------------------ compile


class _Backend:
    """An eager (or inductor) backend that counts the graphs it compiles."""

    def __init__(self, inductor: bool):
        self.inductor = inductor
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        if self.inductor:
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        return gm.forward


@pytest.mark.parametrize("mode", ["skip", "clip"])
@pytest.mark.parametrize("inductor", [False, True], ids=["eager", "inductor"])
def test_decision_compiles_with_fullgraph_and_no_recompile_per_threshold(inductor, mode):
    model = _model()
    _loss(model, _batches(1)[0]).backward()
    norm = _norm(model)
    guard = StepGuard(_adamw(model.parameters()), mode, threshold=norm * 2)
    grads = [p.grad.clone() for p in model.parameters()]
    backend = _Backend(inductor)
    torch._dynamo.reset()
    decide = torch.compile(guard._decide, fullgraph=True, backend=backend)
    decisions = []
    for factor in (2.0, 0.5, 3.0, 0.7):
        guard.threshold = norm * factor
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
        stat, keep, clipped, _ = decide(list(model.parameters()), None, None)
        assert stat.item() == pytest.approx(norm, rel=1e-5)
        decisions.append(StepRecord(0, stat, keep, clipped).decision)
    over = "skipped" if mode == "skip" else "clipped"
    assert decisions == ["kept", over, "kept", over]
    # torch's automatic dynamic: the first new value recompiles with the threshold as a
    # symbol, and no later value recompiles.
    assert backend.graphs == 2
    torch._dynamo.reset()


def test_compiled_step_keeps_the_fused_skip():
    """The fused flag is written in place, so a skip survives torch.compile of guard.step."""
    batches = _batches(3)
    stream = [batches[0], (batches[1][0], batches[1][1] * 1e4), batches[2]]
    ref_model = _model()
    ref_opt = _adamw_fused(ref_model.parameters())
    for batch in (batches[0], batches[2]):
        _loss(ref_model, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model = _model()
    opt = _adamw_fused(model.parameters())
    guard = StepGuard(opt, threshold=50.0, sync=False, history=3)
    torch._dynamo.reset()
    step = torch.compile(guard.step, backend="eager")
    for batch in stream:
        _loss(model, batch).backward()
        step()
        opt.zero_grad()
    torch._dynamo.reset()
    assert [r.decision for r in guard.history] == ["kept", "skipped", "kept"]
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
    sa, sb = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    for k in sa:
        for name in sa[k]:
            assert torch.equal(sa[k][name], sb[k][name])
    assert not hasattr(opt, "found_inf")  # set for the call only: a later step is not skipped


def test_a_failing_skipped_step_is_not_counted_either():
    """sync=False steps a skipped step too (and restores it): if that step raises, the
    device counters stay as they were, and so does the skip flag."""
    model = _model()
    guard = StepGuard(_Failing(model.parameters(), lr=0.1), threshold=0.0, sync=False)
    _loss(model, _batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="boom"):
        guard.step()
    assert (guard.num_steps, guard.skipped, guard.taken) == (0, 0, 0)
    assert guard.state_dict()["consecutive_skips"] == 0
    assert not hasattr(guard.optimizer, "found_inf")
