"""The exercise checks accept correct answers and reject the typical wrong ones.

Each check is run on a correct solution written here (independently of gradlab), on
gradlab's and torch's own functions where they fit the contract, and on the
mistakes students actually make. The verdicts must be deterministic plain text.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from verdicts import assert_fails, assert_passes, run

import gradlab
from gradlab.sync import HostReadCounter
from gradlab_book import exercises as ex
from gradlab_book import exercises_training as ext

# ------------------------------------------------------------ correct answers


def ref_total_norm(tensors, norm_type=2.0):
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if norm_type == math.inf:  # the inf norm of an empty tensor raises; it adds nothing
        tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return torch.tensor(0.0)
    norms = [torch.linalg.vector_norm(t.double(), norm_type) for t in tensors]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _plist(parameters):
    """A list of the parameters; one bare tensor, as torch.nn.utils allows, too."""
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _grads(parameters):
    return [p.grad for p in _plist(parameters) if p.grad is not None]


def ref_clip_grad_norm_(parameters, max_norm, norm_type=2.0):
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


def ref_clip_grad_value_(parameters, clip_value):
    for g in _grads(parameters):
        g.clamp_(-clip_value, clip_value)


def _norm_dtype(grads):
    return torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32


def _zero_unless(keep, grads):
    # keep is a 0-dim bool tensor: decided and applied on the device, no host read
    for g in grads:
        g.copy_(torch.where(keep, g, torch.zeros_like(g)))


def _ignore_over(grads, total, max_norm):
    # the chapter's rule, keep if max_norm / (total + 1e-6) >= 1, in total's dtype
    _zero_unless(max_norm / (total + 1e-6) >= 1.0, grads)


def ref_grad_ignore_norm_(parameters, max_norm, norm_type=2.0):
    # The rule in the norm's dtype (float32 unless a gradient is float64), as gradlab
    # documents it: in float32, (30, 40) at max_norm 50 is kept (50 + 1e-6 == 50).
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type).to(_norm_dtype(grads))
    _ignore_over(grads, total, max_norm)
    return total


def ref_grad_ignore_value_(parameters, clip_value):
    grads = _grads(parameters)
    largest = ref_total_norm(grads, math.inf)
    keep = largest < clip_value
    for g in grads:
        g.masked_fill_(~keep, 0.0)
    return largest


def _keep(total, max_norm):
    """The rule of the chapter, decided on the device: finite and within, with the 1e-6."""
    return torch.isfinite(total) & (max_norm / (total + 1e-6) >= 1.0)


def ref_clip_and_count_(parameters, clip_value):
    grads = _grads(parameters)
    entries = sum(g.numel() for g in grads)  # shapes only: no host read
    if not entries:
        return torch.tensor(0.0)
    changed = torch.stack([(g.abs() > clip_value).sum() for g in grads]).sum()
    for g in grads:
        g.clamp_(-clip_value, clip_value)
    return changed / entries


def ref_guarded_step(parameters, optimizer, max_norm):
    total = ref_total_norm(_grads(parameters), 2.0)
    if bool(_keep(total, max_norm)):  # the one host read
        optimizer.step()
        return True
    return False


# ------------------------------------------------------------ accepted answers


@pytest.mark.parametrize(
    "check, fn",
    [
        (ex.check_total_norm, ref_total_norm),
        (ex.check_total_norm, gradlab.get_total_norm),
        (ex.check_clip_grad_norm, ref_clip_grad_norm_),
        (ex.check_clip_grad_norm, gradlab.clip_grad_norm_),
        (ex.check_clip_grad_value, ref_clip_grad_value_),
        (ex.check_clip_and_count, ref_clip_and_count_),
        (ex.check_clip_grad_value, gradlab.clip_grad_value_),
        (ex.check_grad_ignore_norm, ref_grad_ignore_norm_),
        (ex.check_grad_ignore_norm, gradlab.grad_ignore_norm_),
        (ex.check_grad_ignore_value, ref_grad_ignore_value_),
        (ex.check_grad_ignore_value, gradlab.grad_ignore_value_),
        (ext.check_guarded_step, ref_guarded_step),
    ],
    ids=lambda x: getattr(x, "__qualname__", str(x)),
)
def test_accepts_correct_answers(check, fn, capsys):
    assert_passes(check, fn, capsys)


def test_torch_clip_grad_value_fails_only_on_no_gradients(capsys):
    # torch.nn.utils.clip_grad_value_ (foreach path) raises when there is no gradient
    # at all; the check reports that as the case it is, not as a crash of the check.
    verdict, out = run(ex.check_clip_grad_value, torch.nn.utils.clip_grad_value_, capsys)
    if not verdict:
        assert "neither has a gradient" in out
        assert "Your function raised RuntimeError" in out


def test_output_is_deterministic_and_clean(capsys):
    outs = []
    for _ in range(2):
        ex.check_grad_ignore_norm(_nan_hole_mask)
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert not re.search(r"0x[0-9a-f]{6,}", outs[0])
    assert "grad_fn" not in outs[0]
    # The reference is never shown as source code.
    assert "def " not in outs[0] and "return" not in outs[0]


def test_host_read_detector_leaves_tensor_methods_alone():
    tolist, numpy = torch.Tensor.tolist, torch.Tensor.numpy
    ex.check_grad_ignore_norm(_ignore_norm_item)
    assert torch.Tensor.tolist is tolist and torch.Tensor.numpy is numpy
    assert torch.tensor([1.0]).tolist() == [1.0]


def _ignore_norm_mask_assign(parameters, max_norm, norm_type=2.0):
    # Right values, but a boolean mask becomes indices on the host first.
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type)
    keep = max_norm / (total + 1e-6) >= 1.0
    for g in grads:
        g[(~keep).expand(g.shape)] = 0.0
    return total


def _right_but_reading_through(read):
    def answer(parameters, max_norm, norm_type=2.0):
        total = ref_grad_ignore_norm_(list(parameters), max_norm, norm_type)
        read(total)
        return total

    return answer


@pytest.mark.parametrize(
    ("answer", "operation"),
    [
        (
            _ignore_norm_mask_assign,
            "assignment t[...] = ... (aten.index_put_.default with a boolean mask)",
        ),
        (_right_but_reading_through(lambda t: t.reshape(1)[t.reshape(1) > 0]), "boolean mask"),
        (_right_but_reading_through(lambda t: torch.equal(t, t)), "torch.equal"),
        (_right_but_reading_through(lambda t: torch.allclose(t, t)), "torch.allclose"),
        (_right_but_reading_through(lambda t: bool(t > 0)), "bool(t)"),
        (_right_but_reading_through(lambda t: t.tolist()), "Tensor.tolist()"),
        (_right_but_reading_through(lambda t: t.numpy()), "Tensor.numpy()"),
        (_right_but_reading_through(np.asarray), "__array__"),
        (_right_but_reading_through(print), "printing a tensor"),
        (_right_but_reading_through(lambda t: t.reshape(1).nonzero()), "nonzero"),
        (_right_but_reading_through(lambda t: torch.unique(t)), "torch.unique"),
        (_right_but_reading_through(lambda t: t.masked_select(t > 0)), "masked_select"),
    ],
)
def test_an_answer_that_reads_the_host_is_rejected_naming_the_read(answer, operation, capsys):
    assert ex.check_grad_ignore_norm(answer) is False
    out = capsys.readouterr().out
    verdict = out.splitlines()[-1]
    assert verdict.startswith("Your function reads a tensor value on the host, through ")
    assert operation in verdict


# ------------------------------------------------------------ not implemented


def _stub(*args, **kwargs):
    raise NotImplementedError


@pytest.mark.parametrize(
    "check",
    [
        ex.check_total_norm,
        ex.check_clip_grad_norm,
        ex.check_clip_grad_value,
        ex.check_clip_and_count,
        ex.check_grad_ignore_norm,
        ex.check_grad_ignore_value,
        ext.check_guarded_step,
    ],
)
def test_not_implemented_is_reported(check, capsys):
    out = assert_fails(check, _stub, capsys, "Not implemented yet")
    assert "Case" not in out


def test_not_a_function(capsys):
    assert_fails(ex.check_clip_grad_norm, 3.0, capsys, "Expected a function")


def test_exception_is_reported_with_the_call(capsys):
    def boom(parameters, max_norm, norm_type=2.0):
        raise ValueError("bad things")

    assert_fails(
        ex.check_grad_ignore_norm,
        boom,
        capsys,
        "Case 1 of",
        "Your function raised ValueError: bad things",
        "fn(parameters, max_norm=10, norm_type=2)",
    )


def test_wrong_signature_is_reported(capsys):
    def no_norm_type(parameters, max_norm):
        return ref_grad_ignore_norm_(parameters, max_norm)

    assert_fails(ex.check_grad_ignore_norm, no_norm_type, capsys, "raised TypeError")


# ------------------------------------------------------------ ignore by norm


def _nan_hole_mask(parameters, max_norm, norm_type=2.0):
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type)
    keep = (total <= max_norm).to(torch.float32)
    for g in grads:
        g.mul_(keep.to(g.dtype))  # NaN * 0 is NaN
    return total


def _nan_hole_if(parameters, max_norm, norm_type=2.0):
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type)
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for g in grads:
            g.zero_()
    return total


def _nan_hole_where_gt(parameters, max_norm, norm_type=2.0):
    # Device-side, but "ignore if total > max_norm" is False for NaN: NaN stays.
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type)
    for g in grads:
        g.copy_(torch.where(total > max_norm, torch.zeros_like(g), g))
    return total


def _ignore_norm_some_tensors(parameters, max_norm, norm_type=2.0):
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type)
    _ignore_over([grads[0]], total, max_norm)
    return total


def _ignore_norm_per_tensor(parameters, max_norm, norm_type=2.0):
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type)
    for g in grads:  # each tensor by its own norm
        _ignore_over([g], torch.linalg.vector_norm(g, norm_type), max_norm)
    return total


def _ignore_norm_none_crash(parameters, max_norm, norm_type=2.0):
    params = _plist(parameters)
    grads = [p.grad for p in params]
    total = ref_total_norm(grads, norm_type)  # crashes on None
    _ignore_over(grads, total, max_norm)
    return total


def _ignore_norm_none_to_zero(parameters, max_norm, norm_type=2.0):
    params = _plist(parameters)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return ref_grad_ignore_norm_(params, max_norm, norm_type)


def _ignore_norm_item(parameters, max_norm, norm_type=2.0):
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type)
    keep = math.isfinite(total.item()) and max_norm / (total.item() + 1e-6) >= 1
    if not keep:
        for g in grads:
            g.zero_()
    return total


def _ignore_norm_tolist(parameters, max_norm, norm_type=2.0):
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type)
    value = total.reshape(1).tolist()[0]
    keep = value == value and max_norm / (value + 1e-6) >= 1
    if not keep:
        for g in grads:
            g.zero_()
    return total


def _ignore_norm_empty_crash(parameters, max_norm, norm_type=2.0):
    grads = _grads(parameters)
    flat = torch.cat([g.reshape(-1).double() for g in grads])  # fails on []
    total = torch.linalg.vector_norm(flat, norm_type)
    _ignore_over(grads, total, max_norm)
    return total


def _ignore_norm_generator_twice(parameters, max_norm, norm_type=2.0):
    total = ref_total_norm(_grads(parameters), norm_type)
    _ignore_over(_grads(parameters), total, max_norm)  # a generator is empty by now
    return total


def _ignore_norm_returns_after(parameters, max_norm, norm_type=2.0):
    params = _plist(parameters)
    ref_grad_ignore_norm_(params, max_norm, norm_type)
    return ref_total_norm(_grads(params), norm_type)


def _ignore_norm_returns_nothing(parameters, max_norm, norm_type=2.0):
    ref_grad_ignore_norm_(parameters, max_norm, norm_type)


def _ignore_norm_always_2(parameters, max_norm, norm_type=2.0):
    return ref_grad_ignore_norm_(parameters, max_norm, 2.0)


def _ignore_norm_clips(parameters, max_norm, norm_type=2.0):
    return ref_clip_grad_norm_(parameters, max_norm, norm_type)


def _ignore_norm_touches_params(parameters, max_norm, norm_type=2.0):
    params = _plist(parameters)
    total = ref_grad_ignore_norm_(params, max_norm, norm_type)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.sub_(p.grad)
    return total


def _ignore_norm_keep_if_le(parameters, max_norm, norm_type=2.0):
    # Right in every other way, but "keep if the norm <= max_norm": no 1e-6.
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type).to(_norm_dtype(grads))
    _zero_unless(total <= max_norm, grads)
    return total


def _ignore_norm_decides_in_float64(parameters, max_norm, norm_type=2.0):
    # The chapter's rule, but evaluated in float64 for float32 gradients.
    grads = _grads(parameters)
    total64 = ref_total_norm(grads, norm_type)
    _ignore_over(grads, total64, max_norm)
    return total64.to(_norm_dtype(grads))


def _norms_in_16_bits(grads, norm_type):
    # Per-tensor norms left in the gradients' dtype (as torch.nn.utils keeps them),
    # then widened and combined: the total comes back in float32.
    if not grads:
        return torch.tensor(0.0)
    norms = [torch.linalg.vector_norm(g, norm_type).to(_norm_dtype(grads)) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _ignore_norm_norms_in_16_bits(parameters, max_norm, norm_type=2.0):
    grads = _grads(parameters)
    total = _norms_in_16_bits(grads, norm_type)
    _ignore_over(grads, total, max_norm)
    return total


def _drops_missing_from_the_callers_list(reference):
    def answer(parameters, threshold, *args, **kwargs):
        if isinstance(parameters, list):  # "tidy up" the caller's list in place
            parameters[:] = [p for p in parameters if p.grad is not None]
        return reference(parameters, threshold, *args, **kwargs)

    answer.__name__ = f"{reference.__name__}_drops_from_the_list"
    return answer


@pytest.mark.parametrize(
    "fn, fragments",
    [
        (
            _ignore_norm_keep_if_le,
            ["(3, 4): total 2-norm 5, exactly the threshold 5", "The rule is strict"],
        ),
        (
            _ignore_norm_decides_in_float64,
            ["(30, 40): total 2-norm 50", "expected gradients: [[30, 40]]", "in float32"],
        ),
        (_ignore_norm_norms_in_16_bits, ["two float16 tensors", "expected return value"]),
        (
            _drops_missing_from_the_callers_list(ref_grad_ignore_norm_),
            ["no gradient (None)", "changed the list it was given: it now holds 2 items"],
        ),
        (_nan_hole_mask, ["one entry is NaN", "nan", "NaN * 0 is NaN"]),
        (_nan_hole_if, ["reads a tensor value on the host"]),
        (_nan_hole_where_gt, ["one entry is NaN", "your gradients:"]),
        (_ignore_norm_some_tensors, ["three tensors", "over", "every tensor is affected"]),
        (_ignore_norm_per_tensor, ["Case", "expected gradients:"]),
        (_ignore_norm_none_crash, ["no gradient (None)", "Your function raised"]),
        (_ignore_norm_none_to_zero, ["no gradient (None)", "None"]),
        (_ignore_norm_item, ["Case 1 of", "reads a tensor value on the host"]),
        (_ignore_norm_tolist, ["reads a tensor value on the host"]),
        (_ignore_norm_empty_crash, ["neither has a gradient", "Your function raised ValueError"]),
        (_ignore_norm_generator_twice, ["generator", "one pass"]),
        (_ignore_norm_returns_after, ["expected return value", "the total norm before"]),
        (_ignore_norm_returns_nothing, ["your return value:     None"]),
        (_ignore_norm_always_2, ["norm_type=1"]),
        (_ignore_norm_clips, ["over the threshold", "expected gradients: [[0, 0]]"]),
        (_ignore_norm_touches_params, ["changed the values of parameter 0"]),
        (lambda ps, m, norm_type=2.0: ref_grad_ignore_norm_(list(ps), m), ["one bare tensor"]),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_ignore_norm_rejects(fn, fragments, capsys):
    assert_fails(ex.check_grad_ignore_norm, fn, capsys, *fragments)


def test_failure_report_shows_input_expected_and_got(capsys):
    out = assert_fails(ex.check_grad_ignore_norm, _ignore_norm_clips, capsys)
    assert out.splitlines()[:5] == [
        "Case 2 of 32 fails: one tensor, total 2-norm 5, over the threshold; "
        "one bare tensor, not in a list (as torch.nn.utils accepts).",
        "  call:              fn(parameters, max_norm=2, norm_type=2)",
        "  gradients before:  [[3, -4]]",
        "  expected gradients: [[0, 0]]",
        "  your gradients:     [[1.2, -1.6]]",
    ]


# ------------------------------------------------------------ clip by norm


def _clip_norm_returns_after(parameters, max_norm, norm_type=2.0):
    params = _plist(parameters)
    ref_clip_grad_norm_(params, max_norm, norm_type)
    return ref_total_norm(_grads(params), norm_type)


def _clip_norm_if(parameters, max_norm, norm_type=2.0):
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type)
    if total > max_norm:
        for g in grads:
            g.mul_(max_norm / (total + 1e-6))
    return total


def _clip_norm_no_eps_min(parameters, max_norm, norm_type=2.0):
    # Python min() compares tensors on the host.
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type)
    coef = min(1.0, max_norm / (total + 1e-6))
    for g in grads:
        g.mul_(coef)
    return total


def _clip_norm_per_tensor(parameters, max_norm, norm_type=2.0):
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type)
    for g in grads:
        n = torch.linalg.vector_norm(g, norm_type)
        g.mul_(torch.clamp(max_norm / (n + 1e-6), max=1.0))
    return total


def _clip_norm_where_keeps_nan(parameters, max_norm, norm_type=2.0):
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type)
    coef = max_norm / (total + 1e-6)
    for g in grads:
        g.copy_(torch.where(coef < 1, g * coef, g))
    return total


def _clip_norm_first_only(parameters, max_norm, norm_type=2.0):
    grads = _grads(parameters)
    total = ref_total_norm(grads, norm_type)
    grads[0].mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def _clip_norm_none_crash(parameters, max_norm, norm_type=2.0):
    grads = [p.grad for p in _plist(parameters)]
    total = ref_total_norm(grads, norm_type)
    for g in grads:
        g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def _clip_norm_generator_twice(parameters, max_norm, norm_type=2.0):
    total = ref_total_norm(_grads(parameters), norm_type)
    for g in _grads(parameters):
        g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def _clip_norm_norms_in_16_bits(parameters, max_norm, norm_type=2.0):
    grads = _grads(parameters)
    total = _norms_in_16_bits(grads, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def _torch_clip_norm_gradients(parameters, max_norm, norm_type=2.0):
    # torch.nn.utils.clip_grad_norm_'s gradients, with gradlab's float32 norm returned:
    # only the chapter's overflow case is left to catch it.
    params = _plist(parameters)
    total = gradlab.get_total_norm([p.grad for p in params if p.grad is not None], norm_type)
    torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    return total


@pytest.mark.parametrize(
    "fn, fragments",
    [
        (
            torch.nn.utils.clip_grad_norm_,
            ["two float16 tensors", "in float32", "your return value:     tensor(2.926) (float16)"],
        ),
        (
            _torch_clip_norm_gradients,
            [
                "one float16 tensor of 10000 entries of 1000: total 2-norm 1e5",
                "largest |entry| 0.01",
                "largest |entry| 0>",
                "gets inf and zeroes every gradient",
            ],
        ),
        (_clip_norm_norms_in_16_bits, ["two float16 tensors", "expected return value"]),
        (
            _drops_missing_from_the_callers_list(ref_clip_grad_norm_),
            ["no gradient (None)", "changed the list it was given", "it may be an optimizer's"],
        ),
        (_clip_norm_returns_after, ["expected return value", "before clipping"]),
        (_clip_norm_if, ["reads a tensor value on the host"]),
        (_clip_norm_no_eps_min, ["reads a tensor value on the host"]),
        (_clip_norm_per_tensor, ["three tensors", "expected gradients:"]),
        (_clip_norm_where_keeps_nan, ["NaN", "torch.nn.utils.clip_grad_norm_"]),
        (_clip_norm_first_only, ["every tensor is affected"]),
        (ref_grad_ignore_norm_, ["over the threshold", "expected gradients: [[1.2, -1.6]]"]),
        (_clip_norm_none_crash, ["no gradient (None)", "Your function raised"]),
        (_clip_norm_generator_twice, ["generator", "one pass"]),
        (lambda ps, m, norm_type=2.0: ref_clip_grad_norm_(list(ps), m), ["one bare tensor"]),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_clip_norm_rejects(fn, fragments, capsys):
    assert_fails(ex.check_clip_grad_norm, fn, capsys, *fragments)


# ------------------------------------------------------------ by value


def _ignore_value_gt(parameters, clip_value):
    grads = _grads(parameters)
    largest = ref_total_norm(grads, math.inf)
    ignore = ~(largest <= clip_value)  # '>' instead of '>=', written NaN-safely
    for g in grads:
        g.masked_fill_(ignore, 0.0)
    return largest


def _ignore_value_mask_mul(parameters, clip_value):
    grads = _grads(parameters)
    largest = ref_total_norm(grads, math.inf)
    keep = (largest < clip_value).to(torch.float32)
    for g in grads:
        g.mul_(keep.to(g.dtype))
    return largest


def _ignore_value_per_tensor(parameters, clip_value):
    grads = _grads(parameters)
    largest = ref_total_norm(grads, math.inf)
    for g in grads:
        g.masked_fill_(~(g.abs().amax() < clip_value), 0.0)
    return largest


def _ignore_value_item(parameters, clip_value):
    grads = _grads(parameters)
    largest = ref_total_norm(grads, math.inf)
    if not largest.item() < clip_value:
        for g in grads:
            g.zero_()
    return largest


def _ignore_value_none_crash(parameters, clip_value):
    grads = [p.grad for p in _plist(parameters)]
    largest = torch.stack([g.abs().amax() for g in grads]).amax()
    for g in grads:
        g.masked_fill_(~(largest < clip_value), 0.0)
    return largest


def _ignore_value_empty_crash(parameters, clip_value):
    grads = _grads(parameters)
    largest = torch.stack([g.abs().amax() for g in grads]).amax()
    keep = largest < clip_value
    for g in grads:
        g.masked_fill_(~keep, 0.0)
    return largest


def _ignore_value_old_solution(parameters, clip_value):
    # the chapter's first published solution: .max() of an empty gradient raises, and
    # the dtype of the first gradient (float32) rounds a float64 1 - 1e-9 up to 1
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    wide = torch.promote_types(grads[0].dtype, torch.float32)
    largest = torch.stack([g.abs().max().to(wide) for g in grads]).max()
    keep = largest.double() < clip_value
    for g in grads:
        g.copy_(torch.where(keep, g, torch.zeros_like(g)))
    return largest


def _ignore_value_first_dtype(parameters, clip_value):
    # empty gradients handled, but the comparison is in the first gradient's dtype
    grads = [g for g in _grads(parameters) if g.numel() > 0]
    if not grads:
        return torch.tensor(0.0)
    wide = torch.promote_types(grads[0].dtype, torch.float32)
    largest = torch.stack([g.abs().max().to(wide) for g in grads]).max()
    for g in _grads(parameters):
        g.copy_(torch.where(largest.double() < clip_value, g, torch.zeros_like(g)))
    return largest


def _ignore_value_no_bare_tensor(parameters, clip_value):
    return ref_grad_ignore_value_(list(parameters), clip_value)


@pytest.mark.parametrize(
    "fn, fragments",
    [
        (_ignore_value_old_solution, ["has no entries", "Your function raised RuntimeError"]),
        (_ignore_value_first_dtype, ["1 - 1e-9", "widest dtype"]),
        (_ignore_value_no_bare_tensor, ["one bare tensor", "isinstance(parameters"]),
        (_ignore_value_gt, ["equals the threshold exactly", "(reaching the threshold counts)"]),
        (_ignore_value_mask_mul, ["one entry is NaN", "NaN * 0 is NaN"]),
        (_ignore_value_per_tensor, ["only one entry of the last tensor"]),
        (_ignore_value_item, ["reads a tensor value on the host"]),
        (_ignore_value_empty_crash, ["neither has a gradient", "Your function raised"]),
        (ref_clip_grad_value_, ["expected return value", "your return value:     None"]),
        (_ignore_value_none_crash, ["no gradient (None)", "Your function raised"]),
        (
            _drops_missing_from_the_callers_list(ref_grad_ignore_value_),
            ["no gradient (None)", "changed the list it was given"],
        ),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_ignore_value_rejects(fn, fragments, capsys):
    assert_fails(ex.check_grad_ignore_value, fn, capsys, *fragments)


def _clip_value_returns(parameters, clip_value):
    ref_clip_grad_value_(parameters, clip_value)
    return torch.tensor(0.0)


def _clip_value_none_crash(parameters, clip_value):
    for p in _plist(parameters):
        p.grad.clamp_(-clip_value, clip_value)


def _clip_value_generator_twice(parameters, clip_value):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    for p in parameters:
        if p.grad is not None:
            p.grad.clamp_(max=clip_value)
    for p in parameters:
        if p.grad is not None:
            p.grad.clamp_(min=-clip_value)


def _clip_value_positive_only(parameters, clip_value):
    for g in _grads(parameters):
        g.clamp_(max=clip_value)


def _clip_value_nan_to_zero(parameters, clip_value):
    for g in _grads(parameters):
        g.copy_(g.nan_to_num(0.0).clamp(-clip_value, clip_value))


@pytest.mark.parametrize(
    "fn, fragments",
    [
        (_clip_value_returns, ["expected return value: None", "tensor(0)"]),
        (_clip_value_none_crash, ["no gradient (None)", "raised AttributeError"]),
        (_clip_value_generator_twice, ["generator", "one pass"]),
        (_clip_value_positive_only, ["both signs"]),
        (_clip_value_nan_to_zero, ["one entry is NaN", "torch.clamp leaves a NaN entry NaN"]),
        (ref_grad_ignore_value_, ["expected return value: None"]),
        (lambda ps, c: ref_clip_grad_value_(list(ps), c), ["one bare tensor"]),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_clip_value_rejects(fn, fragments, capsys):
    assert_fails(ex.check_clip_grad_value, fn, capsys, *fragments)


def _count_after_clamping(parameters, clip_value):
    grads = _grads(parameters)
    for g in grads:
        g.clamp_(-clip_value, clip_value)
    entries = sum(g.numel() for g in grads)
    if not entries:
        return torch.tensor(0.0)
    return torch.stack([(g.abs() > clip_value).sum() for g in grads]).sum() / entries


def _count_changed_entries(parameters, clip_value):
    # g != clamped is True for NaN (NaN != NaN): a NaN entry counted as clamped
    grads = _grads(parameters)
    entries = sum(g.numel() for g in grads)
    before = [g.clone() for g in grads]
    for g in grads:
        g.clamp_(-clip_value, clip_value)
    if not entries:
        return torch.tensor(0.0)
    return torch.stack([(g != b).sum() for g, b in zip(grads, before, strict=True)]).sum() / entries


def _count_on_the_host(parameters, clip_value):
    grads = _grads(parameters)
    entries = sum(g.numel() for g in grads)
    changed = sum(int((g.abs() > clip_value).sum()) for g in grads)
    for g in grads:
        g.clamp_(-clip_value, clip_value)
    return torch.tensor(changed / entries if entries else 0.0)


def _count_mean_of_fractions(parameters, clip_value):
    grads = [g for g in _grads(parameters) if g.numel()]
    fractions = [(g.abs() > clip_value).float().mean() for g in grads]
    for g in grads:
        g.clamp_(-clip_value, clip_value)
    return torch.stack(fractions).mean() if fractions else torch.tensor(0.0)


def _count_returns_a_count(parameters, clip_value):
    grads = _grads(parameters)
    if not grads:
        return torch.tensor(0.0)
    changed = torch.stack([(g.abs() > clip_value).sum() for g in grads]).sum()
    for g in grads:
        g.clamp_(-clip_value, clip_value)
    return changed


@pytest.mark.parametrize(
    "fn, fragments",
    [
        (_count_after_clamping, ["both signs", "your return value:     tensor(0)", "before"]),
        (_count_changed_entries, ["one entry is NaN", "NaN != NaN"]),
        (_count_on_the_host, ["reads a tensor value on the host", "int(t)"]),
        (_count_mean_of_fractions, ["no gradient (None)", "tensor(0.2)"]),
        (_count_returns_a_count, ["Case 1 of", "a 0-dim floating-point tensor"]),
        (ref_clip_grad_value_, ["your return value:     None"]),
        (
            _drops_missing_from_the_callers_list(ref_clip_and_count_),
            ["no gradient (None)", "changed the list it was given"],
        ),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_clip_and_count_rejects(fn, fragments, capsys):
    assert_fails(ex.check_clip_and_count, fn, capsys, *fragments)


# ------------------------------------------------------------ total norm


def _norm_sum_of_norms(tensors, norm_type=2.0):
    return sum(torch.linalg.vector_norm(t, norm_type) for t in tensors)


def _norm_python_float(tensors, norm_type=2.0):
    return float(ref_total_norm(tensors, norm_type))


def _norm_always_2(tensors, norm_type=2.0):
    return ref_total_norm(tensors, 2.0)


def _norm_stack_empty_crash(tensors, norm_type=2.0):
    tensors = _plist(tensors)
    wide = _norm_dtype(tensors)
    norms = [torch.linalg.vector_norm(t, norm_type, dtype=wide) for t in tensors]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)  # stack([]) raises


def _norm_shape_1(tensors, norm_type=2.0):
    return ref_total_norm(tensors, norm_type).reshape(1)


def _norm_generator_twice(tensors, norm_type=2.0):
    if not list(tensors):
        return torch.tensor(0.0)
    return ref_total_norm(tensors, norm_type)


def _norm_nan_to_zero(tensors, norm_type=2.0):
    clean = [t.nan_to_num(0.0, posinf=0.0, neginf=0.0) for t in _plist(tensors)]
    return ref_total_norm(clean, norm_type)


def _norm_rewrites_nan_in_place(tensors, norm_type=2.0):
    tensors = _plist(tensors)
    total = ref_total_norm(tensors, norm_type)  # right, but then "cleans" the inputs
    for t in tensors:
        t.nan_to_num_(0.0, posinf=0.0, neginf=0.0)
    return total


def _norm_no_bare_tensor(tensors, norm_type=2.0):
    return ref_total_norm(list(tensors), norm_type)


def _norm_float16_result(tensors, norm_type=2.0):
    # accumulated in float32, but handed back in the inputs' dtype
    tensors = _plist(tensors)
    total = ref_total_norm(tensors, norm_type).float()
    return total.to(tensors[0].dtype) if tensors else total


def _norm_per_tensor_in_float16(tensors, norm_type=2.0):
    # per-tensor norms stored in the input dtype (as torch.nn.utils does), summed wide
    norms = [torch.linalg.vector_norm(t, norm_type) for t in _plist(tensors)]
    if not norms:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack([n.double() for n in norms]), norm_type)


def _norm_modifies_input(tensors, norm_type=2.0):
    tensors = list(tensors)
    for t in tensors:
        t.abs_()
    return ref_total_norm(tensors, norm_type)


def _norm_concatenated(tensors, norm_type=2.0):
    # Right values in the right dtype, through the concatenation the exercise forbids.
    tensors = _plist(tensors)
    if not tensors:
        return torch.tensor(0.0)
    wide = _norm_dtype(tensors)
    return torch.linalg.vector_norm(torch.cat([t.reshape(-1).to(wide) for t in tensors]), norm_type)


def _norm_parameters_to_vector(tensors, norm_type=2.0):
    tensors = _plist(tensors)
    if not tensors:
        return torch.tensor(0.0)
    wide = _norm_dtype(tensors)
    flat = torch.nn.utils.parameters_to_vector([t.to(wide) for t in tensors])
    return torch.linalg.vector_norm(flat, norm_type)


def _norm_widens_in_the_callers_list(tensors, norm_type=2.0):
    if isinstance(tensors, list):
        for i, t in enumerate(tensors):
            tensors[i] = t.double()  # replaces the caller's items; the tensors are intact
    return ref_total_norm(tensors, norm_type)


@pytest.mark.parametrize(
    "fn, fragments",
    [
        (_norm_concatenated, ["Case 1 of", "concatenates the tensors (torch.cat)"]),
        (_norm_parameters_to_vector, ["concatenates the tensors", "norm of those norms"]),
        (
            _norm_widens_in_the_callers_list,
            ["changed the list it was given: item 0 was replaced", "tensors = list(tensors)"],
        ),
        (_norm_sum_of_norms, ["three tensors, norm_type=2", "expected"]),
        (_norm_python_float, ["the Python number"]),
        (_norm_always_2, ["norm_type=1"]),
        (_norm_stack_empty_crash, ["empty list", "Your function raised RuntimeError"]),
        (_norm_shape_1, ["of shape (1,)"]),
        (_norm_generator_twice, ["generator", "one pass"]),
        (_norm_nan_to_zero, ["NaN"]),
        (_norm_modifies_input, ["modified tensor"]),
        (_norm_rewrites_nan_in_place, ["one entry is NaN", "modified tensor"]),
        (_norm_no_bare_tensor, ["one bare 0-dim tensor", "isinstance(tensors, torch.Tensor)"]),
        (_norm_float16_result, ["above 65504", "(float16)", "return it in float32"]),
        (_norm_per_tensor_in_float16, ["above 65504", "yours:    tensor(inf)"]),
        (torch.nn.utils.get_total_norm, ["above 65504", "tensor(inf) (float16)"]),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_total_norm_rejects(fn, fragments, capsys):
    assert_fails(ex.check_total_norm, fn, capsys, *fragments)


# ------------------------------------------------------------ guarded step


def _step_always(parameters, optimizer, max_norm):
    optimizer.step()
    return True


def _step_never(parameters, optimizer, max_norm):
    return False


def _step_zero_grads_then_step(parameters, optimizer, max_norm):
    params = _plist(parameters)
    taken = ref_grad_ignore_norm_(params, max_norm) <= max_norm
    optimizer.step()  # Adam and momentum still move on zero gradients
    return bool(taken)


def _step_nan_hole(parameters, optimizer, max_norm):
    total = ref_total_norm(_grads(parameters), 2.0)
    if total > max_norm:  # False for NaN: a NaN step is taken
        return False
    optimizer.step()
    return True


def _step_clips_instead(parameters, optimizer, max_norm):
    params = _plist(parameters)
    total = ref_clip_grad_norm_(params, max_norm)
    finite, within = torch.stack([torch.isfinite(total), _keep(total, max_norm)]).tolist()
    if not finite:
        return False
    optimizer.step()
    return within


def _step_returns_tensor_float(parameters, optimizer, max_norm):
    ref_guarded_step(parameters, optimizer, max_norm)
    return torch.tensor(1.0)


def _step_generator_twice(parameters, optimizer, max_norm):
    total = ref_total_norm(_grads(parameters), 2.0)
    if not bool(_keep(total, max_norm)):
        return False
    if not list(parameters):  # a generator is used up: wrongly skip
        return False
    optimizer.step()
    return True


@pytest.mark.parametrize(
    "fn, fragments",
    [
        (_step_always, ["must be skipped", "expected return value: False"]),
        (_step_never, ["step 1 of 9", "must be taken"]),
        (_step_zero_grads_then_step, ["must be skipped"]),
        (_step_nan_hole, ["a NaN gradient", "must be skipped"]),
        (_step_clips_instead, ["must be skipped"]),
        (_step_returns_tensor_float, ["your return value:     tensor(1)"]),
        (_step_generator_twice, ["model.parameters() (a generator)"]),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_guarded_step_rejects(fn, fragments, capsys):
    assert_fails(ext.check_guarded_step, fn, capsys, *fragments)


def _step_two_reads(parameters, optimizer, max_norm):
    # right decisions, but two host reads: the finiteness and the comparison apart
    total = ref_total_norm(_grads(parameters), 2.0)
    if bool(torch.isfinite(total)) and bool(max_norm / (total + 1e-6) >= 1.0):
        optimizer.step()
        return True
    return False


def _step_norm_then_compare(parameters, optimizer, max_norm):
    # two reads again: the norm as a float, then a tensor comparison
    total = ref_total_norm(_grads(parameters), 2.0)
    value = total.item()
    if math.isfinite(value) and bool(max_norm / (total + 1e-6) >= 1.0):
        optimizer.step()
        return True
    return False


def _step_no_epsilon(parameters, optimizer, max_norm):
    total = ref_total_norm(_grads(parameters), 2.0)
    if bool(torch.isfinite(total) & (total <= max_norm)):  # keeps a norm equal to max_norm
        optimizer.step()
        return True
    return False


def _step_strict_no_epsilon(parameters, optimizer, max_norm):
    total = ref_total_norm(_grads(parameters), 2.0)
    if bool(torch.isfinite(total) & (total < max_norm)):  # strict, but without the 1e-6
        optimizer.step()
        return True
    return False


def _step_none_grads_on_skip(parameters, optimizer, max_norm):
    params = _plist(parameters)
    if ref_guarded_step(params, optimizer, max_norm):
        return True
    for p in params:  # "clear" the bad gradient: no longer a gradient at all
        p.grad = None
    return False


@pytest.mark.parametrize(
    "fn, fragments",
    [
        (_step_two_reads, ["step 1 of 9", "read the host 2 times; 1 allowed"]),
        (_step_norm_then_compare, ["read the host 2 times", "1. "]),
        (
            _step_no_epsilon,
            ["step 6 of 9", "exactly max_norm = 5", "must be skipped", "not if norm <= max_norm"],
        ),
        (
            _step_strict_no_epsilon,
            ["step 8 of 9", "4.99999952316", "must be skipped", "not if norm < max_norm"],
        ),
        (_step_none_grads_on_skip, ["step 3 of 9", ".grad is None", "zero them in place"]),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_guarded_step_rejects_reads_boundaries_and_none(fn, fragments, capsys):
    assert_fails(ext.check_guarded_step, fn, capsys, *fragments)


def test_guarded_step_allows_the_optimizers_own_reads(capsys):
    # default Adam reads its CPU step counts itself: one more read than those is allowed
    seen = []

    def counting(parameters, optimizer, max_norm):
        with HostReadCounter() as reads:
            result = ref_guarded_step(parameters, optimizer, max_norm)
        seen.append((type(optimizer).__name__, result, reads.count))
        return result

    assert_passes(ext.check_guarded_step, counting, capsys)
    adam_taken = [n for name, taken, n in seen if name == "Adam" and taken]
    assert adam_taken and min(adam_taken) > 1  # Adam's own reads came on top of the one


def test_guarded_step_zeroing_on_a_skip_is_allowed(capsys):
    def zero_on_skip(parameters, optimizer, max_norm):
        params = _plist(parameters)
        if ref_guarded_step(params, optimizer, max_norm):
            return True
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        return False

    assert_passes(ext.check_guarded_step, zero_on_skip, capsys)


def test_guarded_step_an_answer_that_empties_its_list_is_judged_on_its_steps(capsys):
    # the check hands the answer its own list: clearing it must not break the check
    def clears(parameters, optimizer, max_norm):
        result = ref_guarded_step(parameters, optimizer, max_norm)
        if isinstance(parameters, list):
            parameters.clear()
        return result

    assert_passes(ext.check_guarded_step, clears, capsys)


def test_guarded_step_accepts_a_tensor_bool(capsys):
    def tensor_bool(parameters, optimizer, max_norm):
        return torch.tensor(ref_guarded_step(parameters, optimizer, max_norm))

    assert_passes(ext.check_guarded_step, tensor_bool, capsys)


def _step_iterates_a_bare_tensor(parameters, optimizer, max_norm):
    # for p in parameters: on a bare tensor that walks its rows, whose .grad is None
    grads = [p.grad for p in parameters if p.grad is not None]
    total = ref_total_norm(grads, 2.0)
    if bool(_keep(total, max_norm)):
        optimizer.step()
        return True
    return False


def _step_returns_an_int(parameters, optimizer, max_norm):
    return int(ref_guarded_step(parameters, optimizer, max_norm))


def _step_returns_a_0dim_float(parameters, optimizer, max_norm):
    return torch.tensor(float(ref_guarded_step(parameters, optimizer, max_norm)))


@pytest.mark.parametrize(
    "fn, fragments",
    [
        (
            _step_iterates_a_bare_tensor,
            ["bare tensor, not in a list", "must be skipped", "step 1 of 4"],
        ),
        (_step_returns_an_int, ["your return value:     the Python number 1", "not a number"]),
        (_step_returns_a_0dim_float, ["your return value:     tensor(1)", "Hint: return a bool"]),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_guarded_step_rejects_bare_tensor_mistakes(fn, fragments, capsys):
    assert_fails(ext.check_guarded_step, fn, capsys, *fragments)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda taken: torch.tensor(taken),  # 0-dim bool tensor
        lambda taken: torch.tensor([taken]),  # one-element bool tensor
        lambda taken: np.bool_(taken),  # e.g. from np.isfinite
    ],
    ids=["0-dim bool tensor", "one-element bool tensor", "numpy bool"],
)
def test_guarded_step_accepts_bool_like_returns(wrap, capsys):
    def answer(parameters, optimizer, max_norm):
        return wrap(ref_guarded_step(parameters, optimizer, max_norm))

    assert_passes(ext.check_guarded_step, answer, capsys)


def test_guarded_step_passes_a_bare_tensor(capsys):
    seen = []

    def recording(parameters, optimizer, max_norm):
        seen.append(type(parameters))
        return ref_guarded_step(parameters, optimizer, max_norm)

    assert_passes(ext.check_guarded_step, recording, capsys)
    assert torch.nn.Parameter in seen and list in seen


def test_guarded_step_makes_the_first_step_bad(capsys):
    # a "warm-up" that always takes the first step passed when it was never bad
    def takes_the_first_step(parameters, optimizer, max_norm):
        params = _plist(parameters)
        if not getattr(optimizer, "warmed_up", False):
            optimizer.warmed_up = True
            optimizer.step()
            return True
        return ref_guarded_step(params, optimizer, max_norm)

    out = assert_fails(ext.check_guarded_step, takes_the_first_step, capsys, "must be skipped")
    assert "step 1 of 4" in out


def test_guarded_step_names_the_state_that_moved(capsys):
    def zero_then_step(parameters, optimizer, max_norm):
        params = _plist(parameters)
        total = ref_total_norm(_grads(params), 2.0)
        ok = bool(_keep(total, max_norm))
        if not ok:
            for p in params:
                if p.grad is not None:
                    p.grad.zero_()
        optimizer.step()
        return ok

    out = assert_fails(ext.check_guarded_step, zero_then_step, capsys, "must be skipped")
    assert "parameter" in out


# ------------------------------------------------------------ threshold choice


CLEAN = [1.0 + 0.01 * i for i in range(100)]  # 1.00 ... 1.99
OUTLIERS = [5.0, 40.0, math.inf, math.nan]


@pytest.mark.parametrize("threshold", [2.0, 3.0, 4.99, 1.99, torch.tensor(2.5)])
def test_threshold_choice_accepts(threshold, capsys):
    assert ext.check_threshold_choice(threshold, CLEAN, OUTLIERS) is True
    out = capsys.readouterr().out
    assert out.endswith("Passed.\n")
    assert "ignores 4 of 4 outlier steps" in out


def test_threshold_choice_accepts_tensors_and_fraction(capsys):
    clean = torch.tensor(CLEAN)
    assert ext.check_threshold_choice(1.505, clean, torch.tensor([9.0]), keep_fraction=0.5)
    assert "keeps 51 of 100 clean steps" in capsys.readouterr().out


@pytest.mark.parametrize(
    "threshold, fragments",
    [
        (1.5, ["Too low", "1.99, 1.98"]),
        (1.97, ["Too low", "1.99, 1.98"]),  # keeps 98%, needs 99
        (5.5, ["Too high", "norms 5."]),
        (100.0, ["Too high", "5, 40"]),
        (math.inf, ["Too high", "5, 40."]),
        (math.nan, ["non-negative number"]),
        (-1.0, ["non-negative number"]),
        ("2", ["must be a real number"]),
        (True, ["must be a real number"]),
        (torch.tensor(True), ["must be a real number", "0-dim bool tensor"]),
        (torch.tensor(2.5 + 0j), ["must be a real number", "0-dim complex64 tensor"]),
        (torch.tensor([2.0, 3.0]), ["must be a real number", "shape (2,)"]),
        (np.array(True), ["must be a real number"]),
        (torch.tensor(math.nan), ["non-negative number"]),
        (torch.tensor(-1.0), ["non-negative number"]),
    ],
)
def test_threshold_choice_rejects(threshold, fragments, capsys):
    assert ext.check_threshold_choice(threshold, CLEAN, OUTLIERS) is False
    out = capsys.readouterr().out
    for fragment in fragments:
        assert fragment in out, out


@pytest.mark.parametrize(
    "threshold",
    [
        torch.tensor(2.5),  # torch.quantile(norms, q) returns a 0-dim tensor
        torch.tensor([2.5]),
        torch.tensor(3),  # integer dtype
        torch.tensor(2.5, dtype=torch.float64, requires_grad=True),
        np.float32(2.5),
        np.float64(2.5),  # np.percentile returns one
        np.array(2.5),
        3,
    ],
    ids=lambda t: f"{type(t).__name__} {getattr(t, 'dtype', '')}",
)
def test_threshold_choice_accepts_0dim_tensors_and_numbers(threshold, recwarn, capsys):
    assert ext.check_threshold_choice(threshold, CLEAN, OUTLIERS) is True
    out = capsys.readouterr().out
    assert out.endswith("Passed.\n") and "ignores 4 of 4" in out
    assert not recwarn.list  # no requires_grad or complex-cast warning


@pytest.mark.parametrize(
    "clean",
    [
        torch.tensor(CLEAN),
        torch.tensor(CLEAN).reshape(10, 10),
        [torch.tensor(n) for n in CLEAN],  # a list of 0-dim norms
        torch.tensor(CLEAN, requires_grad=True),
        np.array(CLEAN),
        (n for n in CLEAN),
    ],
    ids=["tensor", "2-d tensor", "list of 0-dim tensors", "requires_grad", "numpy", "generator"],
)
def test_threshold_choice_takes_norms_in_any_container(clean, recwarn, capsys):
    assert ext.check_threshold_choice(2.0, clean, torch.tensor(OUTLIERS)) is True
    assert "keeps 100 of 100 clean steps" in capsys.readouterr().out
    assert not recwarn.list


def test_threshold_choice_one_bare_0dim_norm(capsys):
    # one bare 0-dim tensor is one step, on either side
    assert ext.check_threshold_choice(2.0, torch.tensor(1.5), torch.tensor(9.0)) is True
    assert "keeps 1 of 1 clean steps" in capsys.readouterr().out
    assert ext.check_threshold_choice(2.0, torch.tensor(1.5), torch.tensor(1.9)) is False
    assert "Too high" in capsys.readouterr().out


@pytest.mark.parametrize(
    "clean",
    [torch.tensor([1.0 + 0j]), [torch.tensor([1.0, 2.0])], 1.5, ["a"]],
    ids=["complex", "list of 1-d tensors", "a bare number", "strings"],
)
def test_threshold_choice_rejects_norms_that_are_not_numbers(clean, recwarn, capsys):
    assert ext.check_threshold_choice(2.0, clean, [9.0]) is False
    assert "must be sequences of numbers" in capsys.readouterr().out
    assert not recwarn.list


def test_threshold_choice_says_when_impossible(capsys):
    assert ext.check_threshold_choice(1.5, CLEAN, [1.2]) is False
    assert "No threshold can meet both rules" in capsys.readouterr().out


def test_threshold_choice_survives_a_nan_clean_norm(capsys):
    # a NaN clean norm is ignored by every threshold: no IndexError, a verdict
    assert ext.check_threshold_choice(1.5, [1.0, math.nan], [9.0]) is False
    out = capsys.readouterr().out
    assert "keeps 1 of 2 clean steps" in out and "No threshold can meet" in out
    assert ext.check_threshold_choice(1.5, [1.0, math.nan], [9.0], keep_fraction=0.5)


@pytest.mark.parametrize("fraction", [1.5, -0.1, math.nan, "0.9", True])
def test_threshold_choice_rejects_a_bad_fraction(fraction, capsys):
    assert ext.check_threshold_choice(2.0, CLEAN, OUTLIERS, keep_fraction=fraction) is False
    assert "keep_fraction must be a number from 0 to 1" in capsys.readouterr().out
    assert ext.check_threshold_choice(2.0, CLEAN, OUTLIERS, catch_fraction=fraction) is False
    assert "catch_fraction must be a number from 0 to 1" in capsys.readouterr().out


def test_threshold_choice_catch_fraction(capsys):
    # 5.5 keeps the outlier 5.0: passes when three of the four must be caught
    assert ext.check_threshold_choice(5.5, CLEAN, OUTLIERS, catch_fraction=0.75)
    assert "ignores 3 of 4 outlier steps (at least 3, 75%" in capsys.readouterr().out
    assert ext.check_threshold_choice(50.0, CLEAN, OUTLIERS, catch_fraction=0.75) is False
    assert "Too high" in capsys.readouterr().out


def test_every_check_has_a_docstring_saying_what_is_checked():
    for module in (ex, ext):
        for name in module.__all__:
            doc = getattr(module, name).__doc__
            assert doc and "Check" in doc, name
