"""StepGuard: a skipped step must be bit-for-bit the same as never seeing the batch."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from gradlab import DECISIONS, StepGuard, StepRecord, grad_ignore_norm_
from gradlab.sync import HostReadCounter, no_host_reads

# ------------------------------------------------------------------------ fixtures


def _sgd(params, foreach=None):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.1, foreach=foreach)


def _sgd_nesterov(params, foreach=None):
    return torch.optim.SGD(
        params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=foreach
    )


def _adam(params, foreach=None):
    return torch.optim.Adam(params, lr=0.01, weight_decay=0.01, foreach=foreach)


def _adam_amsgrad(params, foreach=None):
    return torch.optim.Adam(params, lr=0.01, amsgrad=True, foreach=foreach)


def _adamw(params, foreach=None):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, foreach=foreach)


def _adam_fused(params, foreach=None):
    return torch.optim.Adam(params, lr=0.01, fused=True)


def _adamw_fused(params, foreach=None):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, fused=True)


OPTIMIZERS = {
    "sgd-momentum-wd": _sgd,
    "sgd-nesterov": _sgd_nesterov,
    "adam": _adam,
    "adam-amsgrad": _adam_amsgrad,
    "adamw": _adamw,
    "adam-fused": _adam_fused,
    "adamw-fused": _adamw_fused,
}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]


def _corrupt(batch, kind: str):
    x, y = batch
    if kind == "big":
        return x, y * 1e4
    if kind == "nan":
        x = x.clone()
        x[0, 0] = math.nan
        return x, y
    if kind == "inf":
        y = y.clone()
        y[1, 1] = math.inf
        return x, y
    raise AssertionError(kind)


def _backward(model, batch) -> None:
    x, y = batch
    nn.functional.mse_loss(model(x), y).backward()


def _train(make_opt, batches, guard_kwargs=None, foreach=None, scheduler_fn=None):
    """Train on ``batches``; guard_kwargs=None trains with a bare optimizer.

    Returns (model, optimizer, guard or None, learning rates used at each step).
    """
    model = _model()
    opt = make_opt(model.parameters(), foreach=foreach)
    sched = scheduler_fn(opt) if scheduler_fn else None
    guard = None
    if guard_kwargs is not None:
        guard = StepGuard(opt, scheduler=sched, **{"history": len(batches), **guard_kwargs})
    lrs = []
    for batch in batches:
        lrs.append(opt.param_groups[0]["lr"])
        _backward(model, batch)
        if guard is None:
            opt.step()
            if sched is not None:
                sched.step()
        else:
            guard.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, guard, lrs


def _assert_identical(model_a, opt_a, model_b, opt_b) -> None:
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b), "parameters differ"
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for name in sa[k]:
            va, vb = sa[k][name], sb[k][name]
            if isinstance(va, torch.Tensor):
                assert va.dtype == vb.dtype and va.device == vb.device
                assert torch.equal(va, vb), f"state {name!r} of parameter {k} differs"
            else:
                assert va == vb


# ------------------------------------------------------------- the exact skip itself


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("bad_at", [0, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_skip_equals_never_seeing_the_batch(name, bad_at, sync):
    batches = _batches(6)
    bad = [*batches[:bad_at], _corrupt(batches[bad_at], "big"), *batches[bad_at + 1 :]]
    reference = [b for i, b in enumerate(batches) if i != bad_at]
    make = OPTIMIZERS[name]
    ref_model, ref_opt, _, _ = _train(make, reference)
    model, opt, guard, _ = _train(make, bad, dict(mode="skip", threshold=20.0, sync=sync))
    assert [r.decision for r in guard.history] == [
        "skipped" if i == bad_at else "kept" for i in range(6)
    ]
    _assert_identical(model, opt, ref_model, ref_opt)


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("name", ["sgd-momentum-wd", "adam", "adamw"])
@pytest.mark.parametrize("sync", [True, False])
def test_skip_is_exact_for_foreach_and_single_tensor_paths(name, foreach, sync):
    batches = _batches(5)
    bad = [batches[0], _corrupt(batches[1], "big"), *batches[2:]]
    make = OPTIMIZERS[name]
    ref = _train(make, [batches[0], *batches[2:]], foreach=foreach)
    got = _train(make, bad, dict(mode="skip", threshold=20.0, sync=sync), foreach=foreach)
    _assert_identical(got[0], got[1], ref[0], ref[1])


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("mode", ["clip", "skip"])
@pytest.mark.parametrize("by", ["norm", "value"])
@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("name", ["sgd-momentum-wd", "adam", "adamw-fused"])
def test_nonfinite_gradients_are_always_skipped_and_never_leak(name, sync, by, mode, kind):
    batches = _batches(4)
    bad = [batches[0], _corrupt(batches[1], kind), *batches[2:]]
    make = OPTIMIZERS[name]
    # A huge threshold: only the non-finite batch can trigger anything.
    ref = _train(make, [batches[0], *batches[2:]])
    got = _train(make, bad, dict(mode=mode, by=by, threshold=1e30, sync=sync))
    assert [r.decision for r in got[2].history] == ["kept", "skipped", "kept", "kept"]
    assert not math.isfinite(got[2].history[1].total_norm)
    _assert_identical(got[0], got[1], ref[0], ref[1])
    for p in got[0].parameters():
        assert torch.isfinite(p).all()


def test_zeroing_the_gradients_is_not_skipping():
    """The motivation: grad_ignore_norm_ + step still moves every optimizer here."""
    batches = _batches(4)
    bad = [batches[0], _corrupt(batches[1], "big"), *batches[2:]]
    for name in ["sgd-momentum-wd", "adam", "adamw"]:
        make = OPTIMIZERS[name]
        ref_model, ref_opt, _, _ = _train(make, [batches[0], *batches[2:]])
        model = _model()
        opt = make(model.parameters())
        for batch in bad:
            _backward(model, batch)
            grad_ignore_norm_(model.parameters(), 20.0)
            opt.step()
            opt.zero_grad()
        moved = max(
            (a - b).abs().max().item()
            for a, b in zip(model.parameters(), ref_model.parameters(), strict=True)
        )
        assert moved > 1e-4, name
        step = opt.state_dict()["state"][0].get("step")
        if step is not None:  # Adam's step count advanced on the zeroed batch
            assert step.item() == ref_opt.state_dict()["state"][0]["step"].item() + 1


@pytest.mark.parametrize("sync", [True, False])
def test_skipped_first_step_leaves_no_state(sync):
    model = _model()
    opt = _adam(model.parameters())
    guard = StepGuard(opt, threshold=1e-3, sync=sync)
    _backward(model, _batches(1)[0])
    before = [p.detach().clone() for p in model.parameters()]
    assert guard.step().skipped
    assert len(opt.state) == 0
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)


@pytest.mark.parametrize("fused", [False, True])
def test_skipped_first_step_leaves_no_state_when_it_was_looked_up(fused):
    """``opt.state[p]`` read before any step makes an empty entry (a defaultdict)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused or None)
    guard = StepGuard(opt, threshold=1e-3, sync=False)
    assert all(opt.state[p] == {} for p in model.parameters())
    _backward(model, _batches(1)[0])
    with HostReadCounter() as reads:
        assert guard.step().skipped
    assert reads.count >= 1  # the one read of a step that creates state
    assert not any(opt.state.get(p) for p in model.parameters())


