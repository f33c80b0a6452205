"""Helpers for the tests of gradlab.clip: parameter sets, exact comparisons, references.

The references here are the mathematics written directly in float64 (a norm of the
concatenated entries, a max of absolute values), never gradlab itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from hypothesis import strategies as st

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}

# ------------------------------------------------------------------ parameter sets


def make_params(
    shapes: Sequence[tuple[int, ...]],
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    scale: float = 1.0,
) -> list[torch.nn.Parameter]:
    """Leaf parameters of the given shapes, each with a seeded normal ``.grad``."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
        params.append(p)
    return params


def copy_params(params: Sequence[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Independent copies of ``params`` with cloned gradients (None stays None)."""
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


def grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def snapshot(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in params]


# ------------------------------------------------------------------ exact comparisons


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float (or complex) tensor, as integers of the same width."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(_SAME_WIDTH_INT[t.dtype.itemsize])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same dtype, shape and every bit (NaN, -0.0)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert same_bits(a, b), f"not bit-for-bit equal:\n{a}\n{b}"


def assert_grads_unchanged(params: Sequence[torch.Tensor], before) -> None:
    for p, old in zip(params, before, strict=True):
        if old is None:
            assert p.grad is None
        else:
            assert_same_bits(p.grad, old)


def assert_all_plus_zero(params: Sequence[torch.Tensor]) -> None:
    """Every existing gradient is exactly +0.0 (all bits clear): no NaN, no -0.0."""
    for g in grads(params):
        assert not torch.any(bits(g)), f"not all +0.0: {g}"


# ------------------------------------------------------------------- the mathematics


def math_norm(tensors: Sequence[torch.Tensor], p: float) -> float:
    """The p-norm of all entries, concatenated, computed in float64 (0 if none)."""
    flat = torch.cat(
        [t.detach().reshape(-1).to(torch.float64) for t in tensors]
        or [torch.zeros(0, dtype=torch.float64)]
    )
    if flat.numel() == 0:
        return 0.0
    return float(torch.linalg.vector_norm(flat, p))


def math_max_abs(tensors: Sequence[torch.Tensor]) -> float:
    """max |entry| over all tensors, in float64 (exact); 0 if there are none."""
    values = [float(t.detach().abs().max()) for t in tensors if t.numel() > 0]
    return max(values, default=0.0)


def as_p(norm_type: float | str) -> float:
    return math.inf if norm_type == "inf" else float(norm_type)


# ------------------------------------------------------------------ strategies

NORM_TYPES = (1, 2, 2.0, 3.5, math.inf, "inf")

#: Shapes including 0-d tensors and tensors with no entries.
shape_st = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
shapes_st = st.lists(shape_st, min_size=1, max_size=5)
#: Where a threshold sits, relative to the quantity it is compared with.
factor_st = st.sampled_from([0.0, 0.25, 0.9999, 1.0, 1.0001, 4.0, math.inf])
seed_st = st.integers(0, 2**16)
scale_st = st.sampled_from([1e-3, 1.0, 1e3])
foreach_st = st.sampled_from([None, True, False])
