r"""Self-checking exercises of the chapter on per-sample clipping and differential privacy.

Same pattern as :mod:`gradlab_book.exercises`: a ``check_*`` function runs the
student's answer on a fixed battery of small, seeded cases, compares with float64
mathematics computed here independently (one sample at a time, in plain loops; never
with :mod:`gradlab.per_sample`), prints ``All N cases pass.`` or the first case that
fails (input, expected, got, and a hint), and returns True or False.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from gradlab_book.exercise_kit import (
    EPS,
    Raised,
    answer,
    call,
    indented,
    num,
    rejects_host_read,
    same,
    say,
    tensor_text,
    tolerance,
    value_text,
)

__all__ = ["GHOST_SIZE_LIMIT", "check_ghost_norm", "check_ignore_per_sample"]

#: The most entries any one tensor may have while an answer to the ghost-norm exercise
#: runs: far above what the Gram form needs (the large case's inputs hold 200,000
#: entries each), far below its per-sample gradients (2.5e9 entries per sample).
GHOST_SIZE_LIMIT = 10**8


# ------------------------------------------------------------- ignore per sample


@dataclass(frozen=True)
class _IgnoreCase:
    what: str
    grad_samples: tuple[Tensor, ...]
    max_norm: float
    hint: str = ""


def _seeded(shape, seed: int, dtype=torch.float64) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _sample_norm64(grad_samples: Sequence[Tensor], i: int) -> float:
    """Sample ``i``'s gradient norm over every tensor, in float64 (NaN/inf propagate)."""
    total = 0.0
    for g in grad_samples:
        for v in g[i].detach().to(torch.float64).reshape(-1).tolist():
            total += v * v
    return math.sqrt(total) if not math.isnan(total) else math.nan


def _keep(norm: float, max_norm: float) -> bool:
    # Python floats: C / inf = 0, inf / inf = NaN, and NaN >= 1 is False: dropped
    return max_norm / (norm + EPS) >= 1.0


def _expected_ignore(case: _IgnoreCase) -> tuple[list[Tensor], list[bool], list[float]]:
    batch = case.grad_samples[0].shape[0]
    norms = [_sample_norm64(case.grad_samples, i) for i in range(batch)]
    keep = [_keep(n, case.max_norm) for n in norms]
    sums = []
    for g in case.grad_samples:
        total = torch.zeros(g.shape[1:], dtype=torch.float64)
        for i in range(batch):
            if keep[i]:
                total = total + g[i].detach().to(torch.float64)
        sums.append(total)
    return sums, keep, norms


