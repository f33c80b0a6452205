"""StepGuard with CPU autocast and torch.amp.GradScaler: the recipe and its wrong edits.

References are plain GradScaler loops (``scaler.step(optimizer)``) on the stream without the
skipped batch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradlab import StepGuard

INIT_SCALE = 2.0**8  # low enough that a large but finite gradient does not overflow fp16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 2))


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]


OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, fused=True),
}


def _scaled_backward(model, scaler, batch, dtype):
    x, y = batch
    with torch.autocast("cpu", dtype=dtype):
        loss = nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()


def _reference(make, batches, dtype):
    model = _model()
    opt = make(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    for batch in batches:
        _scaled_backward(model, scaler, batch, dtype)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return model, opt, scaler


def _guarded(make, batches, dtype, sync, give_scaler, unscale=True, mode="skip"):
    model = _model()
    opt = make(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    guard = StepGuard(
        opt, mode, threshold=50.0, sync=sync, scaler=scaler if give_scaler else None, history=9
    )
    for batch in batches:
        _scaled_backward(model, scaler, batch, dtype)
        if unscale:
            scaler.unscale_(opt)
        guard.step()
        scaler.update()
        guard.optimizer.zero_grad()
    return model, opt, scaler, guard


def _assert_identical(got, ref) -> None:
    for p, q in zip(got[0].parameters(), ref[0].parameters(), strict=True):
        assert torch.equal(p, q)
    sa, sb = got[1].state_dict()["state"], ref[1].state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for name in sa[k]:
            assert torch.equal(sa[k][name], sb[k][name]), name


@pytest.mark.parametrize("give_scaler", [True, False], ids=["scaler=", "no-scaler="])
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "nosync"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_recipe_kept_steps_match_gradscaler(name, dtype, sync, give_scaler):
    batches = _batches(4)
    ref = _reference(OPTIMIZERS[name], batches, dtype)
    got = _guarded(OPTIMIZERS[name], batches, dtype, sync, give_scaler)
    assert got[3].taken == 4
    _assert_identical(got, ref)
    assert got[2].get_scale() == ref[2].get_scale()


@pytest.mark.parametrize("give_scaler", [True, False], ids=["scaler=", "no-scaler="])
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "nosync"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_skip_by_the_guard(name, dtype, sync, give_scaler):
    """A finite but large unscaled norm: the guard skips, the scaler does not back off."""
    batches = _batches(3)
    x, y = batches[2]
    stream = [*batches[:2], (x, y * 30.0)]
    ref = _reference(OPTIMIZERS[name], batches[:2], dtype)
    got = _guarded(OPTIMIZERS[name], stream, dtype, sync, give_scaler)
    last = got[3].last
    assert last.skipped and 50.0 < last.total_norm < 1e6  # measured unscaled
    _assert_identical(got, ref)
    assert got[2].get_scale() == INIT_SCALE


@pytest.mark.parametrize("give_scaler", [True, False], ids=["scaler=", "no-scaler="])
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "nosync"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_skip_by_the_scaler(name, dtype, sync, give_scaler):
    """Scaled gradients overflow (fp16) or are inf: skipped, and the scaler backs off."""
    batches = _batches(3)
    x, y = batches[2]
    bad_y = y * 1e5 if dtype is torch.float16 else y * float("inf")
    stream = [*batches[:2], (x, bad_y)]
    ref = _reference(OPTIMIZERS[name], batches[:2], dtype)
    got = _guarded(OPTIMIZERS[name], stream, dtype, sync, give_scaler)
    assert got[3].last.skipped
    _assert_identical(got, ref)
    assert got[2].get_scale() == INIT_SCALE * 0.5  # update() backed off
    # and the reference scaler, which never saw the batch, did not
    assert ref[2].get_scale() == INIT_SCALE


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "nosync"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_forgotten_unscale_is_done_by_a_guard_given_the_scaler(name, sync):
    batches = _batches(4)
    ref = _reference(OPTIMIZERS[name], batches, torch.float16)
    got = _guarded(OPTIMIZERS[name], batches, torch.float16, sync, True, unscale=False)
    assert got[3].taken == 4  # the scaled norms (~256 times larger) would all be skipped
    assert all(r.total_norm < 50.0 for r in got[3].history)
    _assert_identical(got, ref)
    assert got[2].get_scale() == ref[2].get_scale()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_double_steps_fail_loudly(name):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    guard = StepGuard(opt, threshold=50.0, scaler=scaler)
    _scaled_backward(model, scaler, _batches(1)[0], torch.float16)
    guard.step()
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(opt)  # the edit that used to take every kept step twice
    with pytest.raises(RuntimeError, match=r"already stepped.*scaler.update\(\)"):
        guard.step()
    scaler.update()
    _scaled_backward(model, scaler, _batches(1)[0], torch.float16)
    guard.step()  # fine again after update()
    scaler.update()


def _snapshot(model, opt, scaler):
    return (
        [p.detach().clone() for p in model.parameters()],
        [p.grad.clone() for p in model.parameters()],
        {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()},
        scaler.get_scale(),
    )


def _assert_unchanged(before, model, opt, scaler):
    params, grads, state, scale = before
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters(), strict=True))
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters(), strict=True))
    after = opt.state_dict()["state"]
    assert after.keys() == state.keys()
    assert all(torch.equal(state[k][n], after[k][n]) for k in state for n in state[k])
    assert scaler.get_scale() == scale


@pytest.mark.parametrize("unscale_first", [True, False], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("give_scaler", [True, False], ids=["scaler=", "no-scaler="])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_scaler_step_of_the_guard_is_refused_before_anything_changes(
    name, give_scaler, unscale_first
):
    """scaler.step(guard) used to unscale a second time after unscale_(optimizer), and a
    guard.step() after it stepped twice: the scaler's bookkeeping is per optimizer."""
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    guard = StepGuard(opt, threshold=50.0, scaler=scaler if give_scaler else None)
    _scaled_backward(model, scaler, _batches(1)[0], torch.float16)
    if unscale_first:
        scaler.unscale_(opt)
    before = _snapshot(model, opt, scaler)
    with pytest.raises(TypeError, match=r"guard.step\(\) in place of scaler.step"):
        scaler.step(guard)
    _assert_unchanged(before, model, opt, scaler)
    assert guard.num_steps == 0


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_stray_step_of_a_guarded_optimizer_is_refused(name, enabled):
    """nanoGPT builds a GradScaler that is disabled outside float16: a stray
    scaler.step(optimizer) then was a plain optimizer.step(), every step taken twice,
    the skipped ones included."""
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, enabled=enabled)
    guard = StepGuard(opt, threshold=1e-9, scaler=scaler)  # skips every step
    batch = _batches(1)[0]
    _scaled_backward(model, scaler, batch, torch.float16)
    assert guard.step().skipped
    before = _snapshot(model, opt, scaler)
    with pytest.raises(RuntimeError, match=r"guarded by a StepGuard|already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="guarded by a StepGuard"):
        opt.step()
    _assert_unchanged(before, model, opt, scaler)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "nosync"])
