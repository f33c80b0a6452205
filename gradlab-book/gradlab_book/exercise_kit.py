"""The kit of the self-checks: how a check calls an answer, compares and speaks.

Every ``check_*`` of the ``gradlab_book.exercises*`` modules is built from these pieces,
so that every chapter's checks behave alike: an answer is called under the host-read
counter, anything it raises is reported as a sentence (never a traceback), numbers are
printed with four significant digits, and tensors are compared bit for bit or within the
tolerance of their least precise dtype, NaN matching NaN.

A new chapter's check imports them from here (see ARCHITECTURE.md).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from gradlab.sync import HostReadCounter

__all__ = [
    "EPS",
    "INF",
    "NAN",
    "Raised",
    "answer",
    "call",
    "grads_text",
    "host_read_message",
    "identical",
    "indented",
    "nested",
    "norm64",
    "num",
    "rejects_host_read",
    "same",
    "say",
    "tensor_text",
    "tolerance",
    "value_text",
]

#: The epsilon that torch.nn.utils and gradlab add to the total norm.
EPS = 1e-6
INF = math.inf
NAN = math.nan


# ------------------------------------------------------------------ formatting


def num(x: float) -> str:
    """A number with four significant digits; no ``-0``."""
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e6:
        return str(int(x))
    return f"{x:.4g}"


def nested(values: object) -> str:
    if isinstance(values, list):
        return "[" + ", ".join(nested(v) for v in values) + "]"
    return num(values)  # type: ignore[arg-type]


def tensor_text(t: Tensor | None) -> str:
    if t is None:
        return "None"
    if t.numel() > 12:  # a long tensor: say what it holds, not every entry
        t64 = t.detach().to("cpu", torch.float64).abs()
        text = f"<{t.numel()} entries, largest |entry| {num(t64.max())}>"
    else:
        text = nested(t.detach().to("cpu", torch.float64).tolist())
    if t.dtype != torch.float32:
        text += f" ({str(t.dtype).replace('torch.', '')})"
    return text


def grads_text(grads: Sequence[Tensor | None]) -> str:
    return "[" + ", ".join(tensor_text(g) for g in grads) + "]"


def value_text(value: object) -> str:
    if value is None:
        return "None"
    if isinstance(value, Tensor):
        if value.numel() == 1:
            shape = "" if value.dim() == 0 else f" of shape {tuple(value.shape)}"
            return f"tensor({num(value.detach().double().item())}){shape}"
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Real):
        return f"the Python number {num(float(value))}"
    return f"an object of type {type(value).__name__}"


def say(lines: Sequence[str]) -> None:
    print("\n".join(lines))


# --------------------------------------------------------------- host reads


def host_read_message(operation: str) -> str:
    return (
        f"Your function reads a tensor value on the host, through {operation}; make the "
        "decision on the device (torch.where, torch.clamp, multiplying by a tensor "
        "coefficient)."
    )


# ------------------------------------------------------------ running answers


class Raised(Exception):
    """The student's function raised; carries the lines that say so."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines


def call(fn: Callable, call_text: str, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise Raised(
            [
                "Not implemented yet: your function raises NotImplementedError.",
                "Replace `raise NotImplementedError` with your code, run that cell, "
                "then run this check again.",
            ]
        ) from None
    except Exception as exc:  # report anything the answer raises, never crash here
        message = str(exc).strip().splitlines()
        first = message[0] if message else ""
        raise Raised(
            [
                f"Your function raised {type(exc).__name__}: {first}",
                f"It was called as {call_text}.",
            ]
        ) from None


def indented(lines: list[str]) -> list[str]:
    return ["  " + line for line in lines]


def answer(
    fn: Callable,
    call_text: str,
    header: Sequence[str],
    hint: Sequence[str],
    *args: object,
    watch_host: bool = True,
    **kwargs: object,
) -> tuple[bool, object, HostReadCounter | None]:
    """Call ``fn``, watching host reads; on a raise, print why: (ok, result, reads)."""
    watcher = HostReadCounter() if watch_host else contextlib.nullcontext()
    try:
        with watcher as reads:
            result = call(fn, call_text, *args, **kwargs)
    except Raised as raised:
        # an unwritten stub needs no case to explain it, only where to start
        if raised.lines[0].startswith("Not implemented"):
            say(raised.lines)
        else:
            say([*header, *indented(raised.lines), *hint])
        return False, None, None
    return True, result, reads


def rejects_host_read(reads: HostReadCounter | None, case_line: str, call_text: str) -> bool:
    """Print the host-read verdict for one case if ``reads`` saw one; True if it did."""
    if reads is None or not reads.count:
        return False
    say([case_line, f"  call: {call_text}", host_read_message(reads.operations[0])])
    return True


def tolerance(dtypes: Sequence[torch.dtype]) -> tuple[float, float]:
    """(rtol, atol) for results stored in the least precise of ``dtypes``."""
    if any(d in (torch.float16, torch.bfloat16) for d in dtypes):
        return 2e-2, 1e-3
    if any(d == torch.float32 for d in dtypes):
        return 1e-5, 1e-7
    return 1e-9, 1e-12


def identical(a: Tensor, b: Tensor) -> bool:
    """Same dtype, shape and bits: NaN where the other has NaN, inf where it has inf."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def same(expected: Tensor, got: Tensor, rtol: float, atol: float) -> bool:
    """Equal shapes and values within tolerance; NaN matches NaN, inf matches inf."""
    if tuple(expected.shape) != tuple(got.shape):
        return False
    got64 = got.detach().to("cpu", torch.float64)
    return bool(torch.allclose(expected, got64, rtol=rtol, atol=atol, equal_nan=True))


def norm64(grads: Sequence[Tensor | None], p: float) -> Tensor:
    """The total p-norm of the gradients, in float64 (0 when there are none)."""
    flat = [g.detach().to(torch.float64).reshape(-1) for g in grads if g is not None]
    if not flat:
        return torch.tensor(0.0, dtype=torch.float64)
    v = torch.cat(flat)
    if v.numel() == 0:
        return torch.tensor(0.0, dtype=torch.float64)
    return torch.linalg.vector_norm(v, p)
