"""What the integration tests share: a tiny regression task and bitwise comparisons.

Every trainer's test builds the same two-layer model from the same seed and feeds it
the same batches, so that a run which skipped a bad batch can be compared bit for bit
with a run that never saw it. The comparisons read raw bits (NaN payloads and signed
zeros included), never gradlab.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

IN, HIDDEN = 8, 16
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tiny_model(seed: int = 0, bias: bool = True) -> nn.Module:
    """Linear, Tanh, Linear: 161 parameters (144 without biases), the same for a seed."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(IN, HIDDEN, bias=bias), nn.Tanh(), nn.Linear(HIDDEN, 1, bias=bias)
        )


def batches(
    n: int, size: int = 16, seed: int = 1, scale: float = 1.0
) -> list[tuple[Tensor, Tensor]]:
    """``n`` (x, y) batches of a noisy linear target; ``scale`` multiplies x and y."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(IN, 1, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(size, IN, generator=g)
        y = x @ w + 0.1 * torch.randn(size, 1, generator=g)
        out.append((scale * x, scale * y))
    return out


def poisoned(batch: tuple[Tensor, Tensor], value: float = math.nan) -> tuple[Tensor, Tensor]:
    """A copy of ``batch`` with one input entry set to ``value`` (NaN or inf)."""
    x, y = batch
    x = x.clone()
    x[0, 0] = value
    return x, y


def bits(t: Tensor) -> Tensor:
    """The raw bits of a tensor, as integers of its width (a copy on the CPU)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool or not t.is_floating_point():
        return t.clone()
    return t.view(_BITS[t.element_size()]).clone()


def assert_same_bits(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` (nested dicts, lists, tensors, numbers) are bitwise identical."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        assert isinstance(a, Tensor) and isinstance(b, Tensor), f"{where}: tensor vs {type(b)}"
        assert a.shape == b.shape and a.dtype == b.dtype, (
            f"{where}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        )
        assert torch.equal(bits(a), bits(b)), f"{where}: values differ\n{a}\n{b}"
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and a.keys() == b.keys(), (
            f"{where}: keys {list(a)} vs {list(b)}"
        )
        for k in a:
            assert_same_bits(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, Sequence) and not isinstance(a, str):
        assert isinstance(b, Sequence) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_bits(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{where}: nan vs {b!r}"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def params_of(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's own state dict (without a guard's entry), detached copies."""
    state = dict(optimizer.state_dict())
    state.pop("gradlab_guard", None)
    return state


def any_nonfinite(model: nn.Module) -> bool:
    return any(not torch.isfinite(p).all() for p in model.parameters())
