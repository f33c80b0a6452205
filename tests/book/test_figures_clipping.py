"""Tests for gradlab_book.figures.clipping: the data against torch and the math, the figures
at every control's extremes, on zero vectors and on NaN gradients."""

from __future__ import annotations

import math

import pytest
import torch
from matplotlib.figure import Figure
from torch import nn

from gradlab_book import demos
from gradlab_book.figures import clipping as C
from gradlab_book.interactive import Control, explore
from gradlab_book.plots import png_bytes

NAN = float("nan")
INF = float("inf")
EPS = 1e-6

# The grids the chapters' sliders use; their extremes are tested below.
NORM_GRID = [k / 2 for k in range(17)]  # max_norm in chapter 3: 0 .. 8
VALUE_GRID = [k / 2 for k in range(17)]  # threshold in chapter 4: 0 .. 8
LAYER_GRID = [10 ** (k / 2) for k in range(-6, 1)]  # clip_value per layer: 1e-3 .. 1


def _torch_clip_norm(g, max_norm):
    p = torch.zeros(2, dtype=torch.float64)
    p.grad = torch.tensor(g, dtype=torch.float64)
    total = torch.nn.utils.clip_grad_norm_(p, max_norm)
    return float(total), tuple(p.grad.tolist())


def _torch_clip_value(g, clip_value):
    p = torch.zeros(2, dtype=torch.float64)
    p.grad = torch.tensor(g, dtype=torch.float64)
    torch.nn.utils.clip_grad_value_(p, clip_value)
    return tuple(p.grad.tolist())


