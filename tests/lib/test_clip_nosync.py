"""No function reads a tensor's value on the host, except when error_if_nonfinite asks.

On a GPU, reading a value (``.item()``, ``bool(t)``, a tensor in an ``if``) stalls
the CPU until every queued kernel has run. These tests run each function under
:func:`gradlab.sync.no_host_reads`, which raises on every host read (its own tests are
in test_sync.py), and so catches the sync on the CPU as well, where it costs
nothing and goes unnoticed.
"""

import math

import pytest
import torch
from clip_helpers import make_params

import gradlab
from gradlab.sync import HostReadError, no_host_reads


def _inputs(kind):
    if kind == "empty":
        return []
    params = make_params([(4, 3), (5,), (), (0,)], seed=11, scale=3.0)
    if kind == "nan":
        params[0].grad[1, 2] = math.nan
    elif kind == "inf":
        params[1].grad[0] = -math.inf
    elif kind == "no_grads":
        for p in params:
            p.grad = None
    return params


# (name, call) with thresholds that keep ("clean") or trip ("over") the gradients.
CALLS = {
    "get_total_norm": lambda ps, t, **kw: gradlab.get_total_norm(
        [p.grad for p in ps if p.grad is not None], **kw
    ),
    "clip_grad_norm_": lambda ps, t, **kw: gradlab.clip_grad_norm_(ps, t, **kw),
    "clip_grad_value_": lambda ps, t, **kw: gradlab.clip_grad_value_(ps, t, **kw),
    "grad_ignore_norm_": lambda ps, t, **kw: gradlab.grad_ignore_norm_(ps, t, **kw),
    "grad_ignore_value_": lambda ps, t, **kw: gradlab.grad_ignore_value_(ps, t, **kw),
    "clip_grads_with_norm_": lambda ps, t, **kw: gradlab.clip_grads_with_norm_(
        ps, t, gradlab.get_total_norm([p.grad for p in ps if p.grad is not None]), **kw
    ),
    "grad_ignore_with_norm_": lambda ps, t, **kw: gradlab.grad_ignore_with_norm_(
        ps, t, gradlab.get_total_norm([p.grad for p in ps if p.grad is not None]), **kw
    ),
}
NORM_NAMES = ["get_total_norm", "clip_grad_norm_", "grad_ignore_norm_"]


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("kind", ["clean", "over", "nan", "inf", "empty", "no_grads"])
@pytest.mark.parametrize("foreach", [True, False])
def test_no_host_sync(name, kind, foreach):
    params = _inputs(kind)
    threshold = 1e-3 if kind == "over" else 1e6
    with no_host_reads():
        CALLS[name](params, threshold, foreach=foreach)


@pytest.mark.parametrize("name", NORM_NAMES)
@pytest.mark.parametrize("norm_type", [1, 2.0, 3.5, 100.0, math.inf])
def test_no_host_sync_any_norm_type(name, norm_type):
    params = _inputs("over")
    with no_host_reads():
        CALLS[name](params, 1e-3, norm_type=norm_type)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_no_host_sync_mixed_dtypes(dtype):
    params = make_params([(3,), (2, 2)], seed=1) + make_params([(4,)], dtype=dtype, seed=2)
    with no_host_reads():
        for name, call in CALLS.items():
            if name != "get_total_norm":
                call(params, 1e-3)


@pytest.mark.parametrize("name", ["clip_grad_norm_", "grad_ignore_norm_"])
def test_a_tensor_threshold_is_not_read(name):
    with no_host_reads():
        CALLS[name](_inputs("over"), torch.tensor(1e-3))


@pytest.mark.parametrize("name", NORM_NAMES)
def test_error_if_nonfinite_is_the_one_allowed_sync(name):
    # Checking finiteness on the host is what the flag asks for: it must sync.
    with pytest.raises(HostReadError), no_host_reads():
        CALLS[name](_inputs("clean"), 1e6, error_if_nonfinite=True)