def _ignore_cases() -> list[_IgnoreCase]:
    f64, f32 = torch.float64, torch.float32

    def batch(shapes, b, seed, dtype=f64):
        return [_seeded((b, *s), seed + k, dtype) for k, s in enumerate(shapes)]

    cases = []
    g = batch([(3, 2), (3,)], 4, 1)
    cases.append(
        _IgnoreCase("4 samples, two tensors, every sample within max_norm", tuple(g), 10.0)
    )

    g = batch([(3, 2), (3,)], 4, 2)
    g[0][1] *= 20.0
    g[1][1] *= 20.0
    cases.append(
        _IgnoreCase(
            "sample 1 is far over max_norm",
            tuple(g),
            5.0,
            "a sample over max_norm contributes nothing: it is not clipped, it is left out.",
        )
    )

    g = batch([(2, 2), (2,)], 3, 3)
    for i in range(3):  # each tensor's norm below 2, the whole sample's above
        g[0][i] = torch.full((2, 2), 0.9, dtype=f64)
        g[1][i] = torch.full((2,), 1.2, dtype=f64)
    g[0][2] *= 0.1
    g[1][2] *= 0.1
    cases.append(
        _IgnoreCase(
            "samples 0 and 1 have every tensor within max_norm, but not the whole sample",
            tuple(g),
            2.0,
            "the norm of a sample is over all its tensors together: sqrt(sum of the "
            "squares of every entry of every tensor of that sample).",
        )
    )

    g = batch([(3, 2), (3,)], 5, 4)
    g[0][2, 1, 0] = math.nan
    cases.append(
        _IgnoreCase(
            "sample 2 has a NaN entry",
            tuple(g),
            10.0,
            "a NaN sample must be left out without a trace: multiplying it by 0 gives "
            "NaN (NaN * 0 = NaN); select with torch.where instead.",
        )
    )

    g = batch([(3, 2), (3,)], 5, 5)
    g[1][0, 2] = math.inf
    cases.append(
        _IgnoreCase(
            "sample 0 has an infinite entry",
            tuple(g),
            10.0,
            "inf * 0 is NaN too: select with torch.where.",
        )
    )

    g = batch([(4,)], 3, 6)
    g[0][0] = torch.tensor([3.0, 4.0, 0.0, 0.0], dtype=f64)  # norm exactly 5
    g[0][1] = torch.tensor([3.0, 3.999, 0.0, 0.0], dtype=f64)  # just under 5
    cases.append(
        _IgnoreCase(
            "sample 0 has norm exactly max_norm = 5, sample 1 just below",
            tuple(g),
            5.0,
            "the keep test is max_norm / (norm + 1e-6) >= 1, as in grad_ignore_norm_: a "
            "norm of exactly max_norm is dropped.",
        )
    )

    g = batch([(3, 2), (3,)], 4, 7)
    cases.append(
        _IgnoreCase(
            "every sample over max_norm",
            tuple(g),
            0.01,
            "when every sample is dropped the sum is zero (not NaN, not the mean of nothing).",
        )
    )

    g = batch([(2, 3), (3,), (2, 2, 2)], 6, 8, dtype=f32)
    g[0][4] *= 30.0
    g[2][5, 0, 1, 1] = math.nan
    cases.append(
        _IgnoreCase(
            "float32, three tensors, sample 4 over max_norm and sample 5 NaN",
            tuple(g),
            6.0,
            "the sums keep the dtype of the per-sample gradients (float32 here).",
        )
    )

    g = batch([(3,)], 1, 9)
    cases.append(_IgnoreCase("a batch of one sample, within max_norm", tuple(g), 10.0))

    g = batch([(3, 2), (3,)], 4, 10)
    g[0][1, 0, 0] = math.nan
    g[1][3, 1] = -math.inf
    cases.append(
        _IgnoreCase(
            "max_norm = inf, sample 1 NaN, sample 3 infinite",
            tuple(g),
            math.inf,
            "with max_norm = inf every finite sample is kept; a NaN or infinite one still "
            "is not (inf / inf is NaN, and NaN >= 1 is False).",
        )
    )
    return cases


def _grads_list_text(tensors: Sequence[Tensor]) -> str:
    return "[" + ", ".join(tensor_text(t) for t in tensors) + "]"


