"""The privacy chapter's checks accept correct answers and reject the typical wrong ones.

The correct answers are written here independently of gradlab; gradlab's own
per-sample functions, wrapped to the exercise's contract, must pass too.
"""

from __future__ import annotations

import re

import pytest
import torch
from verdicts import assert_fails, assert_passes

from gradlab.per_sample import ignore_per_sample_, per_sample_norms
from gradlab_book import exercises_privacy as ex


def _view(keep, g):
    return keep.view((g.shape[0],) + (1,) * (g.dim() - 1))


def _sq_norms(grad_samples):
    b = grad_samples[0].shape[0]
    return sum(g.reshape(b, -1).double().square().sum(1) for g in grad_samples)


def ref_ignore(grad_samples, max_norm):
    keep = max_norm / (_sq_norms(grad_samples).sqrt() + 1e-6) >= 1.0
    return [torch.where(_view(keep, g), g, 0).sum(0) for g in grad_samples]


def gradlab_ignore(grad_samples, max_norm):
    holders = [torch.zeros(g.shape[1:], dtype=g.dtype) for g in grad_samples]
    ignore_per_sample_(holders, grad_samples, max_norm)
    return [h.grad for h in holders]


def ref_ghost(a, g):
    return torch.einsum("bti,btj,bsi,bsj->b", a, g, a, g).sqrt()


def ghost_gram(a, g):
    aa = a @ a.transpose(1, 2)
    gg = g @ g.transpose(1, 2)
    return (aa * gg).sum((1, 2)).sqrt()


def ghost_per_sample_loop(a, g):
    # one sample at a time, Gram form: correct, and it forms nothing large
    norms = []
    for ai, gi in zip(a, g, strict=True):
        norms.append(((ai @ ai.T) * (gi @ gi.T)).sum().sqrt())
    return torch.stack(norms)


