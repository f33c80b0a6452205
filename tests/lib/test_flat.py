"""Flat gradients (gradlab.flat): the buffer, backward and zero_grad, optimizers, parity.

References: torch itself (autograd on an unflattened copy of the model, torch.optim on
ordinary gradients, torch.nn.utils for the norms and the clip coefficient) and float64
maths on the concatenated entries, never gradlab's own per-tensor path.
"""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
from clip_helpers import assert_all_plus_zero, copy_params, math_max_abs, math_norm, same_bits
from optimizer_zoo import OPTIMIZERS, batches_of, model_for
from torch import nn

import gradlab
from gradlab.flat import FlatGrads, FlatRuns, coalesce, flat_grads_of, flatten_grads

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
#: 0-d, empty and ordinary shapes; the regions sit next to each other in the buffer.
SHAPES = ((3, 4), (), (5,), (0,), (2, 3, 2), (7,), (1,))
P_VALUES = (1.0, 2.0, 3.5, math.inf, 100.0)
KINDS = ("normal", "nan", "inf", "large")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _params(dtype=torch.float32, kind="normal", shapes=SHAPES, seed=0) -> list[nn.Parameter]:
    """Parameters with seeded gradients; "large" entries overflow |g|^2 in float16."""
    gen = torch.Generator().manual_seed(seed)
    scale = 300.0 if kind == "large" else 1.0
    params = []
    for shape in shapes:
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
        params.append(p)
    bad = {"nan": math.nan, "inf": -math.inf}.get(kind)
    if bad is not None:
        params[-2].grad[3] = bad
    return params


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except which NaN: torch's 16-bit kernels write a NaN as 0xFFFF in
    their vectorised lanes and as 0x7FC0 in their scalar tail, so a NaN's bits depend on
    where it sits in the tensor, not on the arithmetic."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return same_bits(torch.where(nan, 0.0, a), torch.where(nan, 0.0, b))


def _grads(params):
    return [p.grad for p in params if p.grad is not None]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def _loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)) for _ in range(n)]


def _rtol(dtype) -> float:
    return 1e-12 if dtype == torch.float64 else 1e-5


def _assert_norm(got: torch.Tensor, expected: float, dtype) -> None:
    if math.isnan(expected):
        assert torch.isnan(got)
    elif math.isinf(expected):
        assert torch.isinf(got) and got > 0
    else:
        assert float(got) == pytest.approx(expected, rel=_rtol(dtype), abs=1e-30)


# --------------------------------------------------------------- the buffer, memory


def test_each_gradient_is_a_view_of_one_buffer_per_dtype_and_nothing_is_copied_twice():
    params = []
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.float32, torch.bfloat16):
        params += _params(dtype, shapes=((3, 2), (4,)), seed=len(params))
    before = [p.grad.clone() for p in params]
    flat = FlatGrads(params)
    assert len(flat.buffers) == 3
    for buffer in flat.buffers:
        mine = [p for p in params if p.dtype == buffer.dtype]
        assert buffer.dim() == 1 and buffer.numel() == sum(p.numel() for p in mine)
        assert {_storage(p.grad) for p in mine} == {_storage(buffer)}
        # the only storage of these gradients, and exactly their size: no second copy
        assert buffer.untyped_storage().nbytes() == buffer.numel() * buffer.element_size()
        assert torch.equal(buffer, torch.cat([p.grad.reshape(-1) for p in mine]))
    for p, old in zip(params, before, strict=True):
        assert same_bits(p.grad, old)  # the values came along, bit for bit
    assert flat.numel == sum(p.numel() for p in params)
    assert {_storage(t) for t in vars(flat)["_views"]} == {_storage(b) for b in flat.buffers}