def check_ignore_per_sample(fn: Callable) -> bool:
    """Check ``fn(grad_samples, max_norm) -> list of tensors``: per-sample ignoring.

    The contract: ``grad_samples`` is a list of tensors of shape ``(B, *shape)``, one
    per parameter, row ``i`` of each being sample ``i``'s gradient. Sample ``i``'s norm
    is the 2-norm over all its tensors together; it is kept iff
    ``max_norm / (norm + 1e-6) >= 1`` (so a NaN or infinite sample is dropped). Return
    one tensor per parameter, of shape ``shape`` and the input's dtype: the sum of the
    kept samples' rows (zero if none is kept), with no trace of a dropped NaN or
    infinity. The inputs must not be modified, and nothing may read a tensor's value on
    the host (the decision stays on the device).

    Checked on ten cases: all kept, one sample far over, samples over only as a whole,
    a NaN sample, an infinite sample, a norm of exactly ``max_norm``, every sample
    dropped, float32 with three tensors, a batch of one, and ``max_norm = inf``.
    Expected sums are computed in float64, sample by sample.
    """
    if not callable(fn):
        say([f"Expected a function, got {value_text(fn)}."])
        return False
    cases = _ignore_cases()
    for index, case in enumerate(cases, start=1):
        inputs = [g.clone() for g in case.grad_samples]
        call_text = f"fn(grad_samples, max_norm={num(case.max_norm)})"
        expected, keep, norms = _expected_ignore(case)
        kept = [i for i, k in enumerate(keep) if k]
        header = [
            f"Case {index} of {len(cases)} fails: {case.what}.",
            f"  call: {call_text}, with {len(inputs)} tensor(s) of shapes "
            + ", ".join(str(tuple(g.shape)) for g in inputs),
            "  sample norms: " + ", ".join(num(n) for n in norms),
            "  samples to keep: " + (", ".join(map(str, kept)) if kept else "none"),
        ]
        hint = [f"  Hint: {case.hint}"] if case.hint else []
        ok, result, reads = answer(fn, call_text, header, hint, inputs, case.max_norm)
        if not ok:
            return False
        # first: an answer that changed its inputs gets that said, not a wrong-sums hint
        for k, (before, after) in enumerate(zip(case.grad_samples, inputs, strict=True)):
            if not torch.equal(before.nan_to_num(), after.nan_to_num()) or not torch.equal(
                before.isnan(), after.isnan()
            ):
                say(
                    [
                        *header,
                        f"  Your function modified grad_samples[{k}] in place; "
                        "leave the per-sample gradients as they are.",
                    ]
                )
                return False
        if isinstance(result, Tensor) or not isinstance(result, Sequence):
            say(
                [
                    *header,
                    "  expected: a list with one tensor per parameter",
                    f"  yours:    {value_text(result)}",
                ]
            )
            return False
        if len(result) != len(expected) or not all(isinstance(r, Tensor) for r in result):
            say(
                [
                    *header,
                    f"  expected: a list of {len(expected)} tensors",
                    f"  yours:    a {type(result).__name__} of {len(result)} item(s)",
                ]
            )
            return False
        rtol, atol = tolerance([g.dtype for g in inputs])
        shown = [e.to(g.dtype) for e, g in zip(expected, inputs, strict=True)]
        for k, (exp, got, g) in enumerate(zip(expected, result, inputs, strict=True)):
            if tuple(got.shape) != tuple(g.shape[1:]):
                say(
                    [
                        *header,
                        f"  tensor {k}: expected shape {tuple(g.shape[1:])}, "
                        f"yours {tuple(got.shape)}",
                        "  Hint: sum over the batch dimension (dim 0).",
                    ]
                )
                return False
            if got.dtype != g.dtype:
                say([*header, f"  tensor {k}: expected dtype {g.dtype}, yours {got.dtype}", *hint])
                return False
            if not same(exp, got, rtol, atol):
                say(
                    [
                        *header,
                        f"  expected sums: {_grads_list_text(shown)}",
                        f"  your sums:     {_grads_list_text(result)}",
                        f"  (the first difference is in tensor {k})",
                        *hint,
                    ]
                )
                return False
        if rejects_host_read(reads, f"Case {index} of {len(cases)}: {case.what}.", call_text):
            return False
    say([f"All {len(cases)} cases pass."])
    return True


# ------------------------------------------------------------------- ghost norm


class _TooLarge(Exception):
    pass


class _SizeLimit(TorchDispatchMode):
    """Refuse, before it is computed, any tensor of more than ``limit`` entries.

    Each operator is first run on meta tensors (shapes only, no data, no memory), so
    that the per-sample gradients of a 50,000 x 50,000 layer are refused without ever
    being allocated (they would need 10 GB per sample in float32).
    """

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.refused: tuple[str, tuple[int, ...]] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            meta_args, meta_kwargs = tree_map_only(Tensor, lambda t: t.to("meta"), (args, kwargs))
            shapes = func(*meta_args, **meta_kwargs)
        except Exception:  # no meta kernel (a host read, say): nothing to foresee
            shapes = None
        for t in tree_flatten(shapes)[0]:
            if isinstance(t, Tensor) and t.numel() > self.limit:
                self.refused = (str(func), tuple(t.shape))
                raise _TooLarge(f"{func} would make a tensor of shape {tuple(t.shape)}")
        return func(*args, **kwargs)


@dataclass(frozen=True)
class _GhostCase:
    what: str
    a: Tensor
    g: Tensor
    hint: str = ""
    #: the expected norms, when they are known in closed form (the large case, whose
    #: per-sample gradients are too large to form here too); else formed in float64
    expected: Tensor | None = None


