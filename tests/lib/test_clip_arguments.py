"""What every function accepts, what it refuses, and that it leaves autograd alone."""

import math

import pytest
import torch
from clip_helpers import (
    assert_all_plus_zero,
    assert_grads_unchanged,
    assert_same_bits,
    make_params,
    math_norm,
    snapshot,
)

import gradlab

# Each function with arguments that keep the gradients of make_params(...) unchanged
# (thresholds far above them) and with arguments that change them.
KEEP = {
    "get_total_norm": lambda ps, **kw: gradlab.get_total_norm(
        [p.grad for p in ps if p.grad is not None] if isinstance(ps, list) else ps, **kw
    ),
    "clip_grad_norm_": lambda ps, **kw: gradlab.clip_grad_norm_(ps, 1e9, **kw),
    "clip_grad_value_": lambda ps, **kw: gradlab.clip_grad_value_(ps, 1e9, **kw),
    "grad_ignore_norm_": lambda ps, **kw: gradlab.grad_ignore_norm_(ps, 1e9, **kw),
    "grad_ignore_value_": lambda ps, **kw: gradlab.grad_ignore_value_(ps, 1e9, **kw),
}
CHANGE = {
    "clip_grad_norm_": lambda ps: gradlab.clip_grad_norm_(ps, 1e-3),
    "clip_grad_value_": lambda ps: gradlab.clip_grad_value_(ps, 1e-3),
    "grad_ignore_norm_": lambda ps: gradlab.grad_ignore_norm_(ps, 1e-3),
    "grad_ignore_value_": lambda ps: gradlab.grad_ignore_value_(ps, 1e-3),
}
IN_PLACE = list(CHANGE)
NORM_RETURNING = ["clip_grad_norm_", "grad_ignore_norm_", "grad_ignore_value_"]


# --------------------------------------------------------------- accepted inputs


@pytest.mark.parametrize("name", IN_PLACE)
@pytest.mark.parametrize("form", ["tensor", "list", "tuple", "generator", "module"])
def test_forms_of_parameters(name, form):
    model = torch.nn.Linear(3, 2)
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    params = list(model.parameters())
    arg = {
        "tensor": params[0],
        "list": params,
        "tuple": tuple(params),
        "generator": (p for p in params),
        "module": model.parameters(),
    }[form]
    touched = [params[0]] if form == "tensor" else params
    untouched = [] if form != "tensor" else params[1:]
    before_untouched = snapshot(untouched)
    reference = [p.grad.clone() for p in touched]
    CHANGE[name](arg)
    assert_grads_unchanged(untouched, before_untouched)
    for p, old in zip(touched, reference, strict=True):
        assert not torch.equal(p.grad, old)  # every given gradient was acted on


@pytest.mark.parametrize("name", IN_PLACE)
def test_none_gradients_are_skipped(name):
    params = make_params([(3,), (2, 2), (4,)], seed=1)
    params[1].grad = None
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    CHANGE[name]([*params, frozen])
    assert params[1].grad is None
    assert frozen.grad is None
    # the norm is taken over the gradients that exist
    fresh = make_params([(3,), (2, 2), (4,)], seed=1)
    fresh[1].grad = None
    expected = math_norm([fresh[0].grad, fresh[2].grad], 2.0)
    assert math.isclose(float(gradlab.grad_ignore_norm_(fresh, 1e9)), expected, rel_tol=1e-6)


@pytest.mark.parametrize("name", list(KEEP))
@pytest.mark.parametrize("empty", ["list", "no_grads", "generator"])
def test_nothing_to_do(name, empty):
    nograd = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    arg = {"list": [], "no_grads": nograd, "generator": (p for p in [])}[empty]
    if name == "get_total_norm" and empty == "no_grads":
        arg = []  # get_total_norm takes the gradients themselves
    # Like torch, an empty generator (probably one used up already) warns; torch's
    # clip_grad_value_ does not warn, and neither does get_total_norm.
    if empty == "generator" and name in (
        "clip_grad_norm_",
        "grad_ignore_norm_",
        "grad_ignore_value_",
    ):
        with pytest.warns(UserWarning, match="`parameters` is an empty generator") as warned:
            result = KEEP[name](arg)
        assert len(warned) == 1 and warned[0].filename == __file__
    else:
        result = KEEP[name](arg)
    if name == "clip_grad_value_":
        assert result is None
    else:
        assert isinstance(result, torch.Tensor) and result.dim() == 0
        assert_same_bits(result, torch.tensor(0.0))
    assert all(p.grad is None for p in nograd)
    assert all(torch.equal(p, torch.ones_like(p)) for p in nograd)


def test_get_total_norm_of_a_single_tensor():
    t = torch.tensor([[3.0, 0.0], [0.0, -4.0]])
    assert float(gradlab.get_total_norm(t)) == 5.0
    assert float(gradlab.get_total_norm(t, 1)) == 7.0
    assert float(gradlab.get_total_norm(t, "inf")) == 4.0
    assert math.isclose(
        float(gradlab.get_total_norm(x for x in [t, t])), math.sqrt(50), rel_tol=1e-7
    )


def test_clip_grad_value_returns_none():
    params = make_params([(3,)], seed=0)
    assert gradlab.clip_grad_value_(params, 0.1) is None


@pytest.mark.parametrize("norm_type", [1, 2, 2.5, math.inf, "inf", "INF", "+inf"])
def test_norm_type_spellings(norm_type):
    t = torch.tensor([3.0, -4.0])
    expected = {1.0: 7.0, 2.0: 5.0, math.inf: 4.0}.get(
        math.inf if isinstance(norm_type, str) else float(norm_type),
        (3**2.5 + 4**2.5) ** (1 / 2.5),
    )
    assert math.isclose(float(gradlab.get_total_norm(t, norm_type)), expected, rel_tol=1e-6)