def test_missing_gradients_become_zeros_and_frozen_parameters_are_left_out():
    model = _model()
    model[1].weight.requires_grad_(False)
    flat = flatten_grads(model)
    assert model[1].weight.grad is None
    assert id(model[1].weight) not in {id(p) for p in flat.params}
    assert len(flat) == len([p for p in model.parameters() if p.requires_grad])
    assert all(torch.count_nonzero(p.grad) == 0 for p in flat.params)
    _loss(model, _batches(1)[0]).backward()
    assert model[1].weight.grad is None
    assert flat.numel == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_a_channels_last_parameter_gets_its_own_strides_and_torchs_gradient():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(conv)
    flat = flatten_grads(conv)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    conv(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert conv.weight.grad.stride() == conv.weight.stride() != ref.weight.contiguous().stride()
    assert _storage(conv.weight.grad) == _storage(flat.buffers[0])
    for p, q in zip(conv.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


# ----------------------------------------------------------- backward and zero_grad


def test_backward_accumulates_into_the_views():
    model, ref = _model(), _model()
    flat = flatten_grads(model)
    views = [p.grad for p in model.parameters()]
    for batch in _batches(2):  # no zeroing in between: the two gradients add up
        _loss(model, batch).backward()
        _loss(ref, batch).backward()
    for p, q, view in zip(model.parameters(), ref.parameters(), views, strict=True):
        assert p.grad is view
        assert torch.equal(p.grad, q.grad)
    assert torch.equal(flat.buffers[0], torch.cat([q.grad.reshape(-1) for q in ref.parameters()]))


def test_zero_grad_keeps_the_views_in_both_of_its_forms():
    model = _model()
    flat = flatten_grads(model, rebind=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    views = [p.grad for p in model.parameters()]
    _loss(model, _batches(1)[0]).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is v for p, v in zip(model.parameters(), views, strict=True))
    assert torch.count_nonzero(flat.buffers[0]) == 0
    _loss(model, _batches(1)[0]).backward()
    model[0].weight.grad = None  # a view lost by hand: flat.zero_grad() binds it again
    flat.zero_grad()
    assert all(p.grad is v for p, v in zip(model.parameters(), views, strict=True))
    assert torch.count_nonzero(flat.buffers[0]) == 0


def test_set_to_none_with_rebind_puts_each_fresh_gradient_back_into_its_view():
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(4, 3), nn.Linear(3, 2), nn.Linear(2, 2)])
    ref = copy.deepcopy(model)
    flat = flatten_grads(model)
    storage = _storage(flat.buffers[0])
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    x = torch.randn(5, 4)
    for m in (model, ref):
        m[2](m[1](m[0](x))).sum().backward()  # every layer used
    for o in (opt, ref_opt):
        o.zero_grad()  # torch's default: set_to_none=True
    for m in (model, ref):
        m[1](m[0](x)).sum().backward()  # the last layer gets no gradient this time
    for p, q in zip(model[:2].parameters(), ref[:2].parameters(), strict=True):
        assert _storage(p.grad) == storage
        assert same_bits(p.grad, q.grad)  # the fresh gradient, copied bit for bit
    for p, q in zip(model[2].parameters(), ref[2].parameters(), strict=True):
        assert q.grad is None  # torch: no gradient; flat mode: zeros, in the view
        assert _storage(p.grad) == storage and torch.count_nonzero(p.grad) == 0
    assert all(_storage(p.grad) == storage for p in model.parameters())
    assert flat.buffers[0].untyped_storage().nbytes() == flat.numel * 4


@pytest.mark.parametrize(
    "call",
    [
        lambda f: gradlab.get_total_norm(f),
        lambda f: gradlab.clip_grad_norm_(f, 1.0),
        lambda f: gradlab.clip_grads_with_norm_(f, 1.0, torch.tensor(2.0)),
        lambda f: gradlab.clip_grad_value_(f, 1.0),
        lambda f: gradlab.grad_ignore_norm_(f, 1.0),
        lambda f: gradlab.grad_ignore_with_norm_(f, 1.0, torch.tensor(2.0)),
        lambda f: gradlab.grad_ignore_value_(f, 1.0),
    ],
)
def test_set_to_none_without_rebind_is_refused_with_the_fix(call):
    model = _model()
    flat = flatten_grads(model, rebind=False)
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()
    _loss(model, _batches(1)[0]).backward()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"set_to_none=True.*set_to_none=False.*flat\.zero_grad"):
        call(flat)
    for p, old in zip(model.parameters(), before, strict=True):
        assert same_bits(p.grad, old)
    flat.zero_grad()  # the fix named: the views are back, and zeroed
    assert float(gradlab.get_total_norm(flat)) == 0.0


