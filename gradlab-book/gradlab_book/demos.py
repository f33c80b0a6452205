"""Small, seeded models and data for the book's demonstrations.

Everything here is deterministic given its ``seed`` and small enough to run on a
laptop CPU in milliseconds, so the book's numbers reproduce exactly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = [
    "backward",
    "grad_holders",
    "gradients",
    "linear_model",
    "mse_or_inf",
    "regression_data",
    "small_mlp",
    "tanh_chain",
]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def regression_data(
    n: int, d_in: int = 4, d_out: int = 1, noise: float = 0.1, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``n`` samples ``(x, y)`` of a fixed linear teacher ``y = x W + noise``."""
    g = _generator(seed)
    teacher = torch.randn(d_in, d_out, generator=g)
    x = torch.randn(n, d_in, generator=g)
    y = x @ teacher + noise * torch.randn(n, d_out, generator=g)
    return x, y


def linear_model(d_in: int = 4, d_out: int = 1, seed: int = 0) -> nn.Linear:
    """A seeded ``nn.Linear``."""
    torch.manual_seed(seed)
    return nn.Linear(d_in, d_out)


def small_mlp(d_in: int = 4, hidden: int = 16, d_out: int = 1, seed: int = 0) -> nn.Sequential:
    """A seeded two-layer ReLU MLP."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def tanh_chain(
    depth: int, width: int = 32, weight_scale: float = 1.0, seed: int = 0
) -> nn.Sequential:
    """``depth`` tanh layers whose weights are N(0, weight_scale^2 / width).

    ``weight_scale`` near 1 is the classic initialisation; above it the layer
    Jacobians expand and gradients grow geometrically with depth.
    """
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    g = _generator(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layer = nn.Linear(width, width)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(width, width, generator=g) * weight_scale / width**0.5)
            layer.bias.zero_()
        layers += [layer, nn.Tanh()]
    return nn.Sequential(*layers)


def backward(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Zero the gradients, compute the mean-squared error, backpropagate; return the loss."""
    model.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item()


def mse_or_inf(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """The mean-squared error of ``model`` on ``(x, y)``, no gradients (inf if not finite)."""
    with torch.no_grad():
        value = nn.functional.mse_loss(model(x), y).item()
    return value if math.isfinite(value) else math.inf


def gradients(model: nn.Module) -> list[Tensor]:
    """Detached copies of the model's current gradients (``None`` ones left out)."""
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def grad_holders(grads: list[Tensor], dtype: torch.dtype | None = None) -> list[Tensor]:
    """Fresh tensors whose ``.grad`` are copies of ``grads`` (cast to ``dtype`` if given).

    Lets a gradlab function act on recorded gradients, again and again, without
    touching the originals.
    """
    holders = []
    for grad in grads:
        holder = torch.zeros_like(grad, dtype=dtype)
        holder.grad = grad.detach().to(dtype=holder.dtype, copy=True)
        holders.append(holder)
    return holders
