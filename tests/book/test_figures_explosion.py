"""Chapter 1's computations, checked against torch and the mathematics."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from gradlab_book.demos import backward
from gradlab_book.figures import explosion as E

DEPTHS = (1, 5, 10, 20, 40)
SCALES = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)


def _weights(depth, scale, width=32, seed=0):
    """The chain's weights drawn here, independently: float64 N(0, scale^2 / width)."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(width, width, generator=g, dtype=torch.float64) * (scale / math.sqrt(width))
        for _ in range(depth)
    ]


def _chain_inputs(width=32, batch=64, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    draw = [torch.randn(batch, width, generator=g, dtype=torch.float64) for _ in range(2)]
    return draw[0], draw[1]


def test_chain_model_is_float64_with_the_stated_weights():
    model = E.chain_model(3, 1.5)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    for layer, weight in zip(linears, _weights(3, 1.5), strict=True):
        assert layer.weight.dtype == torch.float64
        assert torch.equal(layer.weight, weight)
        assert torch.equal(layer.bias, torch.zeros(32, dtype=torch.float64))
    x, y = E.chain_inputs()
    ex, ey = _chain_inputs()
    assert torch.equal(x, ex) and torch.equal(y, ey)


@pytest.mark.parametrize("depth", [1, 7])
def test_chain_weight_gradients_match_plain_backward(depth):
    data = E.chain_gradients(depth, 1.5)
    h, (x, y) = None, _chain_inputs()
    weights = [w.requires_grad_() for w in _weights(depth, 1.5)]
    h = x
    for w in weights:
        h = torch.tanh(h @ w.T)
    loss = torch.nn.functional.mse_loss(h, y)
    loss.backward()
    np.testing.assert_allclose(data.weight_grad_norms, [w.grad.norm().item() for w in weights])
    assert data.loss == pytest.approx(loss.item(), rel=1e-12)


def test_chain_signal_at_input_matches_autograd():
    data = E.chain_gradients(6, 2.0)
    model = E.chain_model(6, 2.0)
    x, y = _chain_inputs()
    x.requires_grad_(True)
    backward(model, x, y)
    assert data.signal_norms[0] == pytest.approx(x.grad.norm().item(), rel=1e-12)


_NUMBERS = (
    "from gradlab_book.figures import explosion as E; import torch, json; "
    "torch.set_num_threads(1); "
    "print(json.dumps([list(E.chain_gradients(30, 4.0).signal_norms), "
    "list(E.rnn_state_gradients(50, 3.0).state_grad_norms), "
    "list(E.lstm_state_gradients(50, 3.0).state_grad_norms)]))"
)


def test_the_exploding_numbers_do_not_depend_on_the_cpus_kernels():
    # torch's float32 randn takes a vectorised path whose last bits depend on the CPU;
    # at scale 4 a chain multiplies that by its growth: with float32 draws, ||delta_0||
    # moved by 25% under ATEN_CPU_CAPABILITY=default. Float64 draws keep it to rounding.
    import json

    runs = []
    for env in ({}, {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}):
        out = subprocess.run(
            [sys.executable, "-c", _NUMBERS],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(json.loads(out.stdout))
    for native, other in zip(*runs, strict=True):
        np.testing.assert_allclose(native, other, rtol=1e-6)


@pytest.mark.parametrize("scale", [SCALES[0], SCALES[-1]])
@pytest.mark.parametrize("depth", [DEPTHS[0], DEPTHS[-1]])
def test_chain_extremes_bound_and_prediction(depth, scale):
    data = E.chain_gradients(depth, scale)
    assert data.signal_norms.shape == (depth + 1,)
    assert data.weight_grad_norms.shape == (depth,)
    # The spectral-norm bound holds at every layer.
    assert np.all(data.signal_norms <= data.bound * (1 + 1e-5))
    # The spectral norm is the largest singular value.
    first = _weights(depth, scale)[0]
    assert data.weight_spectral[0] == pytest.approx(
        torch.linalg.svdvals(first)[0].item(), rel=1e-12
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
    model = E.chain_model(4, 1.5, width=8, seed=3)
    x = torch.randn(8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    product = torch.eye(8, dtype=torch.float64)
    for jac in E.layer_jacobians(model, x):
        product = jac @ product
    full = torch.autograd.functional.jacobian(model, x)
    torch.testing.assert_close(product, full, rtol=1e-12, atol=1e-14)
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


def test_orthogonal_recurrence_has_every_singular_value_at_the_gain():
    data = E.rnn_state_gradients(50, 1.0, recurrent="orthogonal")
    assert data.recurrent_spectral == pytest.approx(1.0, rel=1e-12)
    # ||W_hh||_2 = 1: the bound forbids any growth, and tanh' < 1 makes it vanish
    assert np.all(data.state_grad_norms[:-1] <= data.state_grad_norms[-1] * (1 + 1e-9))
    assert data.measured_rate < 1
    scaled = E.rnn_state_gradients(10, 2.0, recurrent="orthogonal")
    assert scaled.recurrent_spectral == pytest.approx(2.0, rel=1e-12)
    with pytest.raises(ValueError, match="recurrent"):
        E.rnn_state_gradients(10, 1.0, recurrent="identity")


@pytest.mark.parametrize("forget_bias", [0.0, 3.0])
def test_lstm_is_torchs_lstm(forget_bias):
    steps, hidden, inputs = 12, 5, 3
    data = E.lstm_state_gradients(steps, forget_bias, hidden=hidden, inputs=inputs, seed=4)
    # the same draws, in the same order, into torch.nn.LSTM
    g = torch.Generator().manual_seed(4)
    k = 1 / math.sqrt(hidden)

    def uniform(*shape):
        return (2 * torch.rand(*shape, generator=g, dtype=torch.float64) - 1) * k

    w, u, b = uniform(4 * hidden, inputs), uniform(4 * hidden, hidden), uniform(4 * hidden)
    b[hidden : 2 * hidden] += forget_bias
    xs = torch.randn(steps, inputs, generator=g, dtype=torch.float64)
    lstm = torch.nn.LSTM(inputs, hidden).double()
    with torch.no_grad():
        lstm.weight_ih_l0.copy_(w)
        lstm.weight_hh_l0.copy_(u)
        lstm.bias_ih_l0.copy_(b)
        lstm.bias_hh_l0.zero_()
    h0 = torch.zeros(1, 1, hidden, dtype=torch.float64, requires_grad=True)
    c0 = torch.zeros(1, 1, hidden, dtype=torch.float64, requires_grad=True)
    out, _ = lstm(xs[:, None, :], (h0, c0))
    out[-1].square().mean().backward()
    at_start = math.sqrt(h0.grad.square().sum().item() + c0.grad.square().sum().item())
    assert data.state_grad_norms[0] == pytest.approx(at_start, rel=1e-10)
    assert data.state_grad_norms.shape == (steps + 1,)


def test_a_larger_forget_bias_carries_the_signal_further():
    rates = [E.lstm_state_gradients(50, b).measured_rate for b in (0.0, 1.0, 3.0)]
    assert rates == sorted(rates) and rates[-1] < 1.0
    assert E.lstm_state_gradients(20, 3.0).forget_gate_mean > 0.9


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: E.chain_figure(10, math.nan), "weight_scale"),
        (lambda: E.chain_figure(10, math.inf), "weight_scale"),
        (lambda: E.chain_figure(10, -1.0), "weight_scale"),
        (lambda: E.chain_figure(0, 1.0), "depth"),
        (lambda: E.chain_gradients(5, 1.0, batch=0), "batch"),
        (lambda: E.rnn_state_gradients(0, 1.0), "steps"),
        (lambda: E.rnn_state_gradients(5, math.nan), "recurrent_scale"),
        (lambda: E.lstm_state_gradients(5, math.inf), "forget_bias"),
    ],
)
def test_out_of_range_arguments_are_refused_by_name(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("depth", [2, 100])
@pytest.mark.parametrize("scale", [0.0, 1e-3, 16.0])
def test_chain_figure_just_outside_its_sliders(depth, scale):
    assert isinstance(E.chain_figure(depth, scale), Figure)


@pytest.mark.parametrize("factor", [0.0, 0.5, 1e3, 1e10, -5.0])
def test_outlier_figure_just_outside_its_slider(factor):
    assert isinstance(E.outlier_figure(factor), Figure)
