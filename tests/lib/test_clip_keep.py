"""The public keep rules, keep_by_norm and keep_by_value, against torch's clip coefficient.

They decide what grad_ignore_norm_ and grad_ignore_value_ keep and what StepGuard takes:
kept exactly when torch.nn.utils.clip_grads_with_norm_ would leave the gradient unchanged
(norm), and exactly when the largest entry is below the threshold (value).
"""

from __future__ import annotations

import math

import pytest
import torch

from gradlab import clip_grads_with_norm_, keep_by_norm, keep_by_value

_EDGE_THRESHOLDS = [
    0.0,
    1e-45,
    1e-6,
    math.nextafter(1e-6, 0.0),
    math.nextafter(1e-6, 1.0),
    1.0000001e-6,
    2e-6,
    0.5,
    1.0,
    3.7,
    65504.0,
    1e9,
    3.4e38,
    1e39,
    1e300,
    math.inf,
]
_RANDOM_THRESHOLDS = (
    10.0
    ** torch.empty(40, dtype=torch.float64).uniform_(
        -9, 30, generator=torch.Generator().manual_seed(7)
    )
).tolist()


def _neighbours(x: torch.Tensor, n: int = 3) -> torch.Tensor:
    """``x`` and the ``n`` representable numbers on each side of it, in x's dtype."""
    out, up, down = [x], x, x
    for _ in range(n):
        up, down = (
            torch.nextafter(up, up.new_tensor(math.inf)),
            torch.nextafter(down, down.new_tensor(-math.inf)),
        )
        out += [up, down]
    return torch.stack(out)


def _torch_keeps(threshold: float, stat: torch.Tensor) -> bool:
    """Whether torch.nn.utils.clip_grads_with_norm_ leaves a gradient of ones unchanged."""
    p = torch.zeros(1, dtype=stat.dtype, requires_grad=True)
    p.grad = torch.ones_like(p)
    torch.nn.utils.clip_grads_with_norm_([p], threshold, stat)
    return bool(p.grad.eq(1).all())


@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("by", ["norm", "value"])
def test_keep_rules_decide_as_torch_at_every_edge(by, dtype, as_tensor):
    """keep_by_norm is kept exactly when torch's clip coefficient leaves a gradient
    unchanged, keep_by_value an exact comparison, on the representable numbers around
    the threshold and the boundary (threshold - 1e-6), NaN and inf; a StepGuard decides
    by them, so the same holds for its steps."""
    for threshold in _EDGE_THRESHOLDS + _RANDOM_THRESHOLDS:
        near = torch.tensor([threshold, max(threshold - 1e-6, 0.0)], dtype=dtype)
        specials = torch.tensor([0.0, math.inf, math.nan], dtype=dtype)
        stats = torch.cat([_neighbours(near, 8).flatten().abs(), specials])
        tau = torch.tensor(threshold, dtype=torch.float64) if as_tensor else threshold
        rule = keep_by_norm if by == "norm" else keep_by_value
        got = [bool(rule(stat, tau)) for stat in stats]
        if by == "norm":
            expected = [_torch_keeps(threshold, stat) for stat in stats]
        else:
            expected = [float(stat) < threshold for stat in stats]
        assert got == expected, threshold


def test_keep_rules_refuse_bad_input_naming_it():
    norm = torch.tensor(1.0)
    for bad in (-1.0, math.nan, "1", None, torch.ones(2)):
        with pytest.raises(ValueError, match="max_norm"):
            keep_by_norm(norm, bad)
        with pytest.raises(ValueError, match="clip_value"):
            keep_by_value(norm, bad)
    for bad in (torch.ones(2), torch.tensor(1), 1.0):
        with pytest.raises(ValueError, match="total_norm"):
            keep_by_norm(bad, 1.0)
        with pytest.raises(ValueError, match="largest"):
            keep_by_value(bad, 1.0)
    with pytest.raises(ValueError, match="eps"):
        keep_by_norm(norm, 1.0, eps=-1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_keep_by_norm_without_eps_is_the_plain_comparison_up_to_one_rounding(dtype):
    """eps=0 is for thresholds far below 1e-6 (adaptive policies): kept below the
    threshold and not above, within one rounding of it, and kept exactly when
    clip_grads_with_norm_(eps=0) leaves a gradient unchanged."""
    g = torch.Generator().manual_seed(0)
    taus = 10.0 ** torch.empty(200, dtype=torch.float64).uniform_(-12, 12, generator=g)
    for tau in taus.tolist():
        for factor, kept in ((1 - 1e-5, True), (1 + 1e-5, False), (0.5, True), (2.0, False)):
            stat = torch.tensor(tau * factor, dtype=dtype)
            assert bool(keep_by_norm(stat, tau, eps=0.0)) is kept, (tau, factor)
        for stat in _neighbours(torch.tensor([tau], dtype=dtype), 3)[:, 0]:
            p = torch.zeros(1, dtype=dtype, requires_grad=True)
            p.grad = torch.ones_like(p)
            clip_grads_with_norm_([p], tau, stat, eps=0.0)
            assert bool(keep_by_norm(stat, tau, eps=0.0)) is bool(p.grad.eq(1).all())
    assert bool(keep_by_norm(torch.tensor(0.0), 1e-30, eps=0.0))
    assert not bool(keep_by_norm(torch.tensor(math.nan), 1e-30, eps=0.0))
    assert bool(keep_by_norm(torch.tensor(1e-7), 1e-6, eps=0.0))
    assert not bool(keep_by_norm(torch.tensor(1e-7), 1e-6))  # the epsilon dominates
