"""Every function compiles with fullgraph=True and gives eager's bits; thresholds do not recompile.

Eager here is gradlab's own eager result: the question is whether compiling changes
anything, and the eager results are held to torch and to float64 maths elsewhere.
"""

import math

import pytest
import torch
import torch._dynamo
from clip_helpers import copy_params, make_params, same_bits
from torch._dynamo.testing import CompileCounter

import gradlab


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _grads(ps):
    return [p.grad for p in ps if p.grad is not None]


CALLS = {
    "get_total_norm": lambda ps, t, p: gradlab.get_total_norm(_grads(ps), p),
    "clip_grad_norm_": lambda ps, t, p: gradlab.clip_grad_norm_(ps, t, p),
    "clip_grad_value_": lambda ps, t, p: gradlab.clip_grad_value_(ps, t),
    "grad_ignore_norm_": lambda ps, t, p: gradlab.grad_ignore_norm_(ps, t, p),
    "grad_ignore_value_": lambda ps, t, p: gradlab.grad_ignore_value_(ps, t),
    "clip_grads_with_norm_": lambda ps, t, p: gradlab.clip_grads_with_norm_(
        ps, t, gradlab.get_total_norm(_grads(ps), p)
    ),
    "grad_ignore_with_norm_": lambda ps, t, p: gradlab.grad_ignore_with_norm_(
        ps, t, gradlab.get_total_norm(_grads(ps), p)
    ),
}


def _params(kind: str):
    """Several shapes (one large enough for the CPU max-abs path), two dtypes, a None."""
    params = make_params([(4, 3), (5,), (), (0,), (2048,)], seed=7, scale=2.0)
    params += make_params([(6,)], dtype=torch.float16, seed=8)
    params.append(torch.nn.Parameter(torch.ones(2)))  # no gradient
    if kind == "nan":
        params[1].grad[2] = math.nan
    elif kind == "inf":
        params[4].grad[100] = -math.inf
    return params


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every bit equal, except inside NaNs: inductor's clamp and max need not keep eager's
    NaN sign bit, and a NaN's bits carry no value."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    zero = torch.zeros((), dtype=a.dtype)
    return same_bits(torch.where(nan, zero, a), torch.where(nan, zero, b))


def _assert_same_run(call, compiled, kind, threshold, p):
    eager_params = _params(kind)
    compiled_params = copy_params(eager_params)
    expected = call(eager_params, threshold, p)
    got = compiled(compiled_params, threshold, p)
    if expected is None:
        assert got is None
    else:
        assert _same(expected, got), (expected, got)
    for a, b in zip(eager_params, compiled_params, strict=True):
        assert (a.grad is None and b.grad is None) or _same(a.grad, b.grad)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("name", list(CALLS))
def test_fullgraph_is_bit_equal_to_eager(name, backend):
    call = CALLS[name]
    compiled = torch.compile(call, backend=backend, fullgraph=True)
    for kind, threshold in [("clean", 1e6), ("clean", 0.5), ("nan", 1e6), ("inf", 1e6)]:
        _assert_same_run(call, compiled, kind, threshold, 2.0)


@pytest.mark.parametrize("norm_type", [1.0, 3.5, 100.0, math.inf])
@pytest.mark.parametrize("name", ["clip_grad_norm_", "grad_ignore_norm_"])
def test_fullgraph_every_norm_type(name, norm_type):
    call = CALLS[name]
    compiled = torch.compile(call, backend="inductor", fullgraph=True)
    _assert_same_run(call, compiled, "clean", 0.5, norm_type)


@pytest.mark.parametrize("name", ["clip_grad_norm_", "grad_ignore_norm_", "grad_ignore_value_"])
def test_a_float_threshold_does_not_recompile_per_value(name):
    counter = CompileCounter()
    compiled = torch.compile(CALLS[name], backend=counter, fullgraph=True)
    for threshold in [1.0, 2.0, 3.0, 0.25, 40.0, 1e-3]:
        _assert_same_run(CALLS[name], compiled, "clean", threshold, 2.0)
    # The first value is specialised; at the second, dynamo makes the float an input.
    assert counter.frame_count <= 2


@pytest.mark.parametrize("name", ["clip_grad_norm_", "grad_ignore_norm_", "clip_grad_value_"])
def test_a_tensor_threshold_compiles_once(name):
    counter = CompileCounter()
    compiled = torch.compile(CALLS[name], backend=counter, fullgraph=True)
    for threshold in [1.0, 2.0, 0.25, 1e-3]:
        _assert_same_run(CALLS[name], compiled, "clean", torch.tensor(threshold), 2.0)
    assert counter.frame_count == 1


def test_a_module_generator_inside_the_compiled_step():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    model(x).pow(2).sum().backward()
    eager_norm = gradlab.get_total_norm([p.grad for p in model.parameters()])
    assert eager_norm > 0.1

    @torch.compile(backend="eager", fullgraph=True)
    def step():
        return gradlab.grad_ignore_norm_(model.parameters(), 0.1)

    assert same_bits(step(), eager_norm)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def test_error_if_nonfinite_needs_the_host_so_it_breaks_the_graph():
    compiled = torch.compile(
        lambda ps: gradlab.clip_grad_norm_(ps, 1.0, error_if_nonfinite=True),
        backend="eager",
        fullgraph=True,
    )
    with pytest.raises(torch._dynamo.exc.TorchDynamoException, match="data-dependent"):
        compiled(_params("clean"))
