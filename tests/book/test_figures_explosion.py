"""Chapter 1's computations, checked against torch and the mathematics."""

import math

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from gradlab_book.demos import backward, tanh_chain
from gradlab_book.figures import explosion as E

DEPTHS = (1, 5, 10, 20, 40)
SCALES = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)


def _chain_inputs(width=32, batch=64, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


@pytest.mark.parametrize("depth", [1, 7])
def test_chain_weight_gradients_match_plain_backward(depth):
    data = E.chain_gradients(depth, 1.5)
    model = tanh_chain(depth, 32, 1.5, seed=0)
    x, y = _chain_inputs()
    loss = backward(model, x, y)
    norms = [m.weight.grad.norm().item() for m in model if isinstance(m, torch.nn.Linear)]
    np.testing.assert_allclose(data.weight_grad_norms, norms, rtol=1e-4)
    assert data.loss == pytest.approx(loss, rel=1e-5)


def test_chain_signal_at_input_matches_autograd():
    data = E.chain_gradients(6, 2.0)
    model = tanh_chain(6, 32, 2.0, seed=0)
    x, y = _chain_inputs()
    x.requires_grad_(True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert data.signal_norms[0] == pytest.approx(x.grad.norm().item(), rel=1e-4)


@pytest.mark.parametrize("scale", [SCALES[0], SCALES[-1]])
@pytest.mark.parametrize("depth", [DEPTHS[0], DEPTHS[-1]])
def test_chain_extremes_bound_and_prediction(depth, scale):
    data = E.chain_gradients(depth, scale)
    assert data.signal_norms.shape == (depth + 1,)
    assert data.weight_grad_norms.shape == (depth,)
    # The spectral-norm bound holds at every layer.
    assert np.all(data.signal_norms <= data.bound * (1 + 1e-5))
    # The spectral norm is the largest singular value.
    model = tanh_chain(depth, 32, scale, seed=0)
    first = next(m for m in model if isinstance(m, torch.nn.Linear))
    assert data.weight_spectral[0] == pytest.approx(
        torch.linalg.svdvals(first.weight)[0].item(), rel=1e-5
    )
    if depth >= 20:
        # The forward-pass prediction tracks the measured growth within 5%.
        assert data.measured_rate == pytest.approx(data.predicted_rate, rel=0.05)
        assert data.bound_rate > data.measured_rate


def test_chain_grows_with_scale_and_vanishes_below_one():
    low, high = E.chain_gradients(30, 0.5), E.chain_gradients(30, 3.0)
    assert low.measured_rate < 1 < high.measured_rate
    assert high.signal_norms[0] > high.signal_norms[-1] * 1e3


def test_chain_with_zero_weights_is_all_zero_but_safe():
    data = E.chain_gradients(5, 0.0)
    assert np.all(data.signal_norms[:-1] == 0)
    assert data.measured_rate == 0.0
    assert data.predicted_rate == 0.0
    assert isinstance(E.chain_figure(5, 0.0), Figure)


def test_layer_jacobians_multiply_to_the_chain_jacobian():
    model = tanh_chain(4, 8, 1.5, seed=3)
    x = torch.randn(8, generator=torch.Generator().manual_seed(0))
    product = torch.eye(8)
    for jac in E.layer_jacobians(model, x):
        product = jac @ product
    full = torch.autograd.functional.jacobian(model, x)
    torch.testing.assert_close(product, full, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        E.layer_jacobians(model, x[None])


def test_geometric_rate():
    assert E.geometric_rate(8.0, 1.0, 3) == pytest.approx(2.0)
    assert E.geometric_rate(0.0, 1.0, 3) == 0.0
    assert math.isnan(E.geometric_rate(math.nan, 1.0, 3))
    assert math.isnan(E.geometric_rate(math.inf, 1.0, 3))
    with pytest.raises(ValueError):
        E.geometric_rate(1.0, 1.0, 0)


@pytest.mark.parametrize("scale", [0.0, 0.5, 3.0])
def test_rnn_bound_and_autograd(scale):
    data = E.rnn_state_gradients(30, scale)
    assert data.state_grad_norms.shape == (31,)
    bound = data.state_grad_norms[-1] * data.recurrent_spectral ** np.arange(30, -1, -1)
    assert np.all(data.state_grad_norms <= bound * (1 + 1e-5) + 1e-30)
    if scale == 0.0:
        assert np.all(data.state_grad_norms[:-1] == 0)
        assert data.measured_rate == 0.0
    elif scale == 3.0:
        assert data.measured_rate > 1
    else:
        assert data.measured_rate < 1


def test_outlier_run_without_outlier_is_clean_and_loss_decreases():
    run = E.outlier_run(1.0)
    assert not run.diverged
    assert run.clean_loss[-1] < run.initial_clean_loss


def test_outlier_run_differs_from_clean_run_only_from_the_outlier_on():
    run = E.outlier_run(10.0, steps=3, outlier_step=2)
    clean = E.outlier_run(1.0, steps=3, outlier_step=2)
    np.testing.assert_allclose(run.grad_norm[:2], clean.grad_norm[:2])
    assert run.grad_norm[2] > 5 * clean.grad_norm[2]
    assert run.clean_loss[2] > clean.clean_loss[2]


def test_outlier_run_divergence_is_reported_and_drawn():
    run = E.outlier_run(100.0)
    assert run.diverged
    assert isinstance(E.outlier_figure(100.0), Figure)
    assert isinstance(E.outlier_figure(1.0), Figure)
    with pytest.raises(ValueError):
        E.outlier_run(2.0, steps=5, outlier_step=5)


def test_quadratic_descent_is_exact_along_the_top_eigenvector():
    lam = np.array([1.0, 4.0, 10.0])
    etas = np.linspace(0.0, 0.3, 31)
    # Along the top eigenvector the lemma is an equality.
    top = E.quadratic_descent(etas, lam, np.array([0.0, 0.0, 1.0]))
    np.testing.assert_allclose(top.change, top.bound, atol=1e-12)
    assert top.smoothness == 10.0
    # Elsewhere it is an upper bound, and a step decreases f whenever eta < 2/L.
    mixed = E.quadratic_descent(etas, lam, np.array([1.0, -2.0, 0.5]))
    assert np.all(mixed.change <= mixed.bound + 1e-12)
    assert np.all(mixed.change[(etas > 0) & (etas < 0.2)] < 0)
    with pytest.raises(ValueError):
        E.quadratic_descent(etas, np.array([-1.0]), np.array([1.0]))


def test_quadratic_descent_zero_gradient():
    data = E.quadratic_descent(np.array([0.1, 10.0]), np.array([1.0, 2.0]), np.zeros(2))
    assert data.grad_sq == 0.0
    np.testing.assert_array_equal(data.change, 0.0)


def test_step_profile_second_order_model_is_accurate_for_short_steps():
    data = E.step_profile(np.array([0.0, 1e-3, 2e-3, 0.4]))
    assert data.change[0] == 0.0
    # Small steps: the quadratic model matches to third order.
    np.testing.assert_allclose(data.change[1:3], data.quadratic[1:3], rtol=1e-2)
    assert data.curvature > 0
    assert data.change[-1] > 0  # the long step increases the loss


def test_step_profile_curvature_matches_finite_differences():
    h = 1e-3
    data = E.step_profile(np.array([-h, 0.0, h]))
    second = (data.change[0] - 2 * data.change[1] + data.change[2]) / h**2
    assert second == pytest.approx(data.curvature, rel=1e-3)


@pytest.mark.parametrize("max_length", [1e-3, 0.4, 5.0])
def test_step_profile_figure(max_length):
    assert isinstance(E.step_profile_figure(max_length, points=9), Figure)


@pytest.mark.parametrize("depth", [DEPTHS[0], DEPTHS[-1]])
@pytest.mark.parametrize("scale", [SCALES[0], SCALES[-1]])
def test_chain_figure_at_every_control_extreme(depth, scale):
    fig = E.chain_figure(depth, scale)
    assert isinstance(fig, Figure)
    assert tuple(fig.get_size_inches()) <= (6.4, 3.6)


def test_rnn_input_scale_changes_only_the_inputs():
    base = E.rnn_state_gradients(steps=20, recurrent_scale=2.0)
    same = E.rnn_state_gradients(steps=20, recurrent_scale=2.0, input_scale=1.0)
    assert np.array_equal(base.state_grad_norms, same.state_grad_norms)
    weak = E.rnn_state_gradients(steps=20, recurrent_scale=2.0, input_scale=0.1)
    # the same recurrent matrix; weaker inputs saturate fewer units: a faster rate
    assert weak.recurrent_spectral == base.recurrent_spectral
    assert weak.measured_rate > base.measured_rate