def _large_case() -> _GhostCase:
    """d_in = d_out = 50,000 and T = 2, with norms known without the Gram form.

    Sample 0: a_1 = 2 a_0, so G = (g_0 + 2 g_1) a_0^T has rank one and norm
    |g_0 + 2 g_1| |a_0|. Sample 1: a_0 and a_1 have disjoint supports, and so do g_0 and
    g_1, so g_0 a_0^T and g_1 a_1^T fill disjoint blocks of G and
    |G|^2 = |g_0|^2 |a_0|^2 + |g_1|^2 |a_1|^2.
    """
    d, half = 50_000, 25_000
    a = _seeded((2, 2, d), 21)
    g = _seeded((2, 2, d), 22)
    a[0, 1] = 2.0 * a[0, 0]
    a[1, 0, half:] = 0.0
    a[1, 1, :half] = 0.0
    g[1, 0, half:] = 0.0
    g[1, 1, :half] = 0.0
    n0 = torch.linalg.vector_norm(g[0, 0] + 2.0 * g[0, 1]) * torch.linalg.vector_norm(a[0, 0])
    n1 = torch.sqrt(
        (torch.linalg.vector_norm(g[1, 0]) * torch.linalg.vector_norm(a[1, 0])) ** 2
        + (torch.linalg.vector_norm(g[1, 1]) * torch.linalg.vector_norm(a[1, 1])) ** 2
    )
    return _GhostCase(
        "a wide layer, d_in = d_out = 50,000, T = 2: each sample's weight gradient would "
        "hold 2.5e9 numbers, its two Gram matrices 4 each",
        a,
        g,
        "form (B, T, T) Gram matrices, a_t . a_s and g_t . g_s, never a (d_out, d_in) "
        "gradient (20 GB per sample in float64, as here).",
        expected=torch.stack([n0, n1]),
    )


def _expected_ghost(case: _GhostCase) -> Tensor:
    """Materialise sample i's weight gradient sum_t g_t a_t^T in float64; its norm."""
    if case.expected is not None:
        return case.expected
    a, g = case.a.double(), case.g.double()
    norms = []
    for i in range(a.shape[0]):
        grad = torch.zeros(g.shape[2], a.shape[2], dtype=torch.float64)
        for t in range(a.shape[1]):
            grad = grad + torch.outer(g[i, t], a[i, t])
        norms.append(torch.linalg.matrix_norm(grad))
    return torch.stack(norms)


def _ghost_cases() -> list[_GhostCase]:
    f32 = torch.float32
    cases = [
        _GhostCase(
            "one position (T = 1): B = 4, d_in = 3, d_out = 2",
            _seeded((4, 1, 3), 1),
            _seeded((4, 1, 2), 2),
        ),
        _GhostCase(
            "a sequence: B = 3, T = 4, d_in = 3, d_out = 2",
            _seeded((3, 4, 3), 3),
            _seeded((3, 4, 2), 4),
            "with several positions the gradient is sum_t g_t a_t^T; its squared norm "
            "has cross terms: sum over t and s of (a_t . a_s)(g_t . g_s).",
        ),
    ]
    a = _seeded((2, 3, 4), 5)
    g = _seeded((2, 3, 2), 6)
    g[:, 1] = -g[:, 0]  # positions whose gradients cancel
    a[:, 1] = a[:, 0]
    cases.append(
        _GhostCase(
            "positions that cancel: a_1 = a_0 and g_1 = -g_0 in every sample",
            a,
            g,
            "the gradients of two positions can cancel: square the norm of the sum, not "
            "sum the squared norms of the positions.",
        )
    )
    a = _seeded((5, 6, 2), 7)
    g = _seeded((5, 6, 3), 8)
    a[2, 3, 0] = math.nan
    cases.append(
        _GhostCase(
            "sample 2 has a NaN input: only its norm is NaN",
            a,
            g,
            "each sample's norm depends on that sample alone; do not mix samples (no sum "
            "or product over the batch dimension).",
        )
    )
    cases.append(
        _GhostCase(
            "float32, B = 3, T = 5, d_in = 4, d_out = 3",
            _seeded((3, 5, 4), 9, f32),
            _seeded((3, 5, 3), 10, f32),
            "return the norms in the dtype of the inputs.",
        )
    )
    cases.append(
        _GhostCase("a batch of one, T = 2", _seeded((1, 2, 3), 11), _seeded((1, 2, 3), 12))
    )
    cases.append(_large_case())
    return cases