# ------------------------------------------------------------------ bad arguments

BAD_THRESHOLDS = [
    *(-1.0, -1e-9, -math.inf, math.nan, "1.0", None, True, [1.0], 10**400),
    # A tensor threshold must be 0-dim and real (its value stays unchecked on the device).
    *(torch.ones(1), torch.tensor(True), torch.tensor(1 + 0j)),
]
BAD_NORM_TYPES = [0, 0.0, -2, -math.inf, math.nan, "foo", "", True, False, None, [2]]
BAD_FLAGS = [None, 1, 0, "yes", 1.0]
BAD_FOREACH = [1, 0, "True", 1.0]
BAD_PARAMETERS = [5, 3.0, None, [1.0, 2.0], [torch.ones(1), None], ["w"], object()]


def _calls_with(argument, value):
    """(name, call(params)) pairs passing ``value`` as ``argument`` and sane values otherwise."""
    if argument == "max_norm":
        yield "clip_grad_norm_", lambda ps: gradlab.clip_grad_norm_(ps, value)
        yield "grad_ignore_norm_", lambda ps: gradlab.grad_ignore_norm_(ps, value)
    elif argument == "clip_value":
        yield "clip_grad_value_", lambda ps: gradlab.clip_grad_value_(ps, value)
        yield "grad_ignore_value_", lambda ps: gradlab.grad_ignore_value_(ps, value)
    elif argument in ("norm_type", "error_if_nonfinite"):
        kw = {argument: value}
        yield "get_total_norm", lambda ps: gradlab.get_total_norm([p.grad for p in ps], **kw)
        yield "clip_grad_norm_", lambda ps: gradlab.clip_grad_norm_(ps, 1e-3, **kw)
        yield "grad_ignore_norm_", lambda ps: gradlab.grad_ignore_norm_(ps, 1e-3, **kw)
    elif argument == "foreach":
        yield (
            "get_total_norm",
            lambda ps: gradlab.get_total_norm([p.grad for p in ps], foreach=value),
        )
        for name in IN_PLACE:
            fn = getattr(gradlab, name)
            yield name, lambda ps, fn=fn: fn(ps, 1e-3, foreach=value)


CASES = [
    *(("max_norm", v) for v in BAD_THRESHOLDS),
    *(("clip_value", v) for v in BAD_THRESHOLDS),
    *(("norm_type", v) for v in BAD_NORM_TYPES),
    *(("error_if_nonfinite", v) for v in BAD_FLAGS),
    *(("foreach", v) for v in BAD_FOREACH),
]


@pytest.mark.parametrize(("argument", "value"), CASES, ids=lambda x: repr(x)[:20])
def test_bad_argument_raises_value_error_before_any_change(argument, value):
    for _name, call in _calls_with(argument, value):
        params = make_params([(3,), (2, 2)], seed=3, scale=10.0)
        before = snapshot(params)
        with pytest.raises(ValueError, match=argument):
            call(params)
        assert_grads_unchanged(params, before)


@pytest.mark.parametrize("value", BAD_PARAMETERS, ids=lambda v: type(v).__name__ + repr(v)[:12])
def test_bad_parameters_raise_value_error(value):
    with pytest.raises(ValueError, match="tensors"):
        gradlab.get_total_norm(value)
    for name in IN_PLACE:
        with pytest.raises(ValueError, match="parameters"):
            getattr(gradlab, name)(value, 1.0)


def test_bad_argument_with_a_generator_changes_nothing():
    params = make_params([(3,)], seed=4, scale=10.0)
    before = snapshot(params)
    with pytest.raises(ValueError, match="max_norm"):
        gradlab.grad_ignore_norm_((p for p in params), -1.0)
    assert_grads_unchanged(params, before)


@pytest.mark.parametrize(
    "value", [0.0, 0, 1, 2.5, math.inf, torch.tensor(2.5), torch.tensor(3, dtype=torch.int64)]
)
def test_good_thresholds_are_accepted(value):
    params = make_params([(3,)], seed=5)
    gradlab.clip_grad_norm_(params, value)
    gradlab.grad_ignore_norm_(params, value)
    gradlab.clip_grad_value_(params, value)
    gradlab.grad_ignore_value_(params, value)


# ------------------------------------------------------------------------ autograd


@pytest.mark.parametrize("name", IN_PLACE)
@pytest.mark.parametrize("change", [False, True])
def test_autograd_leaf_parameters(name, change):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, generator=gen)
    model(x).pow(2).sum().backward()
    params = list(model.parameters())
    (CHANGE[name] if change else KEEP[name])(params)
    for p in params:
        assert p.is_leaf and p.requires_grad
        assert not p.grad.requires_grad and p.grad.grad_fn is None
    result = (CHANGE[name] if change else KEEP[name])(params)
    if result is not None:
        assert not result.requires_grad and result.grad_fn is None
    # the parameters still train: another backward accumulates into the gradients
    model(x).pow(2).sum().backward()
    assert all(p.grad is not None for p in params)


def test_autograd_records_no_graph_even_when_grad_mode_is_on():
    param = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    param.grad = torch.tensor([3.0, 4.0])
    with torch.enable_grad():
        total = gradlab.get_total_norm(param)
        clipped = gradlab.clip_grad_norm_(param, 1.0)
    assert total.grad_fn is None and clipped.grad_fn is None
    assert not total.requires_grad


def test_ignore_zeroes_are_plain_zero():
    params = make_params([(2,)], seed=0)
    gradlab.grad_ignore_value_(params, 1e-9)
    assert_all_plus_zero(params)