def test_frozen_parameters_and_several_groups():
    torch.manual_seed(0)
    a, b, frozen = nn.Linear(3, 3), nn.Linear(3, 1), nn.Linear(3, 3)

    def make():
        opt = torch.optim.AdamW(
            [
                {"params": a.parameters(), "lr": 0.01},
                {"params": [*b.parameters(), *frozen.parameters()], "lr": 0.1},
            ],
            weight_decay=0.1,
        )
        return opt

    snapshot = [p.detach().clone() for p in (*a.parameters(), *b.parameters())]
    opt = make()
    guard = StepGuard(opt, threshold=50.0, sync=False)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    b(a(x)).mean().backward()
    assert guard.step().decision == "kept"  # creates the state
    opt.zero_grad()
    after_one = [p.detach().clone() for p in (*a.parameters(), *b.parameters())]
    state_one = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state.items()}
    (1e4 * b(a(x)).mean()).backward()
    assert guard.step().skipped
    for p, q in zip((*a.parameters(), *b.parameters()), after_one, strict=True):
        assert torch.equal(p, q)
    for k, s in opt.state.items():
        for n, v in s.items():
            assert torch.equal(v, state_one[k][n])
    assert not any(torch.equal(p, q) for p, q in zip(after_one, snapshot, strict=True))
    assert all(p not in opt.state for p in frozen.parameters())