@pytest.mark.parametrize(
    "check, fn",
    [
        (ex.check_ignore_per_sample, ref_ignore),
        (ex.check_ignore_per_sample, gradlab_ignore),
        (ex.check_ghost_norm, ref_ghost),
        (ex.check_ghost_norm, ghost_gram),
        (ex.check_ghost_norm, ghost_per_sample_loop),
    ],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_accepts_correct_answers(check, fn, capsys):
    assert_passes(check, fn, capsys)


def _stub(*args, **kwargs):
    raise NotImplementedError


@pytest.mark.parametrize("check", [ex.check_ignore_per_sample, ex.check_ghost_norm])
def test_not_implemented_and_not_a_function(check, capsys):
    out = assert_fails(check, _stub, capsys, "Not implemented yet")
    assert "Case" not in out
    assert_fails(check, 3.0, capsys, "Expected a function")


def test_output_is_deterministic_and_clean(capsys):
    outs = []
    for _ in range(2):
        ex.check_ignore_per_sample(_ignore_multiply)
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert not re.search(r"0x[0-9a-f]{6,}", outs[0])
    assert "grad_fn" not in outs[0] and "def " not in outs[0]


# ------------------------------------------------------------ wrong ignore answers


def _ignore_multiply(grad_samples, max_norm):
    keep = max_norm / (_sq_norms(grad_samples).sqrt() + 1e-6) >= 1.0
    return [(g * _view(keep, g).to(g.dtype)).sum(0) for g in grad_samples]


def _ignore_no_eps(grad_samples, max_norm):
    keep = _sq_norms(grad_samples).sqrt() <= max_norm
    return [torch.where(_view(keep, g), g, 0).sum(0) for g in grad_samples]


def _ignore_per_tensor(grad_samples, max_norm):
    out = []
    for g in grad_samples:
        norm = g.reshape(g.shape[0], -1).double().norm(dim=1)
        keep = max_norm / (norm + 1e-6) >= 1.0
        out.append(torch.where(_view(keep, g), g, 0).sum(0))
    return out


def _clip_instead(grad_samples, max_norm):
    coef = torch.clamp(max_norm / (_sq_norms(grad_samples).sqrt() + 1e-6), max=1.0)
    return [(g * _view(coef, g).to(g.dtype)).sum(0) for g in grad_samples]


def _ignore_mean(grad_samples, max_norm):
    return [s / grad_samples[0].shape[0] for s in ref_ignore(grad_samples, max_norm)]


def _ignore_boolean_index(grad_samples, max_norm):
    keep = max_norm / (_sq_norms(grad_samples).sqrt() + 1e-6) >= 1.0
    return [g[keep].sum(0) for g in grad_samples]


def _ignore_in_place(grad_samples, max_norm):
    keep = max_norm / (_sq_norms(grad_samples).sqrt() + 1e-6) >= 1.0
    for g in grad_samples:
        g.copy_(torch.where(_view(keep, g), g, 0))
    return [g.sum(0) for g in grad_samples]


def _ignore_float64_out(grad_samples, max_norm):
    return [s.double() for s in ref_ignore(grad_samples, max_norm)]


def _ignore_keepdim(grad_samples, max_norm):
    return [s.unsqueeze(0) for s in ref_ignore(grad_samples, max_norm)]


def _ignore_returns_tensor(grad_samples, max_norm):
    return ref_ignore(grad_samples, max_norm)[0]


@pytest.mark.parametrize(
    "fn, fragments",
    [
        (_ignore_multiply, ["Case 4 of 10", "sample 2 has a NaN entry", "NaN * 0 = NaN"]),
        (_ignore_no_eps, ["norm exactly max_norm", "max_norm / (norm + 1e-6) >= 1"]),
        (_ignore_per_tensor, ["not the whole sample", "over all its tensors together"]),
        (_clip_instead, ["sample 1 is far over max_norm", "it is not clipped"]),
        (_ignore_mean, ["Case 1 of 10", "expected sums:", "your sums:"]),
        (_ignore_boolean_index, ["reads a tensor value on the host", "boolean mask"]),
        (_ignore_in_place, ["modified grad_samples[0] in place"]),
        (_ignore_float64_out, ["float32, three tensors", "expected dtype torch.float32"]),
        (_ignore_keepdim, ["expected shape (3, 2), yours (1, 3, 2)"]),
        (_ignore_returns_tensor, ["a list with one tensor per parameter"]),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_ignore_per_sample_rejects(fn, fragments, capsys):
    assert_fails(ex.check_ignore_per_sample, fn, capsys, *fragments)


def test_ignore_report_shows_norms_and_kept_samples(capsys):
    out = assert_fails(ex.check_ignore_per_sample, _clip_instead, capsys)
    assert "samples to keep: 0, 2, 3" in out
    assert "sample norms:" in out


# ------------------------------------------------------------ wrong ghost answers


def _ghost_no_cross_terms(a, g):
    return (a.square().sum(2) * g.square().sum(2)).sum(1).sqrt()


def _ghost_squared(a, g):
    return ref_ghost(a, g).square()


def _ghost_of_sums(a, g):
    return a.sum(1).norm(dim=1) * g.sum(1).norm(dim=1)


def _ghost_mixes_batch(a, g):
    aa = torch.einsum("bti,csi->bc", a, a)
    gg = torch.einsum("bto,cso->bc", g, g)
    return (aa * gg).sum(1).abs().sqrt()


def _ghost_float64(a, g):
    return ref_ghost(a.double(), g.double())


def _ghost_keepdim(a, g):
    return ref_ghost(a, g).unsqueeze(1)


def _ghost_formed_einsum(a, g):
    # the review's answer (N19): right numbers, by forming the (B, d_out, d_in) gradients
    return torch.einsum("bto,bti->boi", g, a).flatten(1).norm(dim=1)


def _ghost_formed_gradlab(a, g):
    grads = torch.einsum("bto,bti->boi", g, a)  # (B, d_out, d_in)
    return per_sample_norms([grads]).squeeze(1).to(a.dtype)


def _ghost_outer_per_sample(a, g):
    out = []
    for ai, gi in zip(a, g, strict=True):
        grad = sum(torch.outer(gt, at) for at, gt in zip(ai, gi, strict=True))
        out.append(torch.linalg.matrix_norm(grad))
    return torch.stack(out)


def _ghost_in_place(a, g):
    a.mul_(1.0)  # a no-op value change is still a write: a NaN survives, bits equal
    g.add_(1.0)
    return ghost_gram(a, g - 1.0)


@pytest.mark.parametrize(
    "fn, fragments",
    [
        (_ghost_no_cross_terms, ["Case 2 of 7", "cross terms"]),
        (_ghost_squared, ["Case 1 of 7", "squared norms: take the square root"]),
        (_ghost_of_sums, ["Case 2 of 7", "expected norms:"]),
        (_ghost_mixes_batch, ["expected norms:", "your norms:"]),
        (_ghost_float64, ["float32", "expected dtype torch.float32"]),
        (_ghost_keepdim, ["expected: a tensor of shape (4,)", "(4, 1)"]),
        (
            _ghost_formed_einsum,
            ["Case 7 of 7", "d_in = d_out = 50,000", "(2, 50000, 50000)", "forms the per-sample"],
        ),
        (_ghost_formed_gradlab, ["Case 7 of 7", "forms the per-sample gradients"]),
        (_ghost_outer_per_sample, ["Case 7 of 7", "(50000, 50000)", "stopped before"]),
        (_ghost_in_place, ["Case 1 of 7", "modified a or g in place"]),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_ghost_norm_rejects(fn, fragments, capsys):
    assert_fails(ex.check_ghost_norm, fn, capsys, *fragments)


def test_ghost_nan_sample_must_stay_in_its_sample(capsys):
    def nan_everywhere(a, g):
        out = ref_ghost(a, g)
        return out + 0 * out.sum()  # one NaN sample poisons the whole batch

    assert_fails(ex.check_ghost_norm, nan_everywhere, capsys, "Case 4 of 7", "do not mix samples")


def test_the_formed_answers_pass_every_small_case(capsys):
    # so that they fail on the large case alone: for the size, not for a wrong number
    out = assert_fails(ex.check_ghost_norm, _ghost_formed_einsum, capsys, "Case 7 of 7")
    assert "Case 1" not in out and "expected norms" not in out


def test_ignore_answer_that_changes_its_inputs_is_told_so_first(capsys):
    def scales_inputs(grad_samples, max_norm):
        for g in grad_samples:
            g.mul_(2.0)  # changes the inputs, and so the sums
        return ref_ignore(grad_samples, max_norm)

    out = assert_fails(ex.check_ignore_per_sample, scales_inputs, capsys, "in place")
    assert "expected sums" not in out  # the value hint would mislead (issue 21, item 13)


def test_every_check_has_a_docstring_saying_what_is_checked():
    for name in (n for n in ex.__all__ if n.startswith("check_")):
        doc = getattr(ex, name).__doc__
        assert doc and "Check" in doc, name