def _same(a, b):
    return all((x == y) or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


def _tanh_named_grads():
    model = demos.tanh_chain(4, width=8, weight_scale=3.0, seed=0)
    x, y = demos.regression_data(16, d_in=8, d_out=8, seed=1)
    demos.backward(model, x, y)
    return [(name, p.grad.detach().clone()) for name, p in model.named_parameters()]


# ------------------------------------------------------------------ example gradient


def test_example_gradient_is_the_mse_gradient_at_zero():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([[2.5], [-0.5]], dtype=torch.float64)
    # d/dw mean((x w - y)^2) at w = 0 is -2/N x^T y
    expected = (-2.0 / 8 * x.T @ y).reshape(-1).tolist()
    assert C.example_gradient_2d() == pytest.approx(expected, rel=1e-12)
    # inside the slider's range, so the reader sees both regimes
    assert NORM_GRID[1] < math.hypot(*C.example_gradient_2d()) < NORM_GRID[-1]


# --------------------------------------------------------------------- angle


@pytest.mark.parametrize(
    ("u", "v", "degrees"),
    [
        ((1, 0), (0, 2), 90.0),
        ((1, 1), (-3, -3), 180.0),
        ((2, 0), (5, 0), 0.0),
        ((1, 0), (1, 1), 45),
    ],
)
def test_angle_between_known_angles(u, v, degrees):
    assert C.angle_between(u, v) == pytest.approx(degrees, abs=1e-6)


@pytest.mark.parametrize(("u", "v"), [((0, 0), (1, 2)), ((NAN, 1), (1, 1)), ((1, 1), (INF, 0))])
def test_angle_between_undefined_is_nan(u, v):
    assert math.isnan(C.angle_between(u, v))


# ------------------------------------------------------------- clipping by norm


@pytest.mark.parametrize("max_norm", [NORM_GRID[0], NORM_GRID[1], 7.0, NORM_GRID[-1], INF])
def test_norm_clip_2d_matches_torch(max_norm):
    g = C.example_gradient_2d()
    result = C.norm_clip_2d(g, max_norm)
    total, clipped = _torch_clip_norm(g, max_norm)
    assert result.norm_before == total
    assert result.clipped == clipped
    assert result.gradient == g
    expected_coef = min(1.0, max_norm / (math.hypot(*g) + EPS))
    assert result.coefficient == pytest.approx(expected_coef, rel=1e-12)
    assert result.was_clipped == (max_norm < math.hypot(*g))


@pytest.mark.parametrize("max_norm", NORM_GRID)
def test_norm_after_clipping_is_min_of_norm_and_threshold(max_norm):
    result = C.norm_clip_2d(C.example_gradient_2d(), max_norm)
    target = min(result.norm_before, max_norm)
    # c * T = tau * T / (T + eps) falls short of tau by tau * eps / (T + eps) < eps
    assert abs(result.norm_after - target) <= max_norm * EPS / result.norm_before + 1e-12
    assert result.norm_after <= max_norm + 1e-12 or max_norm >= result.norm_before


def test_norm_clip_keeps_direction():
    g = C.example_gradient_2d()
    for max_norm in NORM_GRID[1:]:
        clipped = C.norm_clip_2d(g, max_norm).clipped
        assert C.angle_between(g, clipped) == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_norm_clip_zero_gradient_stays_zero(max_norm):
    result = C.norm_clip_2d((0.0, 0.0), max_norm)
    assert result.clipped == (0.0, 0.0)
    assert result.norm_before == 0.0 and result.norm_after == 0.0
    assert not math.isnan(result.coefficient)
    assert _torch_clip_norm((0.0, 0.0), max_norm)[1] == result.clipped


def test_norm_clip_nan_gradient_turns_everything_nan():
    result = C.norm_clip_2d((NAN, 1.0), 1.0)
    assert all(math.isnan(x) for x in result.clipped)
    assert math.isnan(result.norm_before) and math.isnan(result.coefficient)
    assert not result.was_clipped
    assert _same(result.clipped, _torch_clip_norm((NAN, 1.0), 1.0)[1])


def test_norm_clip_inf_gradient_matches_torch():
    result = C.norm_clip_2d((INF, 1.0), 1.0)
    assert result.norm_before == INF
    # max_norm / inf = 0: the finite entry becomes 0, the infinite one 0 * inf = NaN
    assert math.isnan(result.clipped[0]) and result.clipped[1] == 0.0
    assert _same(result.clipped, _torch_clip_norm((INF, 1.0), 1.0)[1])


def test_norm_clip_rejects_bad_vectors():
    with pytest.raises(ValueError):
        C.norm_clip_2d((1.0, 2.0, 3.0), 1.0)


# ------------------------------------------------------------ clipping by value


@pytest.mark.parametrize("threshold", [VALUE_GRID[0], VALUE_GRID[1], 2.0, VALUE_GRID[-1], INF])
def test_compare_matches_torch(threshold):
    g = C.example_gradient_2d()
    result = C.compare_clipping_2d(g, threshold)
    assert result.by_norm == _torch_clip_norm(g, threshold)[1]
    assert result.by_value == _torch_clip_value(g, threshold)
    assert result.by_value == tuple(max(-threshold, min(threshold, x)) for x in g)


def test_compare_angles_follow_the_geometry():
    g = C.example_gradient_2d()  # |g1| > |g2| > 0
    small = abs(g[1]) / 2  # both entries clamped: by_value points along a diagonal
    result = C.compare_clipping_2d(g, small)
    diagonal = math.degrees(math.atan2(abs(g[1]), abs(g[0])))
    assert result.angle_norm == pytest.approx(0.0, abs=1e-5)
    assert result.angle_value == pytest.approx(45.0 - diagonal, abs=1e-9)
    assert result.angle_between == pytest.approx(result.angle_value, abs=1e-5)
    large = C.compare_clipping_2d(g, 1e3)  # nothing clamped
    assert large.by_value == g and large.angle_value == pytest.approx(0.0, abs=1e-6)
    assert result.norm_by_value == pytest.approx(math.sqrt(2) * small)
    assert result.norm_by_norm == pytest.approx(small, rel=1e-5)


def test_compare_zero_threshold_and_zero_gradient_give_undefined_angles():
    zero_t = C.compare_clipping_2d(C.example_gradient_2d(), 0.0)
    assert zero_t.by_norm == (0.0, 0.0) or all(x == 0.0 for x in zero_t.by_norm)
    assert all(x == 0.0 for x in zero_t.by_value)
    assert math.isnan(zero_t.angle_between)
    zero_g = C.compare_clipping_2d((0.0, 0.0), 1.0)
    assert zero_g.by_value == (0.0, 0.0) and math.isnan(zero_g.angle_value)


def test_compare_nan_gradient():
    result = C.compare_clipping_2d((NAN, 5.0), 1.0)
    assert all(math.isnan(x) for x in result.by_norm)
    # clamp leaves a NaN entry as it is and clamps the others
    assert math.isnan(result.by_value[0]) and result.by_value[1] == 1.0
    assert _same(result.by_value, _torch_clip_value((NAN, 5.0), 1.0))
    assert math.isnan(result.angle_between)


# -------------------------------------------------------------------- per layer


def _count_changed_by_torch(named, threshold):
    fractions = []
    for _, grad in named:
        p = torch.zeros_like(grad)
        p.grad = grad.clone()
        torch.nn.utils.clip_grad_value_([p], threshold)
        changed = (p.grad != grad) & ~(grad.isnan() & p.grad.isnan())
        fractions.append(changed.sum().item() / grad.numel())
    return tuple(fractions)


def test_layer_clamping_matches_torch_on_a_real_model():
    named = _tanh_named_grads()
    data = C.layer_clamping(named, LAYER_GRID)
    assert data.names == tuple(n for n, _ in named)
    assert data.sizes == tuple(g.numel() for _, g in named)
    assert data.max_abs == tuple(g.abs().max().item() for _, g in named)
    for threshold, row in zip(LAYER_GRID, data.fractions, strict=True):
        assert row == _count_changed_by_torch(named, threshold)
        expected = tuple((g.abs() > threshold).float().mean().item() for _, g in named)
        assert row == pytest.approx(expected)
    # a larger threshold never clamps more
    for low, high in zip(data.fractions, data.fractions[1:], strict=False):
        assert all(h <= lo for lo, h in zip(low, high, strict=True))


def test_layer_clamping_extremes():
    named = _tanh_named_grads()
    data = C.layer_clamping(named, [0.0, 1e9])
    nonzero = tuple((g != 0).float().mean().item() for _, g in named)
    assert data.fractions[0] == pytest.approx(nonzero)
    assert data.fractions[1] == tuple(0.0 for _ in named)


def test_layer_clamping_zero_nan_and_empty():
    named = [("zeros", torch.zeros(4)), ("nan", torch.tensor([NAN, 3.0, -3.0, 0.1]))]
    data = C.layer_clamping(named, [1.0])
    assert data.fractions == ((0.0, 0.5),)  # the NaN entry is not changed, so not counted
    assert data.max_abs[0] == 0.0 and math.isnan(data.max_abs[1])
    empty = C.layer_clamping([], [1.0])
    assert empty.names == () and empty.fractions == ((),)


# --------------------------------------------------------- norms after clipping


def test_norms_after_clipping_bounds_on_a_real_model():
    grads = [g for _, g in _tanh_named_grads()]
    n = sum(g.numel() for g in grads)
    flat = torch.cat([g.reshape(-1) for g in grads])
    thresholds = [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]
    data = C.norms_after_clipping(grads, thresholds)
    assert data.n == n
    assert data.norm_before == pytest.approx(flat.norm().item(), rel=1e-6)
    assert data.inf_before == flat.abs().max().item()
    for c, by_norm, two, inf, bound in zip(
        thresholds, data.by_norm, data.by_value_two, data.by_value_inf, data.bound, strict=True
    ):
        assert bound == pytest.approx(math.sqrt(n) * c)
        # clamp compares in the gradients' dtype: c is rounded to float32 first
        assert inf <= torch.tensor(c, dtype=torch.float32).item()
        assert two <= bound * (1 + 1e-6)
        assert two == pytest.approx(flat.clamp(-c, c).norm().item(), rel=1e-5)
        assert by_norm == pytest.approx(min(flat.norm().item(), c), rel=1e-5)
    # below the smallest |entry| every entry sits at +-c and the bound is reached
    tiny = flat.abs()[flat != 0].min().item() / 2
    if (flat != 0).all():
        reached = C.norms_after_clipping(grads, [tiny])
        assert reached.by_value_two[0] == pytest.approx(reached.bound[0], rel=1e-5)


def test_norms_after_clipping_reaches_the_bound():
    grads = [torch.full((3, 3), -5.0), torch.full((7,), 2.0)]
    data = C.norms_after_clipping(grads, [1.0])
    assert data.by_value_two[0] == pytest.approx(4.0)  # sqrt(16) * 1
    assert data.bound[0] == pytest.approx(4.0)
    assert data.by_value_inf[0] == 1.0


def test_norms_after_clipping_zero_and_nan():
    zero = C.norms_after_clipping([torch.zeros(5)], [0.0, 1.0])
    assert zero.by_norm == (0.0, 0.0) and zero.by_value_two == (0.0, 0.0)
    nan = C.norms_after_clipping([torch.tensor([NAN, 2.0])], [1.0])
    assert math.isnan(nan.by_norm[0]) and math.isnan(nan.by_value_two[0])
    assert math.isnan(nan.norm_before)


# ----------------------------------------------------------------------- figures


def _renders(fig):
    assert isinstance(fig, Figure)
    assert png_bytes(fig)[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("max_norm", [NORM_GRID[0], NORM_GRID[1], NORM_GRID[-1], INF])
def test_norm_ball_figure_extremes(max_norm):
    _renders(C.norm_ball_figure(max_norm, extent=8.0))


@pytest.mark.parametrize("gradient", [(0.0, 0.0), (NAN, 1.0), (INF, -1.0), (3.0, 4.0)])
def test_norm_ball_figure_odd_gradients(gradient):
    _renders(C.norm_ball_figure(0.0, gradient=gradient))
    _renders(C.norm_ball_figure(2.0, gradient=gradient))


@pytest.mark.parametrize("threshold", [VALUE_GRID[0], VALUE_GRID[1], VALUE_GRID[-1], INF])
def test_norm_vs_value_figure_extremes(threshold):
    _renders(C.norm_vs_value_figure(threshold, extent=8.0))


@pytest.mark.parametrize("gradient", [(0.0, 0.0), (NAN, 1.0), (1.0, INF)])
def test_norm_vs_value_figure_odd_gradients(gradient):
    _renders(C.norm_vs_value_figure(1.0, gradient=gradient))
    _renders(C.norm_vs_value_figure(0.0, gradient=gradient))


def test_norm_vs_value_title_prints_the_angle():
    g = C.example_gradient_2d()
    fig = C.norm_vs_value_figure(1.0, gradient=g)
    angle = C.compare_clipping_2d(g, 1.0).angle_between
    assert f"{angle:.1f}°" in fig._suptitle.get_text()


@pytest.mark.parametrize("threshold", [0.0, LAYER_GRID[0], LAYER_GRID[-1], 1e6])
def test_layer_clamp_figure_extremes(threshold):
    _renders(C.layer_clamp_figure(threshold, named_grads=_tanh_named_grads()))


def test_layer_clamp_figure_zero_nan_and_empty():
    named = [("zeros", torch.zeros(4)), ("nan", torch.tensor([NAN, 3.0]))]
    _renders(C.layer_clamp_figure(1.0, named_grads=named))
    _renders(C.layer_clamp_figure(0.0, named_grads=named))
    _renders(C.layer_clamp_figure(1.0))


def test_norm_after_figure_real_zero_and_nan():
    grads = [g for _, g in _tanh_named_grads()]
    _renders(C.norm_after_figure(C.norms_after_clipping(grads, [0.0, 1e-3, 1.0, 1e3])))
    _renders(C.norm_after_figure(C.norms_after_clipping([torch.zeros(3)], [1e-3, 1.0])))
    _renders(C.norm_after_figure(C.norms_after_clipping([torch.tensor([NAN])], [1.0])))


def test_chapter_grids_fit_an_explorable():
    ball = explore(C.norm_ball_figure, Control("max_norm", NORM_GRID), extent=8.0)
    both = explore(C.norm_vs_value_figure, Control("threshold", VALUE_GRID), extent=8.0)
    layers = explore(
        C.layer_clamp_figure, Control("threshold", LAYER_GRID), named_grads=_tanh_named_grads()
    )
    assert ball.frame_count + both.frame_count + layers.frame_count <= 3 * 60
    assert len(ball.frame((0,))) < 60_000


def test_figures_take_real_module_gradients():
    model = nn.Linear(2, 1, bias=False)
    model.weight.grad = torch.tensor([[3.0, -4.0]])
    g = tuple(model.weight.grad.reshape(-1).tolist())
    assert C.norm_clip_2d(g, 1.0).clipped == pytest.approx((0.6, -0.8), rel=1e-5)


@pytest.mark.parametrize(
    "call",
    [
        lambda: C.norm_ball_figure(0.0),
        lambda: C.norm_ball_figure(20.0),
        lambda: C.norm_vs_value_figure(0.0),
        lambda: C.norm_vs_value_figure(50.0),
        lambda: C.layer_clamp_figure(0.0, [("w", torch.tensor([[0.5, -2.0]]))]),
        lambda: C.layer_clamp_figure(10.0, [("w", torch.tensor([[0.5, -2.0]]))]),
    ],
)
def test_figures_just_outside_their_sliders(call):
    # issue 21 item 13: a threshold of 0 or far above every gradient draws a figure
    assert isinstance(call(), Figure)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: C.norm_ball_figure(-1.0), "max_norm"),
        (lambda: C.norm_ball_figure(math.nan), "max_norm"),
        (lambda: C.norm_vs_value_figure(-1.0), "threshold"),
        (lambda: C.norm_vs_value_figure(math.nan), "threshold"),
        (lambda: C.layer_clamp_figure(-1.0, [("w", torch.ones(2))]), "clip_value"),
    ],
)
def test_bad_thresholds_are_refused_by_name(call, name):
    with pytest.raises(ValueError, match=name):
        call()