def check_ghost_norm(fn: Callable) -> bool:
    r"""Check ``fn(a, g) -> (B,)``: the per-sample gradient norm of a Linear's weight.

    The contract: ``a`` is the layer's input, ``(B, T, d_in)``, ``g`` the gradient of
    the loss with respect to its output, ``(B, T, d_out)``. Return the ``(B,)`` norms
    :math:`\|\sum_t g_{it} a_{it}^\top\|_F`, one per sample, in the dtype of the
    inputs, without forming the ``(B, d_out, d_in)`` per-sample gradients. Expected
    norms are formed in float64 by materialising each sample's gradient, position by
    position; in the large case they are known in closed form (a rank-one gradient,
    and one made of disjoint blocks).

    Checked on seven cases: one position, a sequence, positions whose gradients cancel,
    a NaN input in one sample (only that sample's norm may be NaN), float32, a batch of
    one, and a layer with d_in = d_out = 50,000 at T = 2, where the per-sample gradients
    would hold 2.5e9 numbers each: the answer runs under a guard that refuses, before it
    is allocated, any tensor of more than :data:`GHOST_SIZE_LIMIT` entries, so an
    ``einsum`` that forms them fails with the reason.
    """
    if not callable(fn):
        say([f"Expected a function, got {value_text(fn)}."])
        return False
    cases = _ghost_cases()
    for index, case in enumerate(cases, start=1):
        a, g = case.a.clone(), case.g.clone()
        call_text = "fn(a, g)"
        header = [
            f"Case {index} of {len(cases)} fails: {case.what}.",
            f"  call: {call_text}, a of shape {tuple(a.shape)}, g of shape {tuple(g.shape)}",
        ]
        hint = [f"  Hint: {case.hint}"] if case.hint else []
        guard = _SizeLimit(GHOST_SIZE_LIMIT)
        try:
            with guard:
                result = call(fn, call_text, a, g)
        except Raised as raised:
            if raised.lines[0].startswith("Not implemented"):
                say(raised.lines)
            elif guard.refused is not None:
                op, shape = guard.refused
                size = math.prod(shape)
                say(
                    [
                        *header,
                        f"  Your function asked for a tensor of shape {shape} ({size:.2g} "
                        f"numbers, in {op}): it forms the per-sample gradients, which the "
                        "exercise forbids. It was stopped before the memory was taken.",
                        *hint,
                    ]
                )
            else:
                say([*header, *indented(raised.lines), *hint])
            return False
        if not (torch.equal(a.nan_to_num(), case.a.nan_to_num()) and torch.equal(g, case.g)):
            say([*header, "  Your function modified a or g in place."])
            return False
        expected = _expected_ghost(case)
        if not isinstance(result, Tensor):
            say(
                [
                    *header,
                    f"  expected: a tensor of shape ({a.shape[0]},)",
                    f"  yours:    {value_text(result)}",
                ]
            )
            return False
        if tuple(result.shape) != (a.shape[0],):
            say(
                [
                    *header,
                    f"  expected: a tensor of shape ({a.shape[0]},), one norm per sample",
                    f"  yours:    a tensor of shape {tuple(result.shape)}",
                ]
            )
            return False
        if result.dtype != a.dtype:
            say([*header, f"  expected dtype {a.dtype}, yours {result.dtype}", *hint])
            return False
        rtol, atol = tolerance([a.dtype])
        if not same(expected, result, rtol, atol):
            lines = [
                *header,
                f"  expected norms: {tensor_text(expected.to(a.dtype))}",
                f"  your norms:     {tensor_text(result)}",
            ]
            got64 = result.detach().double()
            if torch.allclose(got64, expected.square(), rtol=rtol, atol=atol, equal_nan=True):
                lines.append("  Yours are the squared norms: take the square root.")
            say([*lines, *hint])
            return False
    say([f"All {len(cases)} cases pass."])
    return True