def test_set_to_none_and_no_backward_since_is_refused_not_read_stale():
    model = _model()
    flat = flatten_grads(model)
    _loss(model, _batches(1)[0]).backward()
    model.zero_grad()  # the buffer still holds the old values
    with pytest.raises(ValueError, match="Run a backward first"):
        gradlab.clip_grad_norm_(flat, 1.0)
    _loss(model, _batches(1)[0]).backward()
    assert gradlab.get_total_norm(flat) > 0


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_backward_is_refused_by_the_rebind_hook():
    model = _model()
    flatten_grads(model)
    model.zero_grad()
    with pytest.raises(RuntimeError, match="create_graph=True"):
        _loss(model, _batches(1)[0]).backward(create_graph=True)


def test_a_model_cast_after_flattening_is_refused():
    model = _model()
    flat = flatten_grads(model)
    model.double()
    with pytest.raises(ValueError, match=r"again after model\.to"):
        gradlab.get_total_norm(flat)


def test_remove_leaves_ordinary_gradients_and_refuses_further_use():
    model = _model()
    flat = flatten_grads(model)
    flat.remove()
    with pytest.raises(ValueError, match="removed"):
        gradlab.get_total_norm(flat)
    model.zero_grad()
    _loss(model, _batches(1)[0]).backward()  # no hook: autograd's own tensors
    assert all(p.grad._base is None for p in model.parameters())
    assert flat_grads_of(model) is None


# ------------------------------------------------------------------------ optimizers


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_steps_on_the_views_as_on_ordinary_gradients(name, set_to_none):
    model, ref = model_for(name), model_for(name)
    flat = flatten_grads(model)
    opt, ref_opt = OPTIMIZERS[name][0](model.parameters()), OPTIMIZERS[name][0](ref.parameters())
    for x, y in batches_of(4):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=set_to_none)
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
        assert _storage(p.grad) == _storage(flat.buffers[0])
    assert _same_state(opt.state_dict(), ref_opt.state_dict())


def _same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(map(_same_state, a, b))
    return a == b