def test_a_guard_skip_of_a_finite_step_advances_the_growth_tracker(sync):
    """The scaler sees only overflow: a step the guard skips for a finite norm counts, for
    growth, as the plain GradScaler loop counts the same step taken."""
    batches = _batches(4)
    x, y = batches[1]
    stream = [batches[0], (x, y * 60.0), *batches[2:]]  # step 1: finite, over 50
    plain = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
    model = _model()
    opt = OPTIMIZERS["adam"](model.parameters())
    for batch in stream:
        _scaled_backward(model, plain, batch, torch.float16)
        plain.step(opt)
        plain.update()
        opt.zero_grad()
    guarded = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
    model = _model()
    opt = OPTIMIZERS["adam"](model.parameters())
    guard = StepGuard(opt, threshold=50.0, sync=sync, scaler=guarded)
    for batch in stream:
        _scaled_backward(model, guarded, batch, torch.float16)
        guard.step()
        guarded.update()
        opt.zero_grad()
    assert guard.skipped == 1
    assert guarded.get_scale() == plain.get_scale() == INIT_SCALE * 4  # grew twice
    assert guarded._get_growth_tracker() == plain._get_growth_tracker()


def test_mode_none_writes_nan_on_an_overflowing_fp16_step():
    model = _model()
    opt = OPTIMIZERS["adam"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    guard = StepGuard(opt, mode="none", scaler=scaler)
    x, y = _batches(1)[0]
    _scaled_backward(model, scaler, (x, y * 1e5), torch.float16)
    assert guard.step().decision == "kept"
    scaler.update()
    assert not all(torch.isfinite(p).all() for p in model.parameters())
