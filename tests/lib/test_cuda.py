"""The same guarantees on a GPU: skipped where torch has no CUDA device.

``torch.cuda.set_sync_debug_mode("error")`` makes every call that waits for the GPU
raise, so the no-sync rule is checked by CUDA itself here, not only by the dispatch
mode of test_clip_nosync.py.
"""

import contextlib
import math

import pytest
import torch
from clip_helpers import assert_all_plus_zero, assert_grads_unchanged, assert_same_bits, snapshot

import gradlab

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CALLS = {
    "get_total_norm": lambda ps, t: gradlab.get_total_norm([p.grad for p in ps]),
    "clip_grad_norm_": lambda ps, t: gradlab.clip_grad_norm_(ps, t),
    "clip_grad_value_": lambda ps, t: gradlab.clip_grad_value_(ps, t),
    "grad_ignore_norm_": lambda ps, t: gradlab.grad_ignore_norm_(ps, t),
    "grad_ignore_value_": lambda ps, t: gradlab.grad_ignore_value_(ps, t),
}


@contextlib.contextmanager
def sync_is_an_error():
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


def cuda_params(sizes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype, device="cuda"))
        p.grad = torch.randn(n, generator=gen).to(dtype=dtype, device="cuda")
        params.append(p)
    return params


SIZES = [3000, 70_000, 1, 0, 5]


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("kind", ["clean", "over", "nan"])
def test_no_sync_on_cuda(name, kind):
    params = cuda_params(SIZES)
    if kind == "nan":
        params[1].grad[123] = math.nan
    threshold = 1e-3 if kind == "over" else 1e6
    with sync_is_an_error():
        CALLS[name](params, threshold)
    torch.cuda.synchronize()


def test_the_cuda_detector_works():
    with pytest.raises(RuntimeError), sync_is_an_error():
        torch.ones(2, device="cuda").sum().item()


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.5, math.inf])
@pytest.mark.parametrize("factor", [0.5, 2.0])
@pytest.mark.parametrize("n_tensors", [5, 600])
def test_clip_grad_norm_matches_torch_on_cuda(norm_type, factor, n_tensors):
    sizes = [1 + (i * 37) % 300 for i in range(n_tensors)]
    ours = cuda_params(sizes, seed=1)
    theirs = cuda_params(sizes, seed=1)
    max_norm = factor * float(torch.nn.utils.get_total_norm([p.grad for p in theirs], norm_type))
    a = gradlab.clip_grad_norm_(ours, max_norm, norm_type)
    b = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert_same_bits(a, b)
    for p, q in zip(ours, theirs, strict=True):
        assert_same_bits(p.grad, q.grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_ignore_on_cuda(dtype, norm_type, bad):
    kept = cuda_params(SIZES, dtype=dtype, seed=2)
    before = snapshot(kept)
    gradlab.grad_ignore_norm_(kept, 1e9, norm_type)
    gradlab.grad_ignore_value_(kept, 1e9)
    assert_grads_unchanged(kept, before)
    for call in (
        lambda ps: gradlab.grad_ignore_norm_(ps, 1e9, norm_type),
        lambda ps: gradlab.grad_ignore_value_(ps, 1e9),
    ):
        broken = cuda_params(SIZES, dtype=dtype, seed=2)
        broken[1].grad[-1] = bad  # the last entry of a large tensor
        call(broken)
        assert_all_plus_zero(broken)


def test_mixed_devices():
    params = [*cuda_params([10, 2000]), torch.nn.Parameter(torch.zeros(3))]
    params[-1].grad = torch.tensor([3.0, -4.0, 0.0])
    total = gradlab.get_total_norm([p.grad for p in params])
    assert total.device.type == "cuda"
    flat = torch.cat([p.grad.double().cpu().reshape(-1) for p in params])
    assert math.isclose(float(total), float(flat.norm()), rel_tol=1e-5)
    gradlab.grad_ignore_value_(params, 3.5)
    assert_all_plus_zero(params)


@pytest.mark.parametrize("mode", ["skip", "clip"])
@pytest.mark.parametrize("by", ["norm", "value"])
@pytest.mark.parametrize("threshold", [1e-3, 1e6], ids=["over", "within"])
def test_guard_step_and_threshold_do_not_sync(mode, by, threshold):
    """sync=False on fused AdamW: after the first step (which creates the state and
    reads once), neither a step nor setting the threshold waits for the GPU."""
    params = cuda_params(SIZES[:3])
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    guard = gradlab.StepGuard(optimizer, mode=mode, by=by, threshold=1e6, sync=False)
    guard.step()
    with sync_is_an_error():
        guard.threshold = threshold
        for _ in range(3):
            guard.step()
    torch.cuda.synchronize()
    assert guard.num_steps == 4