class _CountingSGD(torch.optim.Optimizer):
    """A hand-written optimizer with Python-number state (an int step count)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["n"] = state.get("n", 0) + 1
                p.add_(p.grad, alpha=-group["lr"] / state["n"])


@pytest.mark.parametrize("sync", [True, False])
def test_python_number_state_is_restored(sync):
    def make(params, foreach=None):
        return _CountingSGD(params)

    batches = _batches(5)
    bad = [batches[0], batches[1], _corrupt(batches[2], "nan"), *batches[3:]]
    ref = _train(make, [*batches[:2], *batches[3:]])
    got = _train(make, bad, dict(threshold=1e30, sync=sync))
    _assert_identical(got[0], got[1], ref[0], ref[1])
    assert got[1].state[next(got[0].parameters())]["n"] == 4


# -------------------------------------------------------------------------- modes


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("sync", [True, False])
def test_clip_mode_steps_with_torch_clipped_gradients(sync):
    batch = _corrupt(_batches(1)[0], "big")
    ref_model = _model()
    ref_opt = _sgd(ref_model.parameters())
    _backward(ref_model, batch)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
    ref_opt.step()

    model = _model()
    opt = _sgd(model.parameters())
    guard = StepGuard(opt, mode="clip", threshold=1.0, sync=sync)
    _backward(model, batch)
    record = guard.step()
    assert record.decision == "clipped"
    assert record.total_norm == pytest.approx(ref_norm.item(), rel=1e-6)
    _assert_identical(model, opt, ref_model, ref_opt)


@pytest.mark.parametrize("sync", [True, False])
def test_clip_by_value_matches_torch(sync):
    batch = _batches(1)[0]
    ref_model = _model()
    ref_opt = _adam(ref_model.parameters())
    _backward(ref_model, batch)
    largest = max(p.grad.abs().max().item() for p in ref_model.parameters())
    torch.nn.utils.clip_grad_value_(ref_model.parameters(), largest / 2)
    ref_opt.step()

    model = _model()
    opt = _adam(model.parameters())
    guard = StepGuard(opt, mode="clip", by="value", threshold=largest / 2, sync=sync)
    _backward(model, batch)
    record = guard.step()
    assert record.decision == "clipped"
    assert record.total_norm == pytest.approx(largest)
    _assert_identical(model, opt, ref_model, ref_opt)


@pytest.mark.parametrize("sync", [True, False])
def test_clip_mode_keeps_small_gradients_untouched(sync):
    batch = _batches(1)[0]
    ref = _train(_adamw, [batch])
    got = _train(_adamw, [batch], dict(mode="clip", threshold=1e6, sync=sync))
    assert got[2].history[0].decision == "kept"
    _assert_identical(got[0], got[1], ref[0], ref[1])


@pytest.mark.parametrize("sync", [True, False])
def test_mode_none_records_and_always_steps(sync):
    batches = _batches(3)
    big = [batches[0], _corrupt(batches[1], "big"), batches[2]]
    ref = _train(_adam, big)
    got = _train(_adam, big, dict(mode="none", threshold=1.0, sync=sync))
    assert [r.decision for r in got[2].history] == ["kept"] * 3
    assert got[2].history[1].total_norm > 1.0
    _assert_identical(got[0], got[1], ref[0], ref[1])
    # "none" never intervenes, not even for NaN: the baseline that shows the damage.
    model = _model()
    opt = _sgd(model.parameters())
    guard = StepGuard(opt, mode="none", sync=sync)
    _backward(model, _corrupt(batches[0], "nan"))
    assert guard.step().decision == "kept"
    assert not torch.isfinite(next(model.parameters())).all()


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
@pytest.mark.parametrize("scale", [0.0, 0.5, 1.0, 2.0])
def test_skip_decision_follows_the_clip_rule(norm_type, scale):
    """Skip exactly when torch.nn.utils.clip_grad_norm_ would rescale (coef < 1)."""
    model = _model()
    _backward(model, _batches(1)[0])
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    norm = torch.linalg.vector_norm(grads, norm_type).item()
    threshold = norm * scale
    expected = "skipped" if threshold / (norm + 1e-6) < 1 else "kept"
    guard = StepGuard(_sgd(model.parameters()), threshold=threshold, norm_type=norm_type)
    record = guard.step()
    assert record.decision == expected
    assert record.total_norm == pytest.approx(norm, rel=1e-6)


@pytest.mark.parametrize("sync", [True, False])
def test_skip_by_value_threshold_is_inclusive(sync):
    model = _model()
    _backward(model, _batches(1)[0])
    largest = max(p.grad.abs().max().item() for p in model.parameters())
    opt = _sgd(model.parameters())
    at = StepGuard(opt, by="value", threshold=largest, sync=sync).step()
    assert at.decision == "skipped" and at.total_norm == largest
    above = StepGuard(opt, by="value", threshold=math.nextafter(largest, math.inf), sync=sync)
    assert above.step().decision == "kept"


def test_zero_gradient_and_zero_threshold():
    model = _model()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = _sgd(model.parameters())
    assert StepGuard(opt, threshold=1.0).step().decision == "kept"
    # Like grad_ignore_norm_: max_norm 0 ignores everything, even a zero gradient.
    assert StepGuard(opt, threshold=0.0).step().decision == "skipped"
    assert StepGuard(opt, threshold=math.inf).step().decision == "kept"


# ---------------------------------------------------------------------- scheduler


@pytest.mark.parametrize("name", ["sgd-momentum-wd", "adamw"])
def test_scheduler_does_not_advance_on_a_skipped_step(name):
    batches = _batches(6)
    bad = [*batches[:2], _corrupt(batches[2], "big"), _corrupt(batches[3], "nan"), *batches[4:]]

    def sched(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    make = OPTIMIZERS[name]
    ref_model, ref_opt, _, ref_lrs = _train(make, [*batches[:2], *batches[4:]], scheduler_fn=sched)
    model, opt, guard, lrs = _train(make, bad, dict(threshold=20.0), scheduler_fn=sched)
    taken = [lr for lr, r in zip(lrs, guard.history, strict=True) if not r.skipped]
    assert taken == ref_lrs
    assert lrs[2] == lrs[3] == lrs[4]  # frozen across the two skipped steps
    assert guard.scheduler.last_epoch == 4
    _assert_identical(model, opt, ref_model, ref_opt)


def test_scheduler_misuse_is_rejected():
    model = _model()
    opt = _sgd(model.parameters())
    other = _sgd(_model().parameters())
    sched_other = torch.optim.lr_scheduler.StepLR(other, 1)
    with pytest.raises(ValueError, match="another optimizer"):
        StepGuard(opt, scheduler=sched_other)
    with pytest.raises(ValueError, match="sync=False"):
        StepGuard(opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1), sync=False)
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        StepGuard(opt, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(ValueError, match="scheduler"):
        StepGuard(opt, scheduler="cosine")


# ------------------------------------------------------------------ host syncs


@pytest.mark.parametrize("mode", ["clip", "skip", "none"])
@pytest.mark.parametrize("name", ["sgd-momentum-wd", "sgd-nesterov", "adam-fused", "adamw-fused"])
def test_sync_false_never_reads_the_device(name, mode):
    batches = _batches(5)
    stream = [batches[0], _corrupt(batches[1], "big"), _corrupt(batches[2], "nan"), *batches[3:]]
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    guard = StepGuard(opt, mode=mode, threshold=20.0, sync=False, history=5)
    _backward(model, stream[0])
    guard.step()  # creates the optimizer state (that step may read the decision once)
    guard.optimizer.zero_grad()
    for batch in stream[1:]:
        _backward(model, batch)
        with no_host_reads():
            record = guard.step()
            assert record.pending
        guard.optimizer.zero_grad()
    expected = {"none": "kkkkk", "clip": "kcskk", "skip": "ksskk"}[mode]
    assert "".join(r.decision[0] for r in guard.history) == expected


@pytest.mark.parametrize("name", ["adam", "adamw", "adam-amsgrad"])
def test_sync_false_adds_no_host_read_to_the_optimizers_own(name):
    """Non-fused Adam reads its CPU step count itself; the guard adds nothing to that."""
    batches = _batches(3)
    bare_model, guarded_model = _model(), _model()
    bare = OPTIMIZERS[name](bare_model.parameters())
    guard = StepGuard(OPTIMIZERS[name](guarded_model.parameters()), threshold=1e30, sync=False)
    for i, batch in enumerate(batches):
        _backward(bare_model, batch)
        _backward(guarded_model, batch)
        with HostReadCounter() as own:
            bare.step()
        with HostReadCounter() as guarded:
            guard.step()
        if i > 0:
            assert guarded.count == own.count
        bare.zero_grad()
        guard.optimizer.zero_grad()


def test_host_reads_per_step():
    def count(sync, mode, steps=3):
        model = _model()
        guard = StepGuard(_sgd(model.parameters()), mode=mode, threshold=20.0, sync=sync)
        counts = []
        for batch in _batches(steps):
            _backward(model, batch)
            with HostReadCounter() as c:
                guard.step()
            counts.append(c.count)
            guard.optimizer.zero_grad()
        return counts

    assert count(True, "skip") == [1, 1, 1]  # like GradScaler: one read per step
    assert count(True, "clip") == [1, 1, 1]
    assert count(True, "none") == [0, 0, 0]  # nothing to decide
    assert count(False, "skip") == [1, 0, 0]  # only the step that creates the state
    assert count(False, "none") == [0, 0, 0]


# ------------------------------------------------------------------ history, records


def test_history_is_lazy_with_sync_false_and_converts_on_read():
    model = _model()
    guard = StepGuard(_adamw_fused(model.parameters()), threshold=20.0, sync=False, history=3)
    for batch in [*_batches(2), _corrupt(_batches(1, seed=5)[0], "inf")]:
        _backward(model, batch)
        record = guard.step()
        guard.optimizer.zero_grad()
    assert record.pending
    history = guard.history
    assert not record.pending
    assert [type(r.total_norm) for r in history] == [float] * 3
    assert [r.step for r in history] == [0, 1, 2]
    assert history[2].decision == "skipped" and history[2].total_norm == math.inf
    assert guard.skipped == 1
    assert guard.num_steps == 3


def test_step_record_behaves_like_a_tuple():
    record = StepRecord.of(3, 1.5, "clipped")
    step, norm, decision = record
    assert (step, norm, decision) == (3, 1.5, "clipped")
    pending = StepRecord(3, torch.tensor(1.5), torch.tensor(True), torch.tensor(True))
    assert pending.pending
    assert record == (3, 1.5, "clipped") == pending
    assert not pending.pending  # read once, on comparison
    assert repr(record) == "StepRecord(step=3, total_norm=1.5, decision='clipped')"
    assert not record.skipped and StepRecord.of(0, math.nan, "skipped").skipped
    assert StepRecord(0, 1.0, torch.tensor(False), torch.tensor(True)).decision == "skipped"
    assert DECISIONS == ("kept", "clipped", "skipped")
    with pytest.raises(ValueError, match="decision"):
        StepRecord.of(0, 1.0, "dropped")


@pytest.mark.parametrize("sync", [True, False])
def test_state_dict_round_trip(sync):
    """The guard saves its own state only; with the optimizer's, training resumes exactly."""
    batches = _batches(6)
    stream = [batches[0], _corrupt(batches[1], "big"), *batches[2:]]
    model = _model()
    opt = _adamw(model.parameters())
    guard = StepGuard(opt, threshold=20.0, sync=sync)
    for batch in stream[:3]:
        _backward(model, batch)
        guard.step()
        guard.optimizer.zero_grad()
    buffer = io.BytesIO()
    torch.save({"guard": guard.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert "optimizer" not in saved["guard"] and "state" not in saved["guard"]

    clone = _model()
    clone.load_state_dict(model.state_dict())
    clone_opt = _adamw(clone.parameters())
    clone_opt.load_state_dict(saved["opt"])
    clone_guard = StepGuard(clone_opt, threshold=20.0, sync=sync)
    clone_guard.load_state_dict(saved["guard"])
    assert (clone_guard.num_steps, clone_guard.skipped, clone_guard.taken) == (3, 1, 2)
    for g, m in ((guard, model), (clone_guard, clone)):
        for batch in stream[3:]:
            _backward(m, batch)
            g.step()
            g.optimizer.zero_grad()
    _assert_identical(model, opt, clone, clone_opt)
    assert clone_guard.last == guard.last


# ------------------------------------------------------------------------- misuse


def test_bad_arguments_are_named():
    opt = _sgd(_model().parameters())
    with pytest.raises(TypeError, match="optimizer"):
        StepGuard(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="optimizer"):
        StepGuard(list(_model().parameters()))
    with pytest.raises(ValueError, match="mode"):
        StepGuard(opt, mode="drop")
    with pytest.raises(ValueError, match="by"):
        StepGuard(opt, by="l2")
    for bad in (-1.0, math.nan, "1", None, True):
        with pytest.raises(ValueError, match="threshold"):
            StepGuard(opt, threshold=bad)
    for bad in (0, -2.0, math.nan, "two"):
        with pytest.raises(ValueError, match="norm_type"):
            StepGuard(opt, norm_type=bad)
    with pytest.raises(ValueError, match="sync"):
        StepGuard(opt, sync="yes")
    StepGuard(opt, norm_type="inf", threshold=math.inf)  # both allowed


@pytest.mark.parametrize("sync", [True, False])
def test_step_without_gradients_says_so(sync):
    model = _model()
    guard = StepGuard(_adam(model.parameters()), sync=sync, history=2)
    with pytest.raises(RuntimeError, match=r"no gradient.*backward"):
        guard.step()
    assert guard.history == [] and guard.num_steps == 0
    _backward(model, _batches(1)[0])
    guard.step()
    guard.optimizer.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="no gradient"):
        guard.step()


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool, torch.complex64],
)
@pytest.mark.parametrize("keep", [True, False])
def test_device_select_is_bit_exact(dtype, keep):
    from gradlab._common import select_bits_

    new = torch.tensor([0.0, -0.0, math.nan, math.inf, -1.5, 3.0]).to(dtype)
    old = torch.tensor([-0.0, 0.0, 2.0, math.nan, -math.inf, 7.0]).to(dtype)
    live, expected = new.clone(), (new if keep else old).clone()
    for view in (live, live[::2]):  # contiguous (bit path) and strided (torch.where path)
        target = expected if view is live else expected[::2]
        select_bits_(view, (old if view is live else old[::2]).clone(), torch.tensor(keep))
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        if dtype.is_complex:
            assert torch.equal(
                torch.view_as_real(view).contiguous().view(torch.int32),
                torch.view_as_real(target).contiguous().view(torch.int32),
            )
        else:
            size = view.element_size()
            assert torch.equal(
                view.contiguous().view(bits[size]), target.contiguous().view(bits[size])
            )
        live.copy_(new)


def test_setting_a_threshold_reads_nothing_and_decides_anew():
    model = _model()
    _backward(model, _batches(1)[0])
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).double().norm().item()
    guard = StepGuard(_sgd(model.parameters()), threshold=1.0, sync=False)
    with HostReadCounter() as reads:
        guard.threshold = norm * 2
    assert reads.count == 0, reads.operations
    assert guard.step().decision == "kept"
    guard.threshold = norm / 2
    assert guard.step().decision == "skipped"
