"""StepGuard refuses bad input before anything changes, and clips what a closure recomputes.

Each case here was accepted by the guard of gradlab 0.2 and did damage: a per-sample loss
raised after the fused optimizer had stepped (NaN left in the weights and moments), a
closure re-evaluated by the optimizer replaced the clipped gradients, an overflowing
``norm_type`` raised a bare OverflowError, a first param group without parameters an
IndexError.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from gradlab import AutoClip, StepGuard


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(seed: int = 1, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g) * scale


def _state(model, opt):
    return (
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(opt.state_dict()),
        [None if p.grad is None else p.grad.clone() for p in model.parameters()],
    )


def _assert_same(before, model, opt):
    params, opt_state, grads = before
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    now = opt.state_dict()
    assert now["param_groups"] == opt_state["param_groups"]
    assert now["state"].keys() == opt_state["state"].keys()
    for k, entries in now["state"].items():
        for key, value in entries.items():
            assert torch.equal(value, opt_state["state"][k][key])
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0, equal_nan=True)


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
}


@pytest.mark.parametrize("shape", [(6,), (1,), (2, 3)])
@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_loss_that_is_not_0_dim_is_refused_before_the_step(name, sync, shape):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    guard = StepGuard(opt, threshold=1e9, loss_threshold=10.0, sync=sync)
    x, y = _batch()
    nn.functional.mse_loss(model(x), y).backward()
    guard.step(loss=torch.tensor(0.5))  # a first step creates the state
    opt.zero_grad()
    per_sample = (model(x) - y).pow(2).mean(dim=1) * float("nan")  # NaN gradients too
    per_sample.mean().backward()
    before = _state(model, opt)
    with pytest.raises(ValueError, match=r"loss must be .* 0-dim"):
        guard.step(loss=per_sample[: math.prod(shape)].reshape(shape))
    _assert_same(before, model, opt)
    assert guard.num_steps == 1


@pytest.mark.parametrize("bad", ["0.5", [0.5], True, torch.tensor(1.0 + 1j)])
def test_a_loss_of_the_wrong_type_is_refused(bad):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = StepGuard(opt, loss_threshold=10.0)
    x, y = _batch()
    nn.functional.mse_loss(model(x), y).backward()
    before = _state(model, opt)
    with pytest.raises(ValueError, match="loss must be"):
        guard.step(loss=bad)
    _assert_same(before, model, opt)


def _closure(model, x, y, opt):
    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    return closure


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_clip_mode_with_a_closure_steps_the_clipped_gradient(name, sync):
    """torch's optimizers call the closure again inside step(): the guard's clipped
    gradients used to be replaced by fresh, unclipped ones, while the record said
    'clipped'."""
    x, y = _batch(scale=100.0)
    ref = _model()
    ref_opt = OPTIMIZERS[name](ref.parameters())
    _closure(ref, x, y, ref_opt)()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    ref_opt.step()
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    guard = StepGuard(opt, "clip", threshold=0.5, sync=sync)
    assert guard.step(_closure(model, x, y, opt)).decision == "clipped"
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_lbfgs_clips_every_evaluation_of_its_closure():
    x, y = _batch(scale=100.0)
    ref = _model()
    ref_opt = torch.optim.LBFGS(ref.parameters(), lr=0.1, max_iter=4)

    def ref_closure():
        ref_opt.zero_grad()
        loss = nn.functional.mse_loss(ref(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        return loss

    ref_opt.step(ref_closure)
    model = _model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4)
    guard = StepGuard(opt, "clip", threshold=0.5)
    guard.step(_closure(model, x, y, opt))
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_bad_arguments_are_refused_naming_them():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match=r"norm_type is too large"):
        StepGuard(opt, norm_type=10**400)
    with pytest.raises(ValueError, match=r"skip_above=2.0 is below threshold=3.0"):
        StepGuard(opt, "clip", threshold=3.0, skip_above=2.0)
    guard = StepGuard(opt, "clip", threshold=1.0, skip_above=10.0)
    assert guard.skip_above == 10.0
    guard.skip_above = 20.0
    assert guard.skip_above == 20.0
    with pytest.raises(ValueError, match="skip_above"):
        guard.skip_above = 0.5
    with pytest.raises(ValueError, match="above skip_above"):
        guard.threshold = 30.0
    policy = AutoClip()
    with pytest.raises(ValueError, match="same policy object"):
        StepGuard(opt, threshold=policy, loss_threshold=policy)
    assert not opt._optimizer_step_pre_hooks


def test_an_empty_first_param_group_is_fine():
    model = _model()
    opt = torch.optim.SGD([{"params": []}, {"params": list(model.parameters())}], lr=0.1)
    guard = StepGuard(opt, threshold=1e9, sync=False)
    x, y = _batch()
    nn.functional.mse_loss(model(x), y).backward()
    assert guard.step().decision == "kept"
    with pytest.raises(ValueError, match="no parameters"):
        StepGuard(torch.optim.SGD([{"params": []}], lr=0.1))
