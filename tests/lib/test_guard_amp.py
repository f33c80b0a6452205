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


@pytest.mark.parametrize("give_scaler", [True, False], ids=["scaler=", "no-scaler="])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_scaler_step_of_the_guard_works(name, give_scaler):
    batches = _batches(3)
    x, y = batches[2]
    stream = [*batches[:2], (x, y * 1e5)]
    ref = _reference(OPTIMIZERS[name], batches[:2], torch.float16)
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    guard = StepGuard(opt, threshold=50.0, scaler=scaler if give_scaler else None)
    for batch in stream:
        _scaled_backward(model, scaler, batch, torch.float16)
        scaler.step(guard)
        scaler.update()
        guard.optimizer.zero_grad()
    assert guard.num_steps == 2  # the scaler did not call guard.step() on the overflow
    _assert_identical((model, opt), ref)
    assert scaler.get_scale() == INIT_SCALE * 0.5


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
