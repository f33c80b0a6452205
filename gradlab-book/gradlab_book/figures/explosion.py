r"""Why gradients explode: chains, an outlier batch, one huge step (book/foundations/explode).

Compute functions return plain numbers and NumPy arrays (tested against torch and the
mathematics); figure functions draw them and are what the chapter's explorable
figures call.

* :func:`chain_gradients` backpropagates through a deep tanh chain and records, per
  layer, the backward signal :math:`\|\partial L/\partial h_l\|`, the weight-gradient
  norm, the spectral norm of the weights, and a prediction of the growth rate made
  from the forward pass alone.
* :func:`layer_jacobians` returns the per-layer Jacobians of one sample, whose product
  is the Jacobian of the whole chain.
* :func:`rnn_state_gradients` does the same for a vanilla RNN unrolled in time, its
  recurrent matrix Gaussian or orthogonal; :func:`lstm_state_gradients` for an LSTM,
  whose cell state is updated through gates: two remedies beyond clipping, measured.
* :func:`outlier_run` trains a small MLP with SGD and injects one corrupted batch.
* :func:`quadratic_descent` and :func:`step_profile` check the descent lemma
  :math:`f(\theta - \eta g) \le f(\theta) - \eta\|g\|^2 + \tfrac{L}{2}\eta^2\|g\|^2`.

Every random draw here is made in float64 and every model runs in float64. torch's
float32 ``randn`` takes a vectorised path for 16 numbers or more whose last bits depend
on the CPU's instruction set; a chain in the exploding regime multiplies such a
difference by about its growth rate per layer, so a float32 draw would move the
printed gradients by tens of percent from one CPU to another. Float64 draws are the
same on every machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from gradlab.clip import get_total_norm
from gradlab_book.demos import regression_data, small_mlp
from gradlab_book.plots import CLIP, IGNORE, KEEP, NONE, THRESHOLD, new_figure

__all__ = [
    "ChainGradients",
    "LSTMGradients",
    "OutlierRun",
    "QuadraticDescent",
    "RNNGradients",
    "StepProfile",
    "chain_figure",
    "chain_gradients",
    "chain_inputs",
    "chain_model",
    "geometric_rate",
    "layer_jacobians",
    "lstm_state_gradients",
    "outlier_figure",
    "outlier_run",
    "quadratic_descent",
    "rnn_state_gradients",
    "step_profile",
    "step_profile_figure",
]


# ---------------------------------------------------------------------- helpers


def _linears(model: nn.Sequential) -> list[nn.Linear]:
    return [m for m in model if isinstance(m, nn.Linear)]


def geometric_rate(first: float, last: float, steps: int) -> float:
    r"""The per-step factor r with ``first = last * r**steps``; 0 if either is 0.

    NaN when either value is not finite, so a broken run never reads as a rate.
    """
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    if not (math.isfinite(first) and math.isfinite(last)):
        return math.nan
    if first <= 0 or last <= 0:
        return 0.0
    return math.exp((math.log(first) - math.log(last)) / steps)


def _geometric_mean(values: np.ndarray) -> float:
    values = np.asarray(values, dtype=float)
    if values.size == 0 or not np.all(np.isfinite(values)):
        return math.nan
    if np.any(values <= 0):
        return 0.0
    return float(np.exp(np.mean(np.log(values))))


def _randn(generator: torch.Generator, *shape: int) -> Tensor:
    """Standard normal float64 numbers, the same on every CPU (see the module's note)."""
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def _check_scale(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")
    return value


def _check_count(name: str, value: int, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return int(value)


def _positive(values: np.ndarray) -> np.ndarray:
    """``values`` with zeros and non-finite entries replaced by NaN (log-axis safe)."""
    out = np.asarray(values, dtype=float).copy()
    out[~np.isfinite(out) | (out <= 0)] = np.nan
    return out


# ------------------------------------------------------------------ deep chain


@dataclass(frozen=True)
class ChainGradients:
    """Per-layer gradient statistics of one backward pass through a tanh chain.

    Layers are numbered 1..depth; ``h_0`` is the input.

    Attributes:
        depth, width, weight_scale: the chain.
        loss: the mean-squared error of the forward pass.
        signal_norms: ``||dL/dh_l||`` (Frobenius over the batch) for l = 0..depth.
        weight_grad_norms: ``||dL/dW_l||_F`` for l = 1..depth.
        weight_spectral: ``||W_l||_2`` (largest singular value) for l = 1..depth.
        predicted_factors: per layer, ``||W_l||_F / sqrt(width)`` times the root mean
            square of ``tanh'(a_l)`` over the batch: the factor by which a random
            backward signal is expected to grow through layer l, from the forward
            pass alone.
        bound: for l = 0..depth, ``||dL/dh_depth|| * prod_{k>l} ||W_k||_2``, an upper
            bound on ``signal_norms[l]`` (since ``|tanh'| <= 1``).
    """

    depth: int
    width: int
    weight_scale: float
    loss: float
    signal_norms: np.ndarray
    weight_grad_norms: np.ndarray
    weight_spectral: np.ndarray
    predicted_factors: np.ndarray
    bound: np.ndarray

    @property
    def measured_rate(self) -> float:
        """Geometric-mean growth per layer of the backward signal, output to input."""
        return geometric_rate(float(self.signal_norms[0]), float(self.signal_norms[-1]), self.depth)

    @property
    def predicted_rate(self) -> float:
        """Geometric mean of :attr:`predicted_factors`."""
        return _geometric_mean(self.predicted_factors)

    @property
    def bound_rate(self) -> float:
        """Geometric mean of the spectral norms: the growth rate the bound allows."""
        return _geometric_mean(self.weight_spectral)


def chain_model(depth: int, weight_scale: float, width: int = 32, seed: int = 0) -> nn.Sequential:
    """``depth`` float64 ``Linear``/``Tanh`` layers, weights N(0, weight_scale^2 / width).

    The architecture of :func:`gradlab_book.demos.tanh_chain`, biases zero, with the
    weights drawn in float64 (one seeded generator, layer after layer), so that every
    CPU builds the same chain.
    """
    depth, width = _check_count("depth", depth), _check_count("width", width)
    weight_scale = _check_scale("weight_scale", weight_scale)
    g = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        # skip_init: no default initialisation, which would draw from torch's global RNG
        layer = torch.nn.utils.skip_init(nn.Linear, width, width, dtype=torch.float64)
        with torch.no_grad():
            layer.weight.copy_(_randn(g, width, width) * (weight_scale / math.sqrt(width)))
            layer.bias.zero_()
        layers += [layer, nn.Tanh()]
    return nn.Sequential(*layers)


def chain_inputs(width: int = 32, batch: int = 64, seed: int = 0) -> tuple[Tensor, Tensor]:
    """The seeded standard-normal float64 inputs and targets of :func:`chain_gradients`."""
    width, batch = _check_count("width", width), _check_count("batch", batch)
    g = torch.Generator().manual_seed(seed + 1)
    return _randn(g, batch, width), _randn(g, batch, width)


def chain_gradients(
    depth: int,
    weight_scale: float,
    width: int = 32,
    batch: int = 64,
    seed: int = 0,
) -> ChainGradients:
    r"""Backpropagate an MSE loss through ``chain_model(depth, weight_scale, width, seed)``.

    The inputs and targets are :func:`chain_inputs`. Everything is float64, so that a
    signal vanishing like :math:`0.25^{40}` does not underflow to zero and the numbers
    are the same on every CPU; the forward pass is unrolled here only to keep the
    hidden states :math:`h_l`.
    """
    model = chain_model(depth, weight_scale, width, seed)
    x, y = chain_inputs(width, batch, seed)
    layers = _linears(model)
    model.zero_grad(set_to_none=True)
    h = x.clone().requires_grad_(True)
    states = [h]
    slopes = []
    for layer in layers:
        h = torch.tanh(layer(h))
        h.retain_grad()
        states.append(h)
        slopes.append(1.0 - h.detach() ** 2)  # tanh'(a) = 1 - tanh(a)^2
    loss = nn.functional.mse_loss(h, y)
    loss.backward()
    with torch.no_grad():
        signal = np.array([s.grad.norm().item() for s in states])
        wgrad = np.array([layer.weight.grad.norm().item() for layer in layers])
        spectral = np.array([torch.linalg.matrix_norm(lyr.weight, 2).item() for lyr in layers])
        predicted = np.array(
            [
                layer.weight.norm().item() / math.sqrt(width) * d.square().mean().sqrt().item()
                for layer, d in zip(layers, slopes, strict=True)
            ]
        )
    # bound[l] = ||delta_depth|| * prod_{k=l+1}^{depth} ||W_k||_2
    tail = np.concatenate([np.cumprod(spectral[::-1])[::-1], [1.0]])
    bound = signal[-1] * tail
    return ChainGradients(
        depth=depth,
        width=width,
        weight_scale=float(weight_scale),
        loss=float(loss.item()),
        signal_norms=signal,
        weight_grad_norms=wgrad,
        weight_spectral=spectral,
        predicted_factors=predicted,
        bound=bound,
    )


def layer_jacobians(model: nn.Sequential, x: Tensor) -> list[Tensor]:
    r"""The Jacobians :math:`J_l = \operatorname{diag}(\tanh'(a_l))\, W_l` of one sample.

    ``model`` is a chain of ``Linear``/``Tanh`` pairs and ``x`` a single input vector.
    :math:`J_{\text{depth}} \cdots J_1` is the Jacobian of the whole chain at ``x``.
    """
    if x.dim() != 1:
        raise ValueError(f"x must be one sample (a 1-D tensor), got shape {tuple(x.shape)}")
    jacobians = []
    h = x.detach()
    with torch.no_grad():
        for layer in _linears(model):
            h = torch.tanh(layer(h))
            jacobians.append((1.0 - h**2)[:, None] * layer.weight)
    return jacobians


# ------------------------------------------------------------------------- RNN


@dataclass(frozen=True)
class RNNGradients:
    """Backward signal through a vanilla tanh RNN unrolled over ``steps`` steps.

    Attributes:
        steps, recurrent_scale: the run.
        state_grad_norms: ``||dL/dh_t||`` for t = 0..steps (loss at the last step only).
        recurrent_spectral: ``||W_hh||_2``.
    """

    steps: int
    recurrent_scale: float
    state_grad_norms: np.ndarray
    recurrent_spectral: float
    recurrent: str = "gaussian"

    @property
    def measured_rate(self) -> float:
        """Geometric-mean growth per time step of the backward signal."""
        return geometric_rate(
            float(self.state_grad_norms[0]), float(self.state_grad_norms[-1]), self.steps
        )


def rnn_state_gradients(
    steps: int,
    recurrent_scale: float,
    hidden: int = 32,
    inputs: int = 4,
    seed: int = 0,
    input_scale: float = 1.0,
    recurrent: str = "gaussian",
) -> RNNGradients:
    r"""Unroll :math:`h_t = \tanh(W_{hh} h_{t-1} + W_{xh} x_t)` and backpropagate.

    ``recurrent="gaussian"``: :math:`W_{hh}` has N(0, recurrent_scale^2 / hidden)
    entries. ``"orthogonal"``: :math:`W_{hh}` is recurrent_scale times the orthogonal
    factor Q of the QR decomposition of a Gaussian matrix (signs fixed by R's
    diagonal), so every singular value is recurrent_scale, the initialisation of
    Saxe et al. (2014) at gain recurrent_scale. The input weights are
    N(0, 1 / inputs), the inputs :math:`x_t` N(0, input_scale^2); the loss is the mean
    square of :math:`h_T`. The *same* matrix appears in every step's Jacobian, so the
    signal reaching :math:`h_0` is bounded by :math:`\|W_{hh}\|_2^{T}` times the one
    at :math:`h_T`. Float64 throughout (draws included), the same on every CPU.
    """
    steps, hidden = _check_count("steps", steps), _check_count("hidden", hidden)
    inputs = _check_count("inputs", inputs)
    recurrent_scale = _check_scale("recurrent_scale", recurrent_scale)
    input_scale = _check_scale("input_scale", input_scale)
    if recurrent not in ("gaussian", "orthogonal"):
        raise ValueError(f"recurrent must be 'gaussian' or 'orthogonal', got {recurrent!r}")
    g = torch.Generator().manual_seed(seed)
    gaussian = _randn(g, hidden, hidden)
    if recurrent == "gaussian":
        w_hh = gaussian * (recurrent_scale / math.sqrt(hidden))
    else:
        q, r = torch.linalg.qr(gaussian)
        w_hh = q * torch.sign(torch.diagonal(r)) * recurrent_scale
    w_xh = _randn(g, hidden, inputs) / math.sqrt(inputs)
    xs = _randn(g, steps, inputs) * input_scale
    h = torch.zeros(hidden, dtype=torch.float64, requires_grad=True)
    states = [h]
    for t in range(steps):
        h = torch.tanh(w_hh @ h + w_xh @ xs[t])
        h.retain_grad()
        states.append(h)
    loss = h.square().mean()
    loss.backward()
    norms = np.array([s.grad.norm().item() for s in states])
    return RNNGradients(
        steps=steps,
        recurrent_scale=recurrent_scale,
        state_grad_norms=norms,
        recurrent_spectral=float(torch.linalg.matrix_norm(w_hh, 2).item()),
        recurrent=recurrent,
    )


@dataclass(frozen=True)
class LSTMGradients:
    """Backward signal through an LSTM unrolled over ``steps`` steps.

    Attributes:
        steps, forget_bias: the run.
        state_grad_norms: for t = 0..steps, the norm of the gradient of the loss with
            respect to the state :math:`(h_t, c_t)`, both halves together (the loss is
            on :math:`h_T` only).
        forget_gate_mean: the mean of the forget gate :math:`f_t` over units and steps.
    """

    steps: int
    forget_bias: float
    state_grad_norms: np.ndarray
    forget_gate_mean: float

    @property
    def measured_rate(self) -> float:
        """Geometric-mean growth per time step of the backward signal."""
        return geometric_rate(
            float(self.state_grad_norms[0]), float(self.state_grad_norms[-1]), self.steps
        )


def lstm_state_gradients(
    steps: int,
    forget_bias: float = 0.0,
    hidden: int = 32,
    inputs: int = 4,
    seed: int = 0,
    input_scale: float = 1.0,
) -> LSTMGradients:
    r"""Unroll an LSTM (Hochreiter and Schmidhuber, 1997) and backpropagate.

    .. math::
        (i, f, g, o)_t = (\sigma, \sigma, \tanh, \sigma)(W x_t + U h_{t-1} + b), \quad
        c_t = f_t \odot c_{t-1} + i_t \odot g_t, \quad h_t = o_t \odot \tanh(c_t),

    the equations of :class:`torch.nn.LSTM`, with its initialisation: every weight
    and bias uniform in :math:`\pm 1/\sqrt{\text{hidden}}`, plus ``forget_bias`` on
    the forget gate's bias (a larger bias keeps :math:`f_t` near 1). Along the cell
    state the backward signal is multiplied by :math:`f_t`, a number in (0, 1), not
    by a weight matrix. Inputs N(0, input_scale^2), the loss the mean square of
    :math:`h_T`; float64 throughout, draws included.
    """
    steps, hidden = _check_count("steps", steps), _check_count("hidden", hidden)
    inputs = _check_count("inputs", inputs)
    input_scale = _check_scale("input_scale", input_scale)
    forget_bias = float(forget_bias)
    if not math.isfinite(forget_bias):
        raise ValueError(f"forget_bias must be a finite number, got {forget_bias!r}")
    g = torch.Generator().manual_seed(seed)
    k = 1.0 / math.sqrt(hidden)

    def uniform(*shape: int) -> Tensor:
        return (2.0 * torch.rand(*shape, generator=g, dtype=torch.float64) - 1.0) * k

    w, u, b = uniform(4 * hidden, inputs), uniform(4 * hidden, hidden), uniform(4 * hidden)
    b[hidden : 2 * hidden] += forget_bias  # gate order i, f, g, o, as in torch.nn.LSTM
    xs = _randn(g, steps, inputs) * input_scale
    h = torch.zeros(hidden, dtype=torch.float64, requires_grad=True)
    c = torch.zeros(hidden, dtype=torch.float64, requires_grad=True)
    states, forget = [(h, c)], []
    for t in range(steps):
        i_t, f_t, g_t, o_t = (w @ xs[t] + u @ h + b).chunk(4)
        f_t = torch.sigmoid(f_t)
        c = f_t * c + torch.sigmoid(i_t) * torch.tanh(g_t)
        h = torch.sigmoid(o_t) * torch.tanh(c)
        h.retain_grad()
        c.retain_grad()
        states.append((h, c))
        forget.append(f_t.detach())
    h.square().mean().backward()

    def grad_norm(t: Tensor) -> float:
        return 0.0 if t.grad is None else float(t.grad.square().sum())

    norms = np.array([math.sqrt(grad_norm(a) + grad_norm(b)) for a, b in states])
    return LSTMGradients(
        steps=steps,
        forget_bias=forget_bias,
        state_grad_norms=norms,
        forget_gate_mean=float(torch.stack(forget).mean()),
    )


def chain_figure(depth: int = 20, weight_scale: float = 1.5, width: int = 32) -> Figure:
    """Per-layer backward-signal and weight-gradient norms of a tanh chain, log scale."""
    data = chain_gradients(depth, weight_scale, width=width)
    layers = np.arange(data.depth + 1)
    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot()
    ax.set_yscale("log")
    ax.plot(
        layers,
        _positive(data.bound),
        ls="--",
        color=NONE,
        label=r"bound $\|\delta_D\|\prod_{l'>l}\|W_{l'}\|_2$",
    )
    ax.plot(
        layers,
        _positive(data.signal_norms),
        "o-",
        color=KEEP,
        ms=3,
        label=r"$\|\partial \mathcal{L}/\partial h_l\|$ measured",
    )
    ax.plot(
        layers[1:],
        _positive(data.weight_grad_norms),
        "s",
        color=IGNORE,
        ms=3,
        label=r"$\|\partial \mathcal{L}/\partial W_l\|_F$",
    )
    rate = data.predicted_rate
    if math.isfinite(rate) and rate > 0:
        predicted = data.signal_norms[-1] * rate ** (data.depth - layers)
        ax.plot(
            layers,
            _positive(predicted),
            ls=(0, (1, 1.5)),
            color=CLIP,
            lw=2.5,
            label=f"predicted from the forward pass, r = {rate:.3g}",
        )
    ax.set_ylim(1e-12, 1e12)
    ax.set_xlim(-0.5, max(data.depth, 1) + 0.5)
    ax.set_xlabel("layer l (0 = input)")
    ax.set_ylabel("gradient norm")
    measured = data.measured_rate
    shown = f"{measured:.3g}" if math.isfinite(measured) else "n/a"
    ax.set_title(
        f"depth {data.depth}, weight scale {data.weight_scale:g}: "
        f"measured growth per layer {shown}",
        fontsize=10,
    )
    ax.legend(loc="lower left", fontsize=8)
    return fig


# -------------------------------------------------------------- outlier batch


@dataclass(frozen=True)
class OutlierRun:
    """One SGD run of a small MLP with one corrupted batch.

    Attributes:
        outlier_scale, outlier_step, lr: the run.
        batch_loss: the loss of each step's batch, before its update.
        grad_norm: the total 2-norm of each step's gradient.
        clean_loss: the loss on the clean training set *after* each step's update.
        initial_clean_loss: the clean loss before any step.
    """

    outlier_scale: float
    outlier_step: int
    lr: float
    batch_loss: np.ndarray
    grad_norm: np.ndarray
    clean_loss: np.ndarray
    initial_clean_loss: float

    @property
    def diverged(self) -> bool:
        """True when some loss or norm became infinite or NaN."""
        values = np.concatenate([self.batch_loss, self.grad_norm, self.clean_loss])
        return not bool(np.all(np.isfinite(values)))


def outlier_run(
    outlier_scale: float,
    steps: int = 40,
    outlier_step: int = 20,
    lr: float = 0.05,
    batch: int = 32,
    seed: int = 0,
) -> OutlierRun:
    r"""Train ``small_mlp`` with plain SGD; at ``outlier_step`` the targets are scaled.

    The corrupted batch has its targets multiplied by ``outlier_scale`` (1 means no
    corruption), a stand-in for a mislabelled or mis-normalised batch. Batches are
    drawn with a seeded generator, so the runs for different scales see the same
    data at every other step.
    """
    if not 0 <= outlier_step < steps:
        raise ValueError(f"outlier_step must be in [0, {steps}), got {outlier_step}")
    x, y = regression_data(256, d_in=4, d_out=1, noise=0.1, seed=seed)
    model = small_mlp(4, 16, 1, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1)

    def clean() -> float:
        with torch.no_grad():
            return nn.functional.mse_loss(model(x), y).item()

    initial = clean()
    batch_loss, grad_norm, clean_loss = [], [], []
    for step in range(steps):
        index = torch.randint(0, x.shape[0], (batch,), generator=g)
        xb, yb = x[index], y[index]
        if step == outlier_step:
            yb = yb * outlier_scale
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        batch_loss.append(loss.item())
        grad_norm.append(get_total_norm([p.grad for p in model.parameters()]).item())
        optimizer.step()
        clean_loss.append(clean())
    return OutlierRun(
        outlier_scale=float(outlier_scale),
        outlier_step=outlier_step,
        lr=lr,
        batch_loss=np.array(batch_loss),
        grad_norm=np.array(grad_norm),
        clean_loss=np.array(clean_loss),
        initial_clean_loss=initial,
    )


def _plot_capped(ax, steps: np.ndarray, values: np.ndarray, top: float) -> None:
    """Plot ``values`` on a log axis; values above ``top``, inf or NaN become crosses at top."""
    off = ~np.isfinite(values) | (values > top)
    shown = _positive(values)
    shown[off] = np.nan
    ax.plot(steps, shown, "o-", color=KEEP, ms=3)
    if off.any():
        ax.plot(
            steps[off],
            np.full(off.sum(), top),
            "x",
            color=IGNORE,
            ms=6,
            label="off the chart / inf / NaN",
        )


def outlier_figure(outlier_scale: float = 10.0, steps: int = 40, outlier_step: int = 20) -> Figure:
    """Gradient norm and clean loss of an SGD run with one corrupted batch."""
    run = outlier_run(outlier_scale, steps=steps, outlier_step=outlier_step)
    t = np.arange(steps)
    fig = new_figure(6.4, 3.4)
    ax_norm, ax_loss = fig.subplots(1, 2)
    top = 1e8
    for ax in (ax_norm, ax_loss):
        ax.set_yscale("log")
        ax.axvline(outlier_step, color=IGNORE, lw=1, alpha=0.6)
        ax.set_xlabel("step")
        ax.set_ylim(1e-2, top * 3)
    _plot_capped(ax_norm, t, run.grad_norm, top)
    ax_norm.set_title(r"gradient norm $\|g_t\|_2$", fontsize=10)
    ax_loss.axhline(run.initial_clean_loss, color=NONE, ls=":", lw=1, label="before training")
    _plot_capped(ax_loss, t, run.clean_loss, top)
    ax_loss.set_title("clean training loss after the step", fontsize=10)
    ax_loss.legend(loc="upper left", fontsize=8)
    verdict = "the run diverges" if run.diverged else "the run survives"
    fig.suptitle(
        f"one batch with targets x{run.outlier_scale:g} at step {outlier_step}: {verdict}",
        fontsize=10,
    )
    return fig


# ----------------------------------------------------------- the descent lemma


@dataclass(frozen=True)
class QuadraticDescent:
    r"""One gradient step on the quadratic :math:`f(\theta) = \tfrac12 \sum_i \lambda_i \theta_i^2`.

    Attributes:
        etas: the step sizes tried.
        smoothness: L, the largest eigenvalue.
        grad_sq: :math:`\|g\|^2` at the starting point.
        change: the exact :math:`f(\theta - \eta g) - f(\theta)` for each step size.
        bound: :math:`-\eta\|g\|^2 + \tfrac{L}{2}\eta^2\|g\|^2` for each step size.
    """

    etas: np.ndarray
    smoothness: float
    grad_sq: float
    change: np.ndarray
    bound: np.ndarray


def quadratic_descent(
    etas: np.ndarray, eigenvalues: np.ndarray, theta: np.ndarray
) -> QuadraticDescent:
    r"""Exact change of a quadratic after one gradient step, and the descent-lemma bound.

    Computed in float64 with torch autograd for the gradient.
    """
    lam = torch.as_tensor(np.asarray(eigenvalues, dtype=float))
    if lam.numel() == 0 or bool((lam < 0).any()):
        raise ValueError("eigenvalues must be non-empty and non-negative")
    start = torch.as_tensor(np.asarray(theta, dtype=float)).clone().requires_grad_(True)

    def f(th: Tensor) -> Tensor:
        return 0.5 * (lam * th * th).sum()

    value = f(start)
    (grad,) = torch.autograd.grad(value, start)
    smoothness = float(lam.max())
    grad_sq = float(grad.square().sum())
    etas = np.asarray(etas, dtype=float)
    with torch.no_grad():
        change = np.array([float(f(start - eta * grad) - value) for eta in etas])
    bound = -etas * grad_sq + 0.5 * smoothness * etas**2 * grad_sq
    return QuadraticDescent(etas, smoothness, grad_sq, change, bound)


@dataclass(frozen=True)
class StepProfile:
    r"""The clean loss of a trained MLP along its own gradient direction.

    With :math:`u = g/\|g\|` and step length :math:`s` (a step :math:`\eta g` has
    :math:`s = \eta\|g\|`):

    Attributes:
        lengths: the step lengths s.
        change: the exact :math:`f(\theta - s u) - f(\theta)`.
        linear: the first-order model :math:`-s\|g\|`.
        quadratic: the second-order model :math:`-s\|g\| + \tfrac{c}{2}s^2`.
        grad_norm: :math:`\|g\|`.
        curvature: :math:`c = u^\top H u`, the curvature along :math:`u` at
            :math:`\theta` (a Hessian-vector product).
    """

    lengths: np.ndarray
    change: np.ndarray
    linear: np.ndarray
    quadratic: np.ndarray
    grad_norm: float
    curvature: float

    @property
    def best_length(self) -> float:
        """Where the quadratic model is lowest, :math:`\\|g\\|/c` (inf if c <= 0)."""
        return self.grad_norm / self.curvature if self.curvature > 0 else math.inf


def step_profile(lengths: np.ndarray, warmup_steps: int = 20, seed: int = 0) -> StepProfile:
    """Train ``small_mlp`` for ``warmup_steps`` clean full-batch SGD steps, then probe.

    The loss is evaluated in float64 so the small steps' changes are exact enough.
    """
    x, y = regression_data(256, d_in=4, d_out=1, noise=0.1, seed=seed)
    model = small_mlp(4, 16, 1, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(warmup_steps):
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    model = model.double()
    x64, y64 = x.double(), y.double()
    params = list(model.parameters())
    loss = nn.functional.mse_loss(model(x64), y64)
    base = loss.item()
    grads = torch.autograd.grad(loss, params, create_graph=True)
    flat = torch.cat([g.reshape(-1) for g in grads])
    grad_norm = flat.norm()
    direction = [(g / grad_norm).detach() for g in grads]
    directional = sum((g * u).sum() for g, u in zip(grads, direction, strict=True))
    hvp = torch.autograd.grad(directional, params)
    curvature = float(sum((h * u).sum() for h, u in zip(hvp, direction, strict=True)))
    lengths = np.asarray(lengths, dtype=float)
    changes = []
    with torch.no_grad():
        originals = [p.detach().clone() for p in params]
        for s in lengths:
            for p, p0, u in zip(params, originals, direction, strict=True):
                p.copy_(p0 - s * u)
            changes.append(float(nn.functional.mse_loss(model(x64), y64)) - base)
        for p, p0 in zip(params, originals, strict=True):
            p.copy_(p0)
    gn = grad_norm.item()
    return StepProfile(
        lengths=lengths,
        change=np.array(changes),
        linear=-lengths * gn,
        quadratic=-lengths * gn + 0.5 * curvature * lengths**2,
        grad_norm=gn,
        curvature=curvature,
    )


def step_profile_figure(max_length: float = 0.4, points: int = 41, lr: float = 0.05) -> Figure:
    """The clean loss along the gradient direction vs its first- and second-order models."""
    lengths = np.linspace(0.0, max_length, points)
    data = step_profile(lengths)
    fig = new_figure(6.4, 3.4)
    ax = fig.add_subplot()
    ax.plot(lengths, data.change, color=KEEP, lw=2, label=r"exact $f(\theta - d u) - f(\theta)$")
    ax.plot(lengths, data.linear, color=NONE, ls="--", label=r"first order $-d\|g\|$")
    ax.plot(
        lengths,
        data.quadratic,
        color=CLIP,
        ls=":",
        lw=2,
        label=r"second order, $\kappa = u^\top H u$",
    )
    ax.axhline(0, color=THRESHOLD, lw=0.8)
    if math.isfinite(data.best_length):
        ax.axvline(2 * data.best_length, color=IGNORE, lw=1, ls="-.", label=r"$d = 2\|g\|/\kappa$")
    sgd = lr * data.grad_norm
    ax.axvline(sgd, color=KEEP, lw=1, ls="-.", label=rf"the SGD step $\eta\|g\|$, $\eta$ = {lr:g}")
    finite = data.change[np.isfinite(data.change)]
    low = min(float(finite.min()) if finite.size else 0.0, -1e-3)
    ax.set_ylim(3 * low, 6 * abs(low))
    ax.set_xlabel(r"step length $d = \eta\|g\|$")
    ax.set_ylabel("change of the clean loss")
    ax.legend(loc="upper left", fontsize=8)
    return fig
