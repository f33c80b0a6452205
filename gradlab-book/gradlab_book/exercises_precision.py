r"""Self-checking exercises of the mixed-precision chapter (book/scale/mixed_precision).

Same pattern as :mod:`gradlab_book.exercises`: a ``check_*`` function runs the
student's answer on a fixed battery of small cases, compares it with a reference
computed independently in float64 on the host, and prints ``All N cases pass.`` or
the first case that fails, with what was expected and why. It returns True or
False and never raises because an answer is wrong.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from gradlab_book.exercise_kit import (
    Raised,
    call,
    num,
    say,
    tensor_text,
    value_text,
)

__all__ = ["FLOAT16_OVERFLOW", "MAX_LOG2_SCALE", "MIN_LOG2_SCALE", "check_max_loss_scale"]

#: The smallest magnitude that rounds to inf in float16: halfway from 65504 to 2**16.
FLOAT16_OVERFLOW = 65520.0
#: The powers of two the answer may choose from: 2**MIN_LOG2_SCALE ... 2**MAX_LOG2_SCALE.
MIN_LOG2_SCALE = -24
MAX_LOG2_SCALE = 24


def reference_max_loss_scale(grads: list[Tensor]) -> float | None:
    """The answer, in float64 on the host: the largest allowed 2**k with 2**k m < 65520."""
    largest = 0.0
    for g in grads:
        if g.numel() == 0:
            continue
        g64 = g.detach().to("cpu", torch.float64)
        if bool(torch.isnan(g64).any()):
            return None
        largest = max(largest, float(g64.abs().max()))
    if math.isinf(largest):
        return None
    if largest == 0.0:
        return 2.0**MAX_LOG2_SCALE
    for k in range(MAX_LOG2_SCALE, MIN_LOG2_SCALE - 1, -1):
        if math.ldexp(largest, k) < FLOAT16_OVERFLOW:  # exact: a power of two
            return 2.0**k
    return None


@dataclass(frozen=True)
class _Case:
    text: str  # what the case is, for the verdict
    grads: tuple[Tensor, ...]
    why: str = ""  # what a wrong answer has probably missed
    generator: bool = False


def _t(values, dtype=torch.float32) -> Tensor:
    return torch.tensor(values, dtype=dtype)


def _seeded(shape, seed: int, scale: float, dtype=torch.float32) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def _cases() -> list[_Case]:
    below = 65510.0 / 2**10  # 2**10 times it is 65510: rounds down to 65504
    at = FLOAT16_OVERFLOW / 2**10  # 2**10 times it is 65520: rounds up to inf
    return [
        _Case("one float32 tensor of ordinary gradients", (_seeded((8, 4), 0, 1e-3),)),
        _Case(
            "three tensors, the largest entry in the last one",
            (_seeded((5,), 1, 1e-4), _seeded((3, 3), 2, 1e-4), _t([0.0, 2.5e-2, -1e-3])),
            why="look at every tensor, not only the first",
        ),
        _Case(
            "a generator of tensors (it can be walked only once)",
            (_seeded((6,), 3, 1e-2), _t([0.5])),
            why="walk the iterable once: a generator is empty the second time",
            generator=True,
        ),
        _Case("no tensors at all", (), why="nothing can overflow: the cap 2**24 applies"),
        _Case("only zeros", (torch.zeros(4), torch.zeros(2, 2)), why="0 never overflows: 2**24"),
        _Case(
            "tiny gradients, 1e-12",
            (_t([1e-12, -3e-12]),),
            why="the scale is capped at 2**24, however small the gradients",
        ),
        _Case(
            "large gradients, up to 1e6",
            (_t([1e6, -2.0]),),
            why="the scale may be below 1: 2**-4 * 1e6 = 62500 is finite",
        ),
        _Case(
            "largest |entry| 5000, and it is negative",
            (_t([1.0, -5000.0, 300.0]),),
            why="take the largest absolute value, not the largest value",
        ),
        _Case(
            f"largest entry {below} (times 2**10: 65510)",
            (_t([below, 1.0]),),
            why="65510 rounds to 65504 in float16, which is finite: the limit is not "
            "65504 but 65520, halfway to 2**16",
        ),
        _Case(
            f"largest entry {at} (times 2**10: exactly 65520)",
            (_t([at]),),
            why="65520 is halfway between 65504 and 2**16 and rounds to inf "
            "(round half to even): 2**10 overflows",
        ),
        _Case(
            "largest entry 65504 / 2**5 = 2047 (times 2**5: exactly 65504)",
            (_t([2047.0, -1.0]),),
            why="65504 itself is finite in float16",
        ),
        _Case(
            "a NaN entry in the second of three tensors",
            (_t([1e-3]), _t([0.5, math.nan]), _t([2.0])),
            why="NaN stays NaN at every scale: return None (Python's max() can drop a NaN)",
        ),
        _Case(
            "an inf entry",
            (_t([1e-3, math.inf]),),
            why="inf stays inf at every scale: return None",
        ),
        _Case(
            "a -inf entry",
            (_t([-math.inf, 1.0]),),
            why="-inf stays -inf at every scale: return None",
        ),
        _Case(
            "largest entry 1e13: even 2**-24 overflows",
            (_t([1e13]),),
            why="2**-24 * 1e13 = 6e5 > 65504: no allowed scale works, return None",
        ),
        _Case(
            "float16 gradients",
            (_t([3.0, -700.0], torch.float16),),
            why="the answer depends only on the largest |entry|, whatever its dtype",
        ),
        _Case("bfloat16 gradients", (_t([1.5e-3, 40.0], torch.bfloat16),)),
        _Case(
            "float64 and float32 gradients together",
            (_t([1e-30, 3.0], torch.float64), _t([1e-5])),
        ),
        _Case(
            "an empty tensor next to a nonempty one",
            (torch.zeros(0), _t([8.0])),
            why="an empty tensor has no entries (its max raises): leave it out",
        ),
    ]


def _scale_text(value: object) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value_text(value)
    x = float(value)
    if x > 0 and math.isfinite(x):
        k = math.log2(x)
        if k == int(k):
            return f"2**{int(k)} = {num(x)}"
    return num(x)


def _gen(tensors: tuple[Tensor, ...]) -> Iterator[Tensor]:
    yield from tensors


def check_max_loss_scale(fn: Callable) -> bool:
    """Check ``fn(grads)``: the largest power-of-two loss scale that float16 can store.

    ``grads`` is an iterable of unscaled gradient tensors (a generator included; any
    floating dtype). The answer is the largest ``omega = 2**k``, k an integer from -24 to
    24, such that every entry of ``omega * g`` stays finite when stored in float16
    (``(omega * g).to(torch.float16)`` with the product taken exactly); ``2**24`` when
    nothing can overflow (no entries, or only zeros); ``None`` when no allowed scale
    works (a NaN or infinite entry, or one too large even for ``2**-24``). It must
    return a Python number or None and leave its inputs unchanged. The expected
    answers are computed in float64 from the largest absolute entry.
    """
    cases = _cases()
    for case in cases:
        grads = [g.clone() for g in case.grads]
        arg = _gen(tuple(grads)) if case.generator else list(grads)
        given = ", ".join(tensor_text(g) for g in case.grads)
        call_text = f"fn({'a generator of' if case.generator else ''}[{given}])"
        try:
            got = call(fn, call_text, arg)
        except Raised as raised:
            say([f"Case: {case.text}.", *raised.lines, "Not passed."])
            return False
        expected = reference_max_loss_scale(list(case.grads))
        lines = [f"Case: {case.text}.", f"  gradients: [{given}]"]
        changed = any(
            not torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
            for a, b in zip(grads, case.grads, strict=True)
        )
        if changed:
            say([*lines, "  Your function changed the gradients it was given.", "Not passed."])
            return False
        if isinstance(got, Tensor):
            say(
                [
                    *lines,
                    f"  Your function returned a tensor, {value_text(got)}: return a Python "
                    "number (float(...)) or None.",
                    "Not passed.",
                ]
            )
            return False
        if got is not None and (isinstance(got, bool) or not isinstance(got, numbers.Real)):
            say(
                [
                    *lines,
                    f"  Your function returned {value_text(got)}: return a Python number or None.",
                    "Not passed.",
                ]
            )
            return False
        right = got is None and expected is None
        if got is not None and expected is not None:
            right = float(got) == expected
        if not right:
            lines.append(f"  expected {_scale_text(expected)}, got {_scale_text(got)}.")
            if got is not None and float(got) > 2.0**MAX_LOG2_SCALE:
                lines.append("  Too large: the answer is at most 2**24.")
            elif got is not None and expected is not None and float(got) > expected:
                lines.append("  Too large: at that scale some entry becomes inf in float16.")
            elif got is not None and expected is None:
                lines.append("  No allowed scale keeps every entry finite here.")
            elif got is None:
                lines.append("  None is for gradients that no allowed scale can store.")
            if case.why:
                lines.append(f"  Hint: {case.why}.")
            lines.append("Not passed.")
            say(lines)
            return False
    say([f"All {len(cases)} cases pass."])
    return True