def test_lbfgs_steps_on_the_views_with_its_closure():
    model, ref = _model(), _model()
    flatten_grads(model)
    batch = _batches(1)[0]
    for m in (model, ref):
        opt = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=4)

        def closure(m=m, opt=opt):
            opt.zero_grad()
            loss = _loss(m, batch)
            loss.backward()
            return loss

        for _ in range(2):
            opt.step(closure)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_checkpoints_are_unchanged_and_a_run_resumes_exactly():
    batches = _batches(5)
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True)
    for batch in batches:
        ref_opt.zero_grad()
        _loss(ref, batch).backward()
        ref_opt.step()

    model = _model()
    flatten_grads(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    for batch in batches[:3]:
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    assert set(saved["model"]) == set(_model().state_dict())  # no gradient, no extra key
    resumed = _model(seed=9)
    resumed.load_state_dict(saved["model"])
    flatten_grads(resumed)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=0.01, fused=True)
    resumed_opt.load_state_dict(saved["opt"])
    for batch in batches[3:]:
        resumed_opt.zero_grad()
        _loss(resumed, batch).backward()
        resumed_opt.step()
    for p, q in zip(resumed.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert _same_state(resumed_opt.state_dict(), ref_opt.state_dict())


def test_deepcopy_and_pickling_a_flattened_model_work():
    model = _model()
    flatten_grads(model)
    _loss(model, _batches(1)[0]).backward()
    twin = copy.deepcopy(model)  # parameters are copied without their gradients
    assert all(p.grad is None for p in twin.parameters())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for p, q in zip(loaded.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)


# ------------------------------------------------ param groups, lookups, ownership


def test_add_param_group_is_refused_until_flattened_again():
    model = _model()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    flat = flatten_grads(opt)
    assert flat_grads_of(opt) is flat
    _loss(model, _batches(1)[0]).backward()
    opt.add_param_group({"params": list(model[3].parameters())})
    with pytest.raises(ValueError, match=r"add_param_group.*flatten_grads\(optimizer\) again"):
        gradlab.clip_grad_norm_(flat, 1.0)
    assert flat_grads_of(opt) is None  # not exactly its parameters any more
    before = [p.grad.clone() for g in opt.param_groups for p in g["params"]]
    flat2 = flatten_grads(opt)
    with pytest.raises(ValueError, match="removed"):
        gradlab.get_total_norm(flat)
    after = [p.grad for g in opt.param_groups for p in g["params"]]
    assert all(same_bits(a, b) for a, b in zip(after, before, strict=True))
    assert {_storage(g) for g in after} == {_storage(flat2.buffers[0])}
    assert flat_grads_of(opt) is flat2
    expected = math_norm(before, 2.0)
    assert float(gradlab.get_total_norm(flat2)) == pytest.approx(expected, rel=1e-6)


def test_flat_grads_of_matches_exactly_the_parameters():
    model = _model()
    flat = flatten_grads(model)
    assert flat_grads_of(model) is flat
    assert flat_grads_of(torch.optim.SGD(model.parameters(), lr=0.1)) is flat
    assert flat_grads_of(torch.optim.SGD(model[0].parameters(), lr=0.1)) is None
    assert flat_grads_of(torch.optim.SGD(_model().parameters(), lr=0.1)) is None


def test_a_partial_overlap_is_refused_and_a_wholly_contained_one_taken_over():
    model = _model()
    first = flatten_grads(model[0])
    with pytest.raises(ValueError, match="another FlatGrads"):
        flatten_grads(list(model[0].parameters())[:1])
    whole = flatten_grads(model)  # contains first: takes over
    with pytest.raises(ValueError, match="removed"):
        first.grads()
    assert flat_grads_of(model) is whole


@pytest.mark.parametrize(
    "bad, match",
    [
        (3, "iterable of tensors"),
        ([torch.ones(2, requires_grad=True) * 2], "leaf"),
        (["w"], "only tensors"),
    ],
)
def test_bad_input_is_refused_before_anything_changes(bad, match):
    with pytest.raises(ValueError, match=match):
        flatten_grads(bad)


def test_bad_arguments_of_flatten_grads():
    flat = flatten_grads(_model())
    with pytest.raises(ValueError, match="not a FlatGrads"):
        flatten_grads(flat)
    with pytest.raises(ValueError, match="rebind"):
        flatten_grads(_model(), rebind="yes")


# ------------------------------------------------------------------------- parity


def _flat_and_reference(dtype, kind, via):
    """(what to pass to gradlab, the flat parameters, independent copies for torch)."""
    params = _params(dtype, kind)
    ref = copy_params(params)
    flat = FlatGrads(params)
    return (flat if via == "flat" else params), params, ref


@pytest.mark.parametrize("via", ["flat", "list"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_norm_is_the_float64_norm_and_torchs_to_rounding(dtype, p, kind, via):
    arg, params, ref = _flat_and_reference(dtype, kind, via)
    got = gradlab.get_total_norm(arg if via == "flat" else _grads(params), p)
    expected = math_norm(_grads(ref), p)
    _assert_norm(got, expected, dtype)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    if dtype in (torch.float32, torch.float64) and p <= 4:
        torchs = torch.nn.utils.get_total_norm(_grads(ref), p)
        _assert_norm(got, float(torchs), dtype)


@pytest.mark.parametrize("via", ["flat", "list"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p", (2.0, math.inf, 100.0))
@pytest.mark.parametrize("dtype", DTYPES)
def test_clip_scales_every_entry_by_torchs_coefficient(dtype, p, kind, via):
    arg, params, ref = _flat_and_reference(dtype, kind, via)
    norm = float(math_norm(_grads(ref), p))
    max_norm = 0.5 * norm if math.isfinite(norm) else 1.0
    total = gradlab.clip_grad_norm_(arg, max_norm, p)
    _assert_norm(total, norm, dtype)
    # torch's second phase with the same norm: the same coefficient times each entry
    torch.nn.utils.clip_grads_with_norm_(ref, max_norm, total)
    for a, b in zip(params, ref, strict=True):
        assert _same(a.grad, b.grad)


@pytest.mark.parametrize("via", ["flat", "list"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_clip_grads_with_norm_is_torchs_bit_for_bit(dtype, kind, via):
    arg, params, ref = _flat_and_reference(dtype, kind, via)
    total = torch.tensor(7.25, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    gradlab.clip_grads_with_norm_(arg, 1.5, total)
    torch.nn.utils.clip_grads_with_norm_(ref, 1.5, total)
    for a, b in zip(params, ref, strict=True):
        assert _same(a.grad, b.grad)


@pytest.mark.parametrize("via", ["flat", "list"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("factor", (0.5, 2.0))
@pytest.mark.parametrize("dtype", DTYPES)
def test_ignore_zeroes_exactly_where_torchs_clip_would_rescale(dtype, factor, kind, via):
    arg, params, ref = _flat_and_reference(dtype, kind, via)
    norm = math_norm(_grads(ref), 2.0)
    max_norm = factor * norm if math.isfinite(norm) else 1.0
    total = gradlab.grad_ignore_norm_(arg, max_norm)
    probe = copy_params(ref)
    torch.nn.utils.clip_grads_with_norm_(probe, max_norm, total)
    rescaled = not all(same_bits(a.grad, b.grad) for a, b in zip(probe, ref, strict=True))
    if rescaled or not math.isfinite(norm):
        assert_all_plus_zero(params)
    else:
        assert all(same_bits(a.grad, b.grad) for a, b in zip(params, ref, strict=True))
    # the second phase, given the same norm, decides and zeroes alike
    arg2, params2, _ = _flat_and_reference(dtype, kind, via)
    gradlab.grad_ignore_with_norm_(arg2, max_norm, total)
    assert all(same_bits(a.grad, b.grad) for a, b in zip(params2, params, strict=True))


@pytest.mark.parametrize("via", ["flat", "list"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_value_functions_match_torch_and_the_exact_maximum(dtype, kind, via):
    arg, params, ref = _flat_and_reference(dtype, kind, via)
    gradlab.clip_grad_value_(arg, 0.75)
    torch.nn.utils.clip_grad_value_(ref, 0.75)
    for a, b in zip(params, ref, strict=True):
        assert _same(a.grad, b.grad)
    for clip_value in (0.5, 1e4):
        arg, params, ref = _flat_and_reference(dtype, kind, via)
        largest = gradlab.grad_ignore_value_(arg, clip_value)
        expected = math_max_abs(_grads(ref))
        if kind == "nan":
            assert torch.isnan(largest)
        else:
            assert float(largest) == expected
        if kind == "nan" or not expected < clip_value:
            assert_all_plus_zero(params)
        else:
            assert all(same_bits(a.grad, b.grad) for a, b in zip(params, ref, strict=True))


def test_error_if_nonfinite_raises_before_any_gradient_changes():
    params = _params(torch.float32, "nan")
    flat = FlatGrads(params)
    before = [p.grad.clone() for p in params]
    for call in (gradlab.clip_grad_norm_, gradlab.grad_ignore_norm_):
        with pytest.raises(RuntimeError, match="non-finite"):
            call(flat, 1.0, error_if_nonfinite=True)
    assert all(same_bits(p.grad, b) for p, b in zip(params, before, strict=True))


# ------------------------------------------------- subsets, duplicates, mixtures


@pytest.mark.parametrize("pick, runs", [(slice(None, None, 2), 4), (slice(2, 6), 1)])
def test_a_subset_of_the_parameters_touches_only_its_regions(pick, runs):
    params = _params(torch.float32, shapes=((4,), (3, 2), (5,), (2,), (6,), (3,), (4,)))
    FlatGrads(params)
    subset, rest = params[pick], [p for p in params if all(p is not q for q in params[pick])]
    ref_subset, rest_before = copy_params(subset), [p.grad.clone() for p in rest]
    merged = coalesce(_grads(subset))
    assert isinstance(merged, FlatRuns) and len(merged) == runs
    assert sum(r.numel() for r in merged) == sum(p.numel() for p in subset)
    norm = math_norm(_grads(subset), 2.0)
    total = gradlab.clip_grad_norm_(subset, 0.5 * norm)
    assert float(total) == pytest.approx(norm, rel=1e-6)
    torch.nn.utils.clip_grads_with_norm_(ref_subset, 0.5 * norm, total)
    assert all(same_bits(a.grad, b.grad) for a, b in zip(subset, ref_subset, strict=True))
    assert all(same_bits(p.grad, b) for p, b in zip(rest, rest_before, strict=True))


def test_a_parameter_given_twice_counts_twice_as_in_torch():
    params = _params(torch.float32, shapes=((4,), (3,)))
    FlatGrads(params)
    twice = [params[0], params[1], params[0]]
    ref = copy_params(params)
    ref_twice = [ref[0], ref[1], ref[0]]
    assert coalesce(_grads(twice)) == _grads(twice)  # not merged: per-tensor semantics
    n = gradlab.clip_grad_norm_(twice, 0.1)
    m = torch.nn.utils.clip_grad_norm_(ref_twice, 0.1)
    assert same_bits(n, m)
    assert all(same_bits(a.grad, b.grad) for a, b in zip(params, ref, strict=True))


def test_flat_and_ordinary_gradients_together():
    params = _params(torch.float32, shapes=((4,), (3, 2), (5,)))
    FlatGrads(params[:2])
    ref = copy_params(params)
    merged = coalesce(_grads(params))
    assert len(merged) == 2 and merged[1] is params[2].grad
    total = gradlab.clip_grad_norm_(params, 1.0)
    assert float(total) == pytest.approx(math_norm(_grads(ref), 2.0), rel=1e-6)
    torch.nn.utils.clip_grads_with_norm_(ref, 1.0, total)
    assert all(same_bits(a.grad, b.grad) for a, b in zip(params, ref, strict=True))


def test_views_of_a_buffer_of_yours_are_merged_without_a_flatgrads():
    buffer = torch.randn(20)
    params = [nn.Parameter(torch.zeros(n)) for n in (5, 3, 12)]
    ref = copy_params(params)
    offset = 0
    for p, q in zip(params, ref, strict=True):
        p.grad = buffer[offset : offset + p.numel()]
        q.grad = p.grad.clone()
        offset += p.numel()
    merged = coalesce(_grads(params))
    assert len(merged) == 1 and _storage(merged[0]) == _storage(buffer)
    expected = math_norm(_grads(ref), 2.0)
    total = gradlab.clip_grad_norm_(params, 1.0)
    assert float(total) == pytest.approx(expected, rel=1e-6)
    torch.nn.utils.clip_grads_with_norm_(ref, 1.0, total)
    assert all(same_bits(a.grad, b.grad) for a, b in zip(params, ref, strict=True))


class _NoAccess(list):
    def __iter__(self):
        raise AssertionError("the fast path walked the parameters")

    def __getitem__(self, i):
        raise AssertionError("the fast path read a parameter")


def test_the_fast_path_reads_no_parameter_beyond_its_checks():
    params = _params(torch.float32)
    flat = FlatGrads(params)
    ref = copy_params(params)
    flat._params = _NoAccess(flat._params)  # the first and last are held as heads
    total = gradlab.clip_grad_norm_(flat, 1.0)
    gradlab.clip_grads_with_norm_(flat, 1.0, total)
    gradlab.grad_ignore_norm_(flat, 1e9)
    gradlab.grad_ignore_with_norm_(flat, 1e9, total)
    gradlab.clip_grad_value_(flat, 1e9)
    gradlab.grad_ignore_value_(flat, 1e9)
    torch.nn.utils.clip_grads_with_norm_(ref, 1.0, total)
    torch.nn.utils.clip_grads_with_norm_(ref, 1.0, total)
    assert all(same_bits(a.grad, b.grad) for a, b in zip(params, ref, strict=True))


# -------------------------------------------------------------------- torch.compile


@pytest.fixture
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("_fresh_dynamo")
def test_a_compiled_model_accumulates_into_the_views():
    model, ref = _model(), _model()
    compiled = torch.compile(model, backend="aot_eager")
    flat = flatten_grads(compiled)
    for m in (compiled, ref):
        for batch in _batches(2):
            m.zero_grad()
            _loss(m, batch).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert _storage(p.grad) == _storage(flat.buffers[0])
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.usefixtures("_fresh_dynamo")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_the_functions_compile_with_fullgraph_on_a_flatgrads(backend):
    params = _params(torch.float32)
    flat = FlatGrads(params)
    eager_params = copy_params(params)
    eager_flat = FlatGrads(eager_params)

    def step(f):
        norm = gradlab.clip_grad_norm_(f, 1.0)
        gradlab.grad_ignore_norm_(f, 1e9)
        gradlab.clip_grad_value_(f, 1e9)
        return norm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.compile(step, fullgraph=True, backend=backend)(flat)
    want = step(eager_flat)
    assert same_bits(got, want)
    assert all(same_bits(a.grad, b.grad) for a, b in zip(params, eager_params, strict=True))


# ---------------------------------------------------------- StepGuard and step_if_


def _corrupted(batches):
    x, y = batches[2]
    return [*batches[:2], (x, y * 1e4), *batches[3:]]


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_a_guard_skips_exactly_on_flat_gradients(fused, sync):
    """The run with the bad batch skipped is the run that never saw it, bit for bit."""
    batches = _batches(5)
    model, ref = _model(), _model()
    flatten_grads(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=fused)
    guard = gradlab.StepGuard(opt, "skip", threshold=50.0, sync=sync)
    decisions = []
    for batch in _corrupted(batches):
        opt.zero_grad()
        _loss(model, batch).backward()
        decisions.append(guard.step().decision)
    for i, batch in enumerate(batches):
        if i != 2:
            ref_opt.zero_grad()
            _loss(ref, batch).backward()
            ref_opt.step()
    assert decisions == ["kept", "kept", "skipped", "kept", "kept"]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
        assert p.grad._base is not None  # still the views
    assert _same_state(opt.state_dict(), ref_opt.state_dict())


def test_a_guard_clips_flat_gradients_as_torch_clips():
    batches = _corrupted(_batches(4))
    model, ref = _model(), _model()
    flatten_grads(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    guard = gradlab.StepGuard(opt, "clip", threshold=1.0)
    for batch in batches:
        opt.zero_grad()
        _loss(model, batch).backward()
        record = guard.step()
        ref_opt.zero_grad()
        _loss(ref, batch).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        assert record.total_norm == pytest.approx(float(norm), rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)  # norms differ by rounding only


def test_step_if_on_flat_gradients_leaves_no_trace_when_false():
    model, ref = _model(), _model()
    flatten_grads(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True)
    for i, batch in enumerate(_batches(4)):
        opt.zero_grad()
        _loss(model, batch).backward()
        keep = gradlab.keep_by_norm(gradlab.get_total_norm(flat_grads_of(opt)), 1e9)
        gradlab.step_if_(opt, keep & torch.tensor(i != 1), sync=False)
        if i != 1:
            ref_opt.zero_grad()
            _loss(ref, batch).backward()
            ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert _same_state(opt.state_dict(), ref_opt.state_dict())


# -------------------------------------------------------------------- GradScaler, CUDA


def test_gradscaler_unscales_the_views_in_place():
    batches = _batches(3)
    model, ref = _model(), _model()
    flat = flatten_grads(model)
    runs = []
    for m, f in ((model, flat), (ref, None)):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        for batch in batches:
            opt.zero_grad()
            scaler.scale(_loss(m, batch)).backward()
            scaler.unscale_(opt)
            if f is None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            else:
                gradlab.clip_grad_norm_(f, 0.5)
            scaler.step(opt)
            scaler.update()
        runs.append(m)
    for p, q in zip(runs[0].parameters(), runs[1].parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)
        assert _storage(p.grad) == _storage(flat.buffers[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_one_buffer_and_torchs_results(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(40)]).to("cuda", dtype)
    ref = copy.deepcopy(model)
    flat = flatten_grads(model)
    x = torch.randn(8, 16, device="cuda", dtype=dtype)
    for m in (model, ref):
        m(x).float().square().sum().backward()
    assert len(flat.buffers) == 1 and flat.buffers[0].is_cuda
    expected = math_norm([q.grad for q in ref.parameters()], 2.0)
    total = gradlab.clip_grad_norm_(flat, 0.5 * expected)
    assert float(total) == pytest.approx(expected, rel=1e-5)
    torch.nn.utils.clip_grads_with_norm_(ref.parameters(), 0.5 * expected, total)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert _same(p.grad, q.grad)
