"""Chapter 2's computations, checked against torch and the mathematics."""

import math

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from gradlab_book.figures import norms as N

PS = (1.0, 1.5, 2.0, 3.0, 4.0, 8.0, math.inf)
MAX_NORMS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0)


@pytest.mark.parametrize("p", [*PS, 0.5, 100.0])
def test_unit_ball_points_have_norm_one(p):
    x, y = N.unit_ball(p)
    norms = torch.linalg.vector_norm(torch.tensor(np.stack([x, y], axis=1)), p, dim=1)
    np.testing.assert_allclose(norms.numpy(), 1.0, rtol=1e-12)


def test_unit_ball_shapes_and_errors():
    x, _ = N.unit_ball(1.0, points=5)
    np.testing.assert_allclose(np.abs(x), [1, 0, 1, 0, 1], atol=1e-12)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError):
            N.unit_ball(bad)
    with pytest.raises(ValueError):
        N.unit_ball(2.0, points=3)


def test_p_norm_matches_torch_and_handles_zero_and_nan():
    v = [3.0, -4.0]
    assert N.p_norm(v, 1) == 7.0
    assert N.p_norm(v, 2) == 5.0
    assert N.p_norm(v, math.inf) == 4.0
    assert N.p_norm([0.0, 0.0], 2) == 0.0
    assert math.isnan(N.p_norm([1.0, math.nan], 2))


def test_real_gradient_is_the_linear_models_gradient():
    g = N.real_gradient_2d()
    assert g.shape == (2,)
    assert np.all(np.isfinite(g)) and np.any(g != 0)


@pytest.mark.parametrize("p", [PS[0], PS[-1], 2.0])
@pytest.mark.parametrize("gradient", [None, [0.0, 0.0], [math.nan, 1.0], [1e6, -3.0]])
def test_unit_ball_figure_at_extremes(p, gradient):
    fig = N.unit_ball_figure(p, gradient)
    assert isinstance(fig, Figure)
    assert tuple(fig.get_size_inches()) <= (6.4, 3.6)


def test_unit_ball_figure_rejects_wrong_shape():
    with pytest.raises(ValueError):
        N.unit_ball_figure(2.0, [1.0, 2.0, 3.0])


def _torch_clip(grads, max_norm, groups, norm_type=2.0):
    params = []
    for g in grads:
        p = torch.zeros_like(g, dtype=torch.float64)
        p.grad = g.double().clone()
        params.append(p)
    for group in groups:
        torch.nn.utils.clip_grad_norm_([params[i] for i in group], max_norm, norm_type=norm_type)
    return [p.grad.numpy() for p in params]


@pytest.mark.parametrize("max_norm", [MAX_NORMS[0], 2.0, MAX_NORMS[-1], 0.0, math.inf])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_group_clipping_matches_torch(max_norm, norm_type):
    names, grads = N.mlp_gradients()
    groups = N.layer_groups(names)
    data = N.group_clipping(grads, max_norm, groups, norm_type=norm_type)
    expected_global = _torch_clip(grads, max_norm, [list(range(len(grads)))], norm_type)
    expected_groups = _torch_clip(grads, max_norm, groups, norm_type)
    for got, want in zip(data.after_global, expected_global, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    for got, want in zip(data.after_groups, expected_groups, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    flat = torch.cat([g.double().reshape(-1) for g in grads])
    assert data.total_before == pytest.approx(torch.linalg.vector_norm(flat, norm_type).item())
    # Every group ends at most at max_norm; the per-group total can exceed it by sqrt(k).
    assert np.all(data.group_norms_groups <= max_norm * (1 + 1e-9) + 1e-12)
    if norm_type == 2.0 and math.isfinite(max_norm):
        assert data.total_groups <= max_norm * math.sqrt(len(groups)) + 1e-9


def test_group_clipping_differs_only_when_some_group_is_clipped():
    names, grads = N.mlp_gradients()
    groups = N.layer_groups(names)
    loose = N.group_clipping(grads, 1e3, groups)
    assert loose.difference == 0.0 and loose.cosine == pytest.approx(1.0)
    tight = N.group_clipping(grads, 1.0, groups)
    assert tight.difference > 0.1 and tight.cosine < 0.99
    assert tight.total_global == pytest.approx(1.0, rel=1e-5)


def test_group_clipping_default_groups_and_errors():
    _, grads = N.mlp_gradients()
    data = N.group_clipping(grads, 0.5)
    assert data.groups == [[i] for i in range(len(grads))]
    with pytest.raises(ValueError):
        N.group_clipping(grads, 0.5, [[0, 1]])


def test_group_clipping_zero_gradients():
    grads = [torch.zeros(3), torch.zeros(2, 2)]
    data = N.group_clipping(grads, 1.0)
    assert data.total_before == data.total_global == data.total_groups == 0.0
    assert math.isnan(data.cosine) and math.isnan(data.difference)
    empty = N.group_clipping([], 1.0)
    assert empty.total_before == 0.0


def test_group_clipping_nan_gradient_does_not_raise():
    grads = [torch.tensor([1.0, math.nan]), torch.tensor([2.0])]
    data = N.group_clipping(grads, 1.0)
    assert math.isnan(data.total_before)
    assert math.isnan(data.cosine) and math.isnan(data.difference)
    # The NaN-free group is clipped on its own; the global clip spreads NaN everywhere.
    np.testing.assert_allclose(data.after_groups[1], [1.0], rtol=1e-5)
    assert np.all(np.isnan(data.after_global[1]))


@pytest.mark.parametrize("max_norm", [MAX_NORMS[0], MAX_NORMS[-1], 0.0])
@pytest.mark.parametrize("by", ["layer", "tensor"])
def test_group_clipping_figure_at_extremes(max_norm, by):
    fig = N.group_clipping_figure(max_norm, by)
    assert isinstance(fig, Figure)
    assert tuple(fig.get_size_inches()) <= (6.4, 3.6)


def test_group_clipping_figure_rejects_unknown_grouping():
    with pytest.raises(ValueError):
        N.group_clipping_figure(1.0, by="row")


@pytest.mark.parametrize(
    "call",
    [
        lambda: N.unit_ball_figure(0.5),  # below the slider: a quasi-norm ball, still drawn
        lambda: N.unit_ball_figure(16.0),
        lambda: N.unit_ball_figure(200.0),
        lambda: N.unit_ball_figure(2.0, [0.0, 0.0]),
        lambda: N.unit_ball_figure(2.0, [math.inf, 0.0]),
        lambda: N.group_clipping_figure(0.0),
        lambda: N.group_clipping_figure(0.1),
        lambda: N.group_clipping_figure(10.0),
    ],
)
def test_figures_just_outside_their_sliders(call):
    # issue 21 item 13: the sliders' neighbours draw a figure instead of crashing
    assert isinstance(call(), Figure)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: N.unit_ball_figure(math.nan), "p"),
        (lambda: N.unit_ball_figure(-1.0), "p"),
        (lambda: N.unit_ball_figure(2.0, [1.0, 2.0, 3.0]), "gradient"),
        (lambda: N.group_clipping_figure(-1.0), "max_norm"),
        (lambda: N.group_clipping_figure(math.nan), "max_norm"),
    ],
)
def test_bad_arguments_are_refused_by_name(call, name):
    with pytest.raises(ValueError, match=name):
        call()
