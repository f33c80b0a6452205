r"""Self-checking exercises: run a student's function against the reference.

Every ``check_*`` function takes the student's answer, runs it on a fixed battery
of small, seeded cases (both sides of the threshold, every norm type, NaN and
infinite entries, missing gradients, empty input, a generator such as
``model.parameters()``, several tensors and dtypes) and compares what it does with
what the mathematics says it must do. It prints one short verdict in plain words:

* ``All N cases pass.`` when every case agrees, or
* the *first* case that fails: its input, what was expected and what came back.

It returns True or False and never raises because an answer is wrong (an
exception raised by the answer is reported as such). The output is deterministic,
so it can sit in an executed notebook that is compared cell by cell.

The expected results are computed independently, in float64 on the host, from the
formulas in :mod:`gradlab.clip`; gradlab's own functions are not used as the
reference, so a check also holds gradlab to its documentation.

The checks of functions that decide something (clip by norm, ignore by norm or by
value) also watch for reads of tensor values on the host, as
:class:`gradlab.sync.HostReadCounter` defines them (``.item()``, ``if t > x:``,
``t.tolist()``, ``g[mask] = 0``, ``torch.equal``, printing a tensor, ...), and name
the one found: such a read forces the program to wait for the accelerator at every
step, and the decision can always be made on the device instead.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gradlab.sync import HostReadCounter

__all__ = [
    "check_clip_grad_norm",
    "check_clip_grad_value",
    "check_grad_ignore_norm",
    "check_grad_ignore_value",
    "check_guarded_step",
    "check_threshold_choice",
    "check_total_norm",
]

#: The epsilon that torch.nn.utils and gradlab add to the total norm.
_EPS = 1e-6
_INF = math.inf
_NAN = math.nan


# ------------------------------------------------------------------ formatting


def _num(x: float) -> str:
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


def _nested(values: object) -> str:
    if isinstance(values, list):
        return "[" + ", ".join(_nested(v) for v in values) + "]"
    return _num(values)  # type: ignore[arg-type]


def _tensor_text(t: Tensor | None) -> str:
    if t is None:
        return "None"
    if t.numel() > 12:  # a long tensor: say what it holds, not every entry
        t64 = t.detach().to("cpu", torch.float64).abs()
        text = f"<{t.numel()} entries, largest |entry| {_num(t64.max())}>"
    else:
        text = _nested(t.detach().to("cpu", torch.float64).tolist())
    if t.dtype != torch.float32:
        text += f" ({str(t.dtype).replace('torch.', '')})"
    return text


def _grads_text(grads: Sequence[Tensor | None]) -> str:
    return "[" + ", ".join(_tensor_text(g) for g in grads) + "]"


def _value_text(value: object) -> str:
    if value is None:
        return "None"
    if isinstance(value, Tensor):
        if value.numel() == 1:
            shape = "" if value.dim() == 0 else f" of shape {tuple(value.shape)}"
            return f"tensor({_num(value.detach().double().item())}){shape}"
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Real):
        return f"the Python number {_num(float(value))}"
    return f"an object of type {type(value).__name__}"


def _say(lines: Sequence[str]) -> None:
    print("\n".join(lines))


# --------------------------------------------------------------- host reads


def _host_read_message(operation: str) -> str:
    return (
        f"Your function reads a tensor value on the host, through {operation}; make the "
        "decision on the device (torch.where, torch.clamp, multiplying by a tensor "
        "coefficient)."
    )


# ------------------------------------------------------------ running answers


class _Raised(Exception):
    """The student's function raised; carries the lines that say so."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines


def _call(fn: Callable, call_text: str, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise _Raised(
            [
                "Not implemented yet: your function raises NotImplementedError.",
                "Replace `raise NotImplementedError` with your code, run that cell, "
                "then run this check again.",
            ]
        ) from None
    except Exception as exc:  # report anything the answer raises, never crash here
        message = str(exc).strip().splitlines()
        first = message[0] if message else ""
        raise _Raised(
            [
                f"Your function raised {type(exc).__name__}: {first}",
                f"It was called as {call_text}.",
            ]
        ) from None


def _indented(lines: list[str]) -> list[str]:
    return ["  " + line for line in lines]


def _answer(
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
            result = _call(fn, call_text, *args, **kwargs)
    except _Raised as raised:
        # an unwritten stub needs no case to explain it, only where to start
        if raised.lines[0].startswith("Not implemented"):
            _say(raised.lines)
        else:
            _say([*header, *_indented(raised.lines), *hint])
        return False, None, None
    return True, result, reads


def _rejects_host_read(reads: HostReadCounter | None, case_line: str, call_text: str) -> bool:
    """Print the host-read verdict for one case if ``reads`` saw one; True if it did."""
    if reads is None or not reads.count:
        return False
    _say([case_line, f"  call: {call_text}", _host_read_message(reads.operations[0])])
    return True


def _tolerance(dtypes: Sequence[torch.dtype]) -> tuple[float, float]:
    """(rtol, atol) for results stored in the least precise of ``dtypes``."""
    if any(d in (torch.float16, torch.bfloat16) for d in dtypes):
        return 2e-2, 1e-3
    if any(d == torch.float32 for d in dtypes):
        return 1e-5, 1e-7
    return 1e-9, 1e-12


def _identical(a: Tensor, b: Tensor) -> bool:
    """Same dtype, shape and bits: NaN where the other has NaN, inf where it has inf."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def _same(expected: Tensor, got: Tensor, rtol: float, atol: float) -> bool:
    """Equal shapes and values within tolerance; NaN matches NaN, inf matches inf."""
    if tuple(expected.shape) != tuple(got.shape):
        return False
    got64 = got.detach().to("cpu", torch.float64)
    return bool(torch.allclose(expected, got64, rtol=rtol, atol=atol, equal_nan=True))


# --------------------------------------------------------- gradient cases


@dataclass(frozen=True)
class _GradCase:
    """One input to a gradient-modifying function.

    ``grads`` holds the gradient values (None: a parameter without a gradient);
    ``kind`` says how the parameters are handed over: a list, a generator, the
    generator ``model.parameters()`` of an ``nn.Linear``, or one bare tensor (as
    ``torch.nn.utils`` accepts).
    """

    title: str
    grads: tuple[Tensor | None, ...]
    threshold: float
    norm_type: float = 2.0
    kind: str = "list"  # "list", "generator", "module" or "tensor"
    hint: str = ""


def _build(case: _GradCase):
    """Fresh parameters with the case's gradients; returns (argument, parameter list)."""
    gen = torch.Generator().manual_seed(1234)
    if case.kind == "module":
        layer = nn.Linear(3, 2)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen).round(decimals=2))
        params = list(layer.parameters())
        for p, g in zip(params, case.grads, strict=True):
            p.grad = None if g is None else g.clone()
        return layer.parameters(), params
    params = []
    for g in case.grads:
        if g is None:
            p = torch.randn(2, generator=gen).round(decimals=2).requires_grad_()
        else:
            p = torch.randn(g.shape, generator=gen).round(decimals=2).to(g.dtype)
            p.requires_grad_()
            p.grad = g.clone()
        params.append(p)
    if case.kind == "generator":
        return (p for p in params), params
    if case.kind == "tensor":
        (param,) = params  # one bare tensor, not in a list
        return param, params
    return params, params


def _describe(case: _GradCase) -> str:
    how = {
        "list": "a list of parameters",
        "generator": "a generator of parameters (it can be iterated only once)",
        "module": "model.parameters() of an nn.Linear(3, 2) (a generator: one pass only)",
        "tensor": "one bare tensor, not in a list (as torch.nn.utils accepts)",
    }[case.kind]
    return f"{case.title}; {how}"


def _norm64(grads: Sequence[Tensor | None], p: float) -> Tensor:
    """The total p-norm of the gradients, in float64 (0 when there are none)."""
    flat = [g.detach().to(torch.float64).reshape(-1) for g in grads if g is not None]
    if not flat:
        return torch.tensor(0.0, dtype=torch.float64)
    v = torch.cat(flat)
    if v.numel() == 0:
        return torch.tensor(0.0, dtype=torch.float64)
    return torch.linalg.vector_norm(v, p)


def _t(values, dtype=torch.float32) -> Tensor:
    return torch.tensor(values, dtype=dtype)


def _seeded(shape, seed: int, scale: float = 1.0, dtype=torch.float32) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (
        (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).round(decimals=2).to(dtype)
    )


def _three(seed: int, scale: float = 1.0, dtype=torch.float32) -> tuple[Tensor, ...]:
    return (
        _seeded((2,), seed, scale, dtype),
        _seeded((2, 2), seed + 1, scale, dtype),
        _seeded((3,), seed + 2, scale, dtype),
    )


def _norm_cases(fn_name: str) -> list[_GradCase]:
    """The battery shared by the norm-based checks (clip and ignore by norm)."""
    cases: list[_GradCase] = []
    three = _three(10)
    n2 = float(_norm64(three, 2))

    def add(title, grads, max_norm, p=2.0, kind="list", hint=""):
        cases.append(_GradCase(title, tuple(grads), max_norm, p, kind, hint))

    one = (_t([3.0, -4.0]),)
    bare_hint = (
        "A single tensor may be passed instead of a list: "
        "if isinstance(parameters, torch.Tensor): parameters = [parameters]."
    )
    add("one tensor, total 2-norm 5, under the threshold", one, 10.0)
    add(
        "one tensor, total 2-norm 5, over the threshold",
        one,
        2.0,
        kind="tensor",
        hint=bare_hint,
    )
    add(f"three tensors, total 2-norm {_num(n2)}, under the threshold", three, 2 * n2)
    add(
        f"three tensors, total 2-norm {_num(n2)}, over the threshold",
        three,
        n2 / 2,
        hint="The decision is about all the gradients together: every tensor is affected.",
    )
    for p in (1.0, 3.5, _INF):
        total = float(_norm64(three, p))
        add(
            f"three tensors, norm_type={_num(p)}, total norm {_num(total)}, under",
            three,
            2 * total,
            p,
        )
        add(
            f"three tensors, norm_type={_num(p)}, total norm {_num(total)}, over",
            three,
            total / 2,
            p,
        )
    close = float(_norm64(three, 2))
    add("three tensors, total 2-norm 1% over the threshold", three, close / 1.01)
    add("three tensors, total 2-norm 1% under the threshold", three, close * 1.01)
    f64 = _three(20, dtype=torch.float64)
    n64 = float(_norm64(f64, 2))
    add("three float64 tensors, over the threshold", f64, n64 / 3)
    add("three float64 tensors, under the threshold", f64, n64 * 3)
    f16 = (_t([0.5, -1.5], torch.float16), _t([[2.0, 0.25], [-1.0, 1.0]], torch.float16))
    add("two float16 tensors, total 2-norm 3, over the threshold", f16, 1.0)
    add("two float16 tensors, total 2-norm 3, under the threshold", f16, 4.0)
    mixed = (_t([1.0, 2.0]), _t([2.0, -4.0], torch.float64))
    add("a float32 and a float64 tensor, total 2-norm 5, over the threshold", mixed, 2.5)
    with_none = (three[0], None, three[2])
    nn2 = float(_norm64(with_none, 2))
    none_hint = "Skip parameters whose .grad is None, as torch.nn.utils does."
    add(
        "three parameters, the middle one has no gradient (None), over",
        with_none,
        nn2 / 2,
        hint=none_hint,
    )
    add(
        "three parameters, the middle one has no gradient (None), under",
        with_none,
        nn2 * 2,
        hint=none_hint,
    )
    add(
        "two parameters, neither has a gradient",
        (None, None),
        1.0,
        hint="With no gradients the total norm is tensor(0.) and nothing changes.",
    )
    add(
        "no parameters at all (an empty list)",
        (),
        1.0,
        hint="An empty input has total norm tensor(0.) and nothing to change.",
    )
    gen_grads = _three(30)
    ng = float(_norm64(gen_grads, 2))
    gen_hint = "A generator is used up after one pass: turn it into a list first."
    add("three tensors, over the threshold", gen_grads, ng / 2, kind="generator", hint=gen_hint)
    lin = (_seeded((2, 3), 40), _seeded((2,), 41))
    nl = float(_norm64(lin, 2))
    add(
        "a linear layer's weight and bias gradients, over",
        lin,
        nl / 2,
        kind="module",
        hint=gen_hint,
    )
    add(
        "a linear layer's weight and bias gradients, under",
        lin,
        nl * 2,
        kind="module",
        hint=gen_hint,
    )
    if fn_name == "clip":
        nan_hint = (
            "A NaN total norm makes the coefficient NaN, so clipping turns every gradient "
            "into NaN, exactly as torch.nn.utils.clip_grad_norm_ does."
        )
        inf_hint = (
            "An infinite total norm gives the coefficient max_norm / inf = 0: finite "
            "entries become 0 and infinite ones NaN (inf * 0), as in torch.nn.utils."
        )
    else:
        nan_hint = (
            "A NaN total norm must be ignored: zero every gradient. NaN * 0 is NaN, so "
            "select zeros (torch.where) rather than multiplying by a 0/1 mask, and note "
            "that every comparison with NaN is False."
        )
        inf_hint = "An infinite total norm is over any threshold: zero every gradient."
    add(
        "three tensors, one entry is NaN",
        (three[0], _t([[0.5, _NAN], [1.0, -1.0]]), three[2]),
        100.0,
        hint=nan_hint,
    )
    add(
        "three tensors, one entry is +inf",
        (three[0], three[1], _t([1.0, _INF, -2.0])),
        100.0,
        hint=inf_hint,
    )
    add(
        "two tensors, one entry is -inf, norm_type=inf",
        (_t([-_INF, 1.0]), _t([0.5, 0.5])),
        100.0,
        _INF,
        hint=inf_hint,
    )
    add("two tensors of zeros, threshold 1", (_t([0.0, 0.0]), _t([0.0])), 1.0)
    add("three tensors, threshold inf (nothing is ever too large)", three, _INF)
    return cases


def _value_cases(fn_name: str) -> list[_GradCase]:
    """The battery shared by the value-based checks (clip and ignore by value)."""
    cases: list[_GradCase] = []

    def add(title, grads, clip_value, kind="list", hint=""):
        cases.append(_GradCase(title, tuple(grads), clip_value, _INF, kind, hint))

    ge_hint = (
        "The rule is: ignore when the largest |entry| is >= clip_value (reaching the "
        "threshold counts)."
        if fn_name == "ignore"
        else ""
    )
    one = (_t([0.25, -0.75, 0.5]),)
    bare_hint = (
        "A single tensor may be passed instead of a list: "
        "if isinstance(parameters, torch.Tensor): parameters = [parameters]."
    )
    add("one tensor, every |entry| below the threshold", one, 1.0)
    add(
        "one tensor, entries above the threshold on both signs",
        (_t([2.0, -3.0, 0.5]),),
        1.0,
        kind="tensor",
        hint=bare_hint,
    )
    three = (_t([0.5, -0.25]), _t([[0.125, 0.75], [-0.5, 0.0]]), _t([0.25, 1.5, -0.5]))
    add(
        "three tensors, only one entry of the last tensor is above",
        three,
        1.0,
        hint="The decision is about all the gradients together: every tensor is affected."
        if fn_name == "ignore"
        else "",
    )
    add("three tensors, all below", three, 2.0)
    add(
        "one tensor whose largest entry equals the threshold exactly",
        (_t([0.5, -0.25]),),
        0.5,
        hint=ge_hint,
    )
    add(
        "one tensor whose most negative entry equals -threshold exactly",
        (_t([-0.5, 0.25]),),
        0.5,
        hint=ge_hint,
    )
    none_hint = "Skip parameters whose .grad is None, as torch.nn.utils does."
    add(
        "three parameters, the middle one has no gradient (None), above",
        (three[0], None, three[2]),
        1.0,
        hint=none_hint,
    )
    add(
        "three parameters, the middle one has no gradient (None), below",
        (three[0], None, three[2]),
        2.0,
        hint=none_hint,
    )
    empty_hint = "With no gradients there is nothing to change: do nothing, without error."
    add("two parameters, neither has a gradient", (None, None), 1.0, hint=empty_hint)
    add("no parameters at all (an empty list)", (), 1.0, hint=empty_hint)
    empty_entries_hint = (
        "A gradient with no entries adds nothing (its largest |entry| counts as 0), but "
        ".max() and vector_norm(g, inf) of an empty tensor raise: leave out the "
        "gradients with g.numel() == 0."
    )
    add(
        "one parameter whose gradient has no entries (shape (0,))",
        (torch.zeros(0),),
        1.0,
        hint=empty_entries_hint,
    )
    add(
        "a 0-entry gradient beside a normal one, above",
        (torch.zeros(0), _t([0.5, -3.0])),
        1.0,
        hint=empty_entries_hint,
    )
    mixed_hint = (
        "Compare in the widest dtype of all the gradients (float64 if any is float64): "
        "1 - 1e-9 rounds to 1 in float32."
    )
    add(
        "a float32 and a float64 tensor, largest |entry| 1 - 1e-9, just below 1",
        (_t([0.5, -0.25]), _t([1.0 - 1e-9, 0.5], torch.float64)),
        1.0,
        hint=mixed_hint,
    )
    gen_hint = "A generator is used up after one pass: turn it into a list first."
    add("three tensors, above", three, 1.0, kind="generator", hint=gen_hint)
    add("three tensors, below", three, 2.0, kind="generator", hint=gen_hint)
    lin = (_t([[0.5, -2.0, 0.25], [1.0, 0.0, -0.5]]), _t([0.75, -0.25]))
    add("a linear layer's weight and bias gradients, above", lin, 1.0, kind="module", hint=gen_hint)
    add("a linear layer's weight and bias gradients, below", lin, 4.0, kind="module", hint=gen_hint)
    add(
        "two float64 tensors, above",
        (_t([0.5, -3.0], torch.float64), _t([1.25], torch.float64)),
        1.0,
    )
    add(
        "two float16 tensors, above",
        (_t([0.5, -3.0], torch.float16), _t([1.25], torch.float16)),
        1.0,
    )
    add(
        "two bfloat16 tensors, below",
        (_t([0.5, -3.0], torch.bfloat16), _t([1.25], torch.bfloat16)),
        4.0,
    )
    if fn_name == "clip":
        nan_hint = (
            "torch.clamp leaves a NaN entry NaN, and so does torch.nn.utils.clip_grad_value_."
        )
        inf_hint = "An infinite entry is clamped to +-clip_value like any other."
    else:
        nan_hint = (
            "A NaN entry must trigger the ignore: zero every gradient. Every comparison "
            "with NaN is False, and NaN * 0 is NaN: select zeros with torch.where."
        )
        inf_hint = "An infinite entry is above any threshold: zero every gradient."
    add("two tensors, one entry is NaN", (_t([0.5, _NAN]), _t([0.25])), 10.0, hint=nan_hint)
    add("two tensors, one entry is +inf", (_t([0.5, 0.25]), _t([_INF])), 10.0, hint=inf_hint)
    add("two tensors, one entry is -inf", (_t([-_INF, 0.25]), _t([0.5])), 10.0, hint=inf_hint)
    add("one tensor, threshold 0", (_t([0.5, -0.25]),), 0.0)
    add("one tensor, threshold inf", (_t([0.5, -0.25, 1e30]),), _INF)
    return cases


# -------------------------------------------------------------- references


def _expected_clip_norm(case: _GradCase) -> tuple[list[Tensor | None], Tensor]:
    total = _norm64(case.grads, case.norm_type)
    coef = torch.clamp(case.threshold / (total + _EPS), max=1.0)
    out = [None if g is None else g.to(torch.float64) * coef for g in case.grads]
    return out, total


def _expected_ignore_norm(case: _GradCase) -> tuple[list[Tensor | None], Tensor]:
    total = _norm64(case.grads, case.norm_type)
    keep = bool(case.threshold / (total + _EPS) >= 1.0)  # False for a NaN total
    out = [
        None
        if g is None
        else (g.to(torch.float64) if keep else torch.zeros(g.shape, dtype=torch.float64))
        for g in case.grads
    ]
    return out, total


def _expected_clip_value(case: _GradCase) -> tuple[list[Tensor | None], None]:
    c = case.threshold
    out = [None if g is None else g.to(torch.float64).clamp(-c, c) for g in case.grads]
    return out, None


def _expected_ignore_value(case: _GradCase) -> tuple[list[Tensor | None], Tensor]:
    largest = _norm64(case.grads, _INF)
    keep = bool(largest < case.threshold)  # False for NaN
    out = [
        None
        if g is None
        else (g.to(torch.float64) if keep else torch.zeros(g.shape, dtype=torch.float64))
        for g in case.grads
    ]
    return out, largest


# ---------------------------------------------------------------- the runner


def _as_input_dtypes(grads: list[Tensor | None], case: _GradCase) -> list[Tensor | None]:
    """The expected float64 gradients cast back to the case's dtypes, for display."""
    return [
        None if e is None or g is None else e.to(g.dtype)
        for e, g in zip(grads, case.grads, strict=True)
    ]


def _run_grad_cases(
    fn: Callable,
    cases: list[_GradCase],
    expected_of: Callable[[_GradCase], tuple[list[Tensor | None], Tensor | None]],
    *,
    threshold_name: str,
    pass_norm_type: bool,
    returns: str,
    watch_host: bool,
) -> bool:
    """Run ``fn`` on every case; print the first failure or the pass line."""
    if not callable(fn):
        _say([f"Expected a function, got {_value_text(fn)}."])
        return False
    for index, case in enumerate(cases, start=1):
        arg, params = _build(case)
        before = [p.detach().clone() for p in params]
        kwargs = {"norm_type": case.norm_type} if pass_norm_type else {}
        call_text = f"fn(parameters, {threshold_name}={_num(case.threshold)}"
        call_text += f", norm_type={_num(case.norm_type)})" if pass_norm_type else ")"
        header = [
            f"Case {index} of {len(cases)} fails: {_describe(case)}.",
            f"  call:              {call_text}",
            f"  gradients before:  {_grads_text(case.grads)}",
        ]
        hint = [f"  Hint: {case.hint}"] if case.hint else []
        ok, result, detector = _answer(
            fn, call_text, header, hint, arg, case.threshold, watch_host=watch_host, **kwargs
        )
        if not ok:
            return False
        expected_grads, expected_return = expected_of(case)
        got_grads = [p.grad for p in params]
        rtol, atol = _tolerance([g.dtype for g in case.grads if g is not None])

        def fail(*lines: str, _header=header, _case=case) -> bool:
            _say([*_header, *lines, *([f"  Hint: {_case.hint}"] if _case.hint else [])])
            return False

        # the gradients
        for i, (exp, got) in enumerate(zip(expected_grads, got_grads, strict=True)):
            if exp is None and got is None:
                continue
            if exp is None or got is None or not _same(exp, got, rtol, atol):
                return fail(
                    f"  expected gradients: {_grads_text(_as_input_dtypes(expected_grads, case))}",
                    f"  your gradients:     {_grads_text(got_grads)}",
                    f"  (the first difference is in gradient {i})",
                )
        # the parameters themselves
        for i, (b, p) in enumerate(zip(before, params, strict=True)):
            if not torch.equal(b, p.detach()):
                return fail(
                    f"  Your function changed the values of parameter {i}, not just its gradient."
                )
        # the return value
        if returns == "none":
            if result is not None:
                return fail(
                    "  expected return value: None (like torch.nn.utils.clip_grad_value_)",
                    f"  your return value:     {_value_text(result)}",
                )
        else:
            assert expected_return is not None
            what = "the total norm before clipping" if returns == "norm" else "the largest |entry|"
            if returns == "norm_ignore":
                what = "the total norm before the decision"
            ok = isinstance(result, Tensor) and result.dim() == 0
            if ok:
                ok = _same(expected_return.reshape(()), result, rtol, atol)
            if not ok:
                return fail(
                    f"  expected return value: tensor({_num(float(expected_return))}), {what}"
                    " (a 0-dim tensor)",
                    f"  your return value:     {_value_text(result)}",
                )
        if _rejects_host_read(
            detector, f"Case {index} of {len(cases)}: {_describe(case)}.", call_text
        ):
            return False
    _say([f"All {len(cases)} cases pass."])
    return True


# ------------------------------------------------------------------ the checks


def check_clip_grad_norm(fn: Callable) -> bool:
    """Check ``fn(parameters, max_norm, norm_type=...)`` against clip-by-norm.

    Checked on every case: the gradients afterwards equal
    ``g * min(1, max_norm / (total_norm + 1e-6))`` (what
    :func:`torch.nn.utils.clip_grad_norm_` gives, NaN and inf included), within a
    tolerance suited to the dtype; the parameters' values are unchanged; the return
    value is the total norm *before* clipping, a 0-dim tensor; gradients that are
    None stay None; no tensor value is read on the host.
    """
    return _run_grad_cases(
        fn,
        _norm_cases("clip"),
        _expected_clip_norm,
        threshold_name="max_norm",
        pass_norm_type=True,
        returns="norm",
        watch_host=True,
    )


def check_grad_ignore_norm(fn: Callable) -> bool:
    """Check ``fn(parameters, max_norm, norm_type=...)`` against ignore-by-norm.

    Checked on every case: every gradient is zeroed when
    ``max_norm / (total_norm + 1e-6) < 1`` or the total norm is NaN (so an infinite
    or NaN gradient leaves zeros, never NaN), and left exactly as it was otherwise;
    the parameters' values are unchanged; the return value is the total norm before
    the decision, a 0-dim tensor; gradients that are None stay None; no tensor value
    is read on the host.
    """
    return _run_grad_cases(
        fn,
        _norm_cases("ignore"),
        _expected_ignore_norm,
        threshold_name="max_norm",
        pass_norm_type=True,
        returns="norm_ignore",
        watch_host=True,
    )


def check_clip_grad_value(fn: Callable) -> bool:
    """Check ``fn(parameters, clip_value)`` against clip-by-value.

    Checked on every case: every gradient entry is clamped into
    ``[-clip_value, clip_value]`` (a NaN entry stays NaN, as with
    :func:`torch.nn.utils.clip_grad_value_`); the parameters' values are unchanged;
    gradients that are None stay None; the function returns None.
    """
    return _run_grad_cases(
        fn,
        _value_cases("clip"),
        _expected_clip_value,
        threshold_name="clip_value",
        pass_norm_type=False,
        returns="none",
        watch_host=False,
    )


def check_grad_ignore_value(fn: Callable) -> bool:
    """Check ``fn(parameters, clip_value)`` against ignore-by-value.

    Checked on every case: every gradient is zeroed when the largest absolute entry
    is ``>= clip_value`` or any entry is NaN or infinite, and left exactly as it was
    otherwise; the parameters' values are unchanged; the return value is the largest
    absolute entry before the decision, a 0-dim tensor (``tensor(0.)`` with no
    gradients); gradients that are None stay None; no tensor value is read on the host.
    """
    return _run_grad_cases(
        fn,
        _value_cases("ignore"),
        _expected_ignore_value,
        threshold_name="clip_value",
        pass_norm_type=False,
        returns="largest",
        watch_host=True,
    )


# ------------------------------------------------------------------ total norm


def check_total_norm(fn: Callable) -> bool:
    """Check ``fn(tensors, norm_type)``: the total norm of tensors seen as one vector.

    ``tensors`` holds the values themselves (e.g. gradients), not parameters. Checked
    on every case: the result is a 0-dim tensor equal, within a tolerance suited to
    the dtype, to ``(sum of |x|**p over every entry) ** (1/p)``, or the largest
    ``|x|`` for ``norm_type=inf``; NaN entries give NaN, infinite ones inf; no
    tensors give ``tensor(0.)``; a generator of tensors, and one bare tensor not in
    a list, work; 16-bit inputs give a float32 (or wider) result, also where a
    per-tensor or the total norm exceeds float16's largest value 65504; the tensors
    are not modified, NaN and inf entries included.
    """
    if not callable(fn):
        _say([f"Expected a function, got {_value_text(fn)}."])
        return False
    three = _three(50)
    cases: list[tuple[str, tuple[Tensor, ...], float, bool]] = []
    for p in (1.0, 2.0, 3.5, _INF):
        cases.append((f"one tensor, norm_type={_num(p)}", (_t([3.0, -4.0]),), p, False))
        cases.append((f"three tensors, norm_type={_num(p)}", three, p, False))
    big16 = torch.full((10_000,), 1000.0, dtype=torch.float16)  # 2-norm 1e5 > 65504
    half16 = torch.full((2_500,), 1000.0, dtype=torch.float16)  # 2-norm 5e4 each
    cases += [
        ("three tensors given as a generator, norm_type=2", three, 2.0, True),
        ("one bare 0-dim tensor, not in a list, norm_type=2", torch.tensor(-3.0), 2.0, False),
        (
            "one float16 tensor of 10000 entries of 1000: 2-norm 1e5, above 65504",
            (big16,),
            2.0,
            False,
        ),
        (
            "two float16 tensors, each 2-norm 5e4: total 7.071e4, above 65504",
            (half16, half16.clone()),
            2.0,
            False,
        ),
        ("three float64 tensors, norm_type=2", _three(60, dtype=torch.float64), 2.0, False),
        ("three float64 tensors, norm_type=inf", _three(60, dtype=torch.float64), _INF, False),
        (
            "two float16 tensors, norm_type=2",
            (_t([0.5, -1.5], torch.float16), _t([2.0, 0.25], torch.float16)),
            2.0,
            False,
        ),
        (
            "a float32 and a float64 tensor, norm_type=2",
            (_t([1.0, 2.0]), _t([2.0, -4.0], torch.float64)),
            2.0,
            False,
        ),
        (
            "a 0-dim tensor and a matrix, norm_type=2",
            (torch.tensor(-2.0), _seeded((2, 3), 70)),
            2.0,
            False,
        ),
        ("two tensors of zeros, norm_type=2", (_t([0.0, 0.0]), _t([[0.0]])), 2.0, False),
        ("no tensors at all (an empty list), norm_type=2", (), 2.0, False),
        ("no tensors at all (an empty list), norm_type=inf", (), _INF, False),
        ("two tensors, one entry is NaN, norm_type=2", (_t([1.0, _NAN]), _t([2.0])), 2.0, False),
        ("two tensors, one entry is NaN, norm_type=inf", (_t([1.0, _NAN]), _t([2.0])), _INF, False),
        ("two tensors, one entry is +inf, norm_type=1", (_t([1.0, _INF]), _t([2.0])), 1.0, False),
        (
            "two tensors, one entry is -inf, norm_type=inf",
            (_t([1.0, -_INF]), _t([2.0])),
            _INF,
            False,
        ),
    ]
    for index, (title, given, p, as_gen) in enumerate(cases, start=1):
        bare = isinstance(given, Tensor)
        tensors = (given,) if bare else given
        inputs = [t.clone() for t in tensors]
        arg = inputs[0] if bare else ((t for t in inputs) if as_gen else inputs)
        call_text = f"fn(tensors, norm_type={_num(p)})"
        header = [
            f"Case {index} of {len(cases)} fails: {title}.",
            f"  call:     {call_text}",
            f"  tensors:  {_grads_text(list(tensors))}",
        ]
        bare_hint = (
            "  Hint: one tensor may be passed instead of a list: "
            "if isinstance(tensors, torch.Tensor): tensors = [tensors]."
        )
        ok, result, _ = _answer(
            fn, call_text, header, [bare_hint] if bare else [], arg, p, watch_host=False
        )
        if not ok:
            return False
        expected = _norm64(tensors, p)
        rtol, atol = _tolerance([t.dtype for t in tensors])
        half = any(t.dtype in (torch.float16, torch.bfloat16) for t in tensors)
        narrow = isinstance(result, Tensor) and result.dtype in (torch.float16, torch.bfloat16)
        if half and narrow:
            _say(
                [
                    *header,
                    f"  expected: tensor({_num(float(expected))}) in float32 (a 0-dim tensor)",
                    f"  yours:    {_value_text(result)} ({str(result.dtype)[6:]})",
                    "  Hint: a 16-bit norm overflows above 65504 (float16) or loses digits "
                    "(bfloat16): accumulate and return it in float32.",
                ]
            )
            return False
        if not (
            isinstance(result, Tensor) and result.dim() == 0 and _same(expected, result, rtol, atol)
        ):
            hint = []
            if not tensors:
                hint = ["  Hint: the norm of nothing is tensor(0.)."]
            elif as_gen:
                hint = ["  Hint: a generator is used up after one pass: turn it into a list first."]
            elif bare:
                hint = [bare_hint]
            _say(
                [
                    *header,
                    f"  expected: tensor({_num(float(expected))}) (a 0-dim tensor)",
                    f"  yours:    {_value_text(result)}",
                    *hint,
                ]
            )
            return False
        for i, (t, t_in) in enumerate(zip(tensors, inputs, strict=True)):
            if not _identical(t, t_in):
                _say(
                    [
                        *header,
                        f"  Your function modified tensor {i}: a norm must not change its input.",
                    ]
                )
                return False
    _say([f"All {len(cases)} cases pass."])
    return True


# ----------------------------------------------------------------- guarded step


def _state_tensors(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> dict[str, Tensor]:
    """Every tensor of the optimizer's per-parameter state, by a readable name."""
    out: dict[str, Tensor] = {}
    for i, p in enumerate(params):
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, Tensor):
                out[f"state[{key!r}] of parameter {i}"] = value.detach().clone()
            else:
                out[f"state[{key!r}] of parameter {i}"] = torch.tensor(float(value))
    return out


def _bitwise_equal(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.nan_to_num(), b.nan_to_num())) and bool(
        torch.equal(a.isnan(), b.isnan())
    )


def _guard_model(seed: int, frozen_bias: bool) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1))
    if frozen_bias:
        model[2].bias.requires_grad_(False)
    return model


def _guard_single(seed: int) -> nn.Module:
    """A model with one parameter tensor, passed to the answer as a bare tensor."""
    torch.manual_seed(seed)
    return nn.Linear(3, 2, bias=False)


def _as_bool(result: object) -> object:
    """A Python bool, a NumPy bool or a one-element bool tensor, as a Python bool.

    Anything else (a number such as 1 or 0, a float or integer tensor) is returned
    unchanged, and the check then rejects it: the contract asks for a bool.
    """
    if isinstance(result, bool):
        return result
    if isinstance(result, Tensor):
        if result.numel() == 1 and result.dtype == torch.bool:
            return bool(result.detach().cpu())
        return result
    if type(result).__module__ == "numpy" and type(result).__name__ == "bool":
        return bool(result)  # numpy.bool (numpy.bool_), e.g. from np.isfinite
    return result


_OPTIMIZERS: list[tuple[str, Callable]] = [
    ("SGD(lr=0.1)", lambda ps: torch.optim.SGD(ps, lr=0.1)),
    (
        "SGD(lr=0.1, momentum=0.9, weight_decay=0.01)",
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    ),
    ("Adam(lr=0.01)", lambda ps: torch.optim.Adam(ps, lr=0.01)),
    (
        "AdamW(lr=0.01, weight_decay=0.1)",
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    ),
]

# Each step's gradients are a seeded draw times this scale; "nan"/"inf" poison one entry.
_GUARD_STEPS: list[tuple[float, str]] = [
    (1.0, ""),
    (1.0, ""),
    (100.0, ""),
    (1.0, "nan"),
    (1.0, ""),
    (1.0, "inf"),
    (1.0, ""),
]
# The same, with a bad first step: a skip before the optimizer has any state must not
# create it (Adam's moments and step count, the momentum buffers).
_GUARD_STEPS_BAD_FIRST: list[tuple[float, str]] = [
    (100.0, ""),
    (1.0, ""),
    (1.0, "nan"),
    (1.0, ""),
]


def check_guarded_step(fn: Callable) -> bool:
    """Check ``fn(parameters, optimizer, max_norm) -> bool``, a step that can skip.

    The contract: compute the total 2-norm of the gradients of ``parameters`` (an
    iterable, possibly a generator such as ``model.parameters()``; parameters whose
    ``.grad`` is None are left out). If it is finite and
    ``max_norm / (norm + 1e-6) >= 1``, call ``optimizer.step()`` exactly once and
    return True. Otherwise (too large, NaN or infinite) return False and leave the
    parameters *and the optimizer's state* (momentum buffers, Adam's moments and
    step count) bit for bit as they were; the gradients may be left as they are or
    zeroed.

    Checked: a sequence of seven steps (normal, normal, a norm 100 times larger,
    a NaN gradient, normal, an infinite gradient, normal) with plain SGD, SGD with
    momentum and weight decay, Adam and AdamW, some with a frozen parameter and with
    ``model.parameters()`` passed as a generator; with SGD with momentum, Adam
    and AdamW, a sequence whose *first* step is bad (no state may be created); and,
    with Adam, a model whose only parameter is passed as a bare tensor, not in a list
    (as ``torch.nn.utils.clip_grad_norm_`` accepts it). After every step the return
    value, the parameters and the optimizer state must equal an independent
    reference run bit for bit (taken steps call ``optimizer.step()`` on identical
    models). The return value must be a bool: ``True``/``False``, a NumPy bool or a
    one-element bool tensor such as ``torch.isfinite(norm)``; a number such as 1
    or 0, or a float tensor, is rejected.
    """
    if not callable(fn):
        _say([f"Expected a function, got {_value_text(fn)}."])
        return False
    max_norm = 5.0
    # (optimizer, how the parameters are passed, one frozen, the steps)
    runs = []
    for name, make in _OPTIMIZERS:
        runs.append((name, make, "list", False, _GUARD_STEPS))
    runs.append((_OPTIMIZERS[2][0], _OPTIMIZERS[2][1], "generator", True, _GUARD_STEPS))
    runs.append((_OPTIMIZERS[1][0], _OPTIMIZERS[1][1], "generator", True, _GUARD_STEPS))
    for name, make in _OPTIMIZERS[1:]:
        runs.append((name, make, "list", False, _GUARD_STEPS_BAD_FIRST))
    runs.append((_OPTIMIZERS[2][0], _OPTIMIZERS[2][1], "tensor", False, _GUARD_STEPS_BAD_FIRST))
    total_cases = sum(len(run[-1]) for run in runs)
    index = 0
    for run_no, (opt_name, make, passed_as, frozen, steps) in enumerate(runs):
        if passed_as == "tensor":
            ref_model, model = _guard_single(run_no), _guard_single(run_no)
        else:
            ref_model, model = _guard_model(run_no, frozen), _guard_model(run_no, frozen)
        ref_params = [p for p in ref_model.parameters() if p.requires_grad]
        params = [p for p in model.parameters() if p.requires_grad]
        ref_opt = make(ref_params)
        opt = make(params)
        passed = {
            "list": "",
            "generator": ", parameters passed as model.parameters() (a generator)",
            "tensor": ", its only parameter passed as a bare tensor, not in a list",
        }[passed_as]
        kind = "a one-layer model" if passed_as == "tensor" else "a small MLP"
        setup = (
            f"{kind}, optimizer {opt_name}, max_norm={_num(max_norm)}"
            + passed
            + (", one parameter frozen (its .grad is None)" if frozen else "")
        )
        for step_no, (scale, poison) in enumerate(steps, start=1):
            index += 1
            gen = torch.Generator().manual_seed(100 * run_no + step_no)
            grads = [torch.randn(p.shape, generator=gen) * scale for p in params]
            if poison:
                grads[0].view(-1)[0] = _NAN if poison == "nan" else _INF
            for p, g in zip(ref_params, grads, strict=True):
                p.grad = g.clone()
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            total = _norm64(grads, 2.0)
            take = bool(torch.isfinite(total)) and bool(max_norm / (total + _EPS) >= 1.0)
            if take:
                ref_opt.step()
            what = {
                "": f"gradient norm {_num(float(total))}",
                "nan": "a NaN gradient",
                "inf": "an infinite gradient",
            }[poison]
            verdict = "must be taken" if take else "must be skipped"
            header = [
                f"Case {index} of {total_cases} fails: {setup}.",
                f"  step {step_no} of {len(steps)}: {what}, so the step {verdict}.",
            ]
            arg = {
                "list": params,
                "generator": model.parameters(),
                "tensor": params[0] if params else params,
            }[passed_as]
            call_text = "fn(parameters, optimizer, max_norm)"
            ok, result, _ = _answer(fn, call_text, header, [], arg, opt, max_norm, watch_host=False)
            if not ok:
                return False
            result = _as_bool(result)
            if not isinstance(result, bool):
                hint = []
                if isinstance(result, (numbers.Real, Tensor)):
                    hint = [
                        "  Hint: return a bool, True or False (or a bool tensor such as "
                        "torch.isfinite(norm)), not a number."
                    ]
                _say(
                    [
                        *header,
                        f"  expected return value: {take}",
                        f"  your return value:     {_value_text(result)}",
                        *hint,
                    ]
                )
                return False
            if result != take:
                _say(
                    [
                        *header,
                        f"  expected return value: {take}",
                        f"  your return value:     {result}",
                    ]
                )
                return False
            for i, (rp, p) in enumerate(zip(ref_params, params, strict=True)):
                if not _bitwise_equal(rp.detach(), p.detach()):
                    change = "changed" if not take else "differ from exactly one optimizer.step()"
                    _say(
                        [
                            *header,
                            f"  The values of parameter {i} {change}.",
                            f"  expected: {_tensor_text(rp)}",
                            f"  yours:    {_tensor_text(p)}",
                        ]
                    )
                    return False
            ref_state = _state_tensors(ref_opt, ref_params)
            state = _state_tensors(opt, params)
            if ref_state.keys() != state.keys():
                missing = sorted(set(ref_state) ^ set(state))
                status = "missing" if missing[0] in ref_state else "unexpected"
                _say(
                    [
                        *header,
                        f"  The optimizer state differs: {missing[0]} is {status}.",
                    ]
                )
                return False
            for key, ref_value in ref_state.items():
                if not _bitwise_equal(ref_value, state[key]):
                    _say(
                        [
                            *header,
                            f"  The optimizer's {key} differs from the reference.",
                            f"  expected: {_tensor_text(ref_value)}",
                            f"  yours:    {_tensor_text(state[key])}",
                            "  Hint: a skipped step must not call optimizer.step() at all: with "
                            "momentum, weight decay or Adam, even zero gradients move the "
                            "parameters and change the state.",
                        ]
                    )
                    return False
    _say([f"All {total_cases} cases pass."])
    return True


# ------------------------------------------------------------- threshold choice


def _floats(values: object, name: str) -> list[float]:
    if isinstance(values, Tensor):
        if values.is_complex():
            raise TypeError(f"{name} is a complex tensor")
        return [float(v) for v in values.detach().to("cpu", torch.float64).reshape(-1)]
    out = []
    for v in values:  # type: ignore[union-attr]
        if isinstance(v, Tensor):  # a list of 0-dim norms, as get_total_norm returns
            if v.numel() != 1 or v.is_complex():
                raise TypeError(f"{name} holds {_value_text(v)}")
            v = v.detach().to("cpu", torch.float64)
        out.append(float(v))
    return out


def _threshold_number(threshold: object) -> object:
    """A 0-dim (or one-element) real tensor or NumPy array as a Python float.

    Anything else is returned unchanged: a bool tensor stays a tensor (and is rejected,
    as a bare bool is), a number stays a number.
    """
    if isinstance(threshold, Tensor):
        real = threshold.dtype.is_floating_point or (
            not threshold.is_complex() and threshold.dtype != torch.bool
        )
        if threshold.numel() == 1 and real:
            return float(threshold.detach().to("cpu", torch.float64))
        return threshold
    if type(threshold).__module__ == "numpy" and getattr(threshold, "ndim", None) == 0:
        item = threshold.item()  # type: ignore[attr-defined]
        return item if isinstance(item, numbers.Real) else threshold
    return threshold


def check_threshold_choice(
    threshold: object,
    clean_norms: Sequence[float] | Tensor,
    outlier_norms: Sequence[float] | Tensor,
    *,
    keep_fraction: float = 0.99,
    catch_fraction: float = 1.0,
) -> bool:
    """Check a ``max_norm`` chosen for ignore-by-norm on a recorded run.

    ``clean_norms`` are the total gradient norms of the run's ordinary batches,
    ``outlier_norms`` those of the batches known to be bad (they may be inf or NaN;
    a NaN clean norm counts as a clean step that every threshold ignores). The
    labels are the grader's: the exercise picks the threshold without them (from the
    norms of the first healthy steps, say) and this check scores it on the whole run.
    A step is kept exactly when ``grad_ignore_norm_`` would keep it:
    ``threshold / (norm + 1e-6) >= 1`` (and the norm is not NaN). The norms may be
    lists of numbers or of 0-dim tensors, or tensors of any shape. The threshold may
    be a Python or NumPy number, or a 0-dim (or one-element) real tensor such as
    ``torch.quantile(norms, 0.99)``; a bool, a bool or complex tensor, or a tensor of
    several numbers is rejected. It passes when it is a non-negative real number that

    1. keeps at least ``keep_fraction`` (default 99%) of the clean steps, and
    2. ignores at least ``catch_fraction`` (default all) of the outlier steps.

    Both fractions must lie in [0, 1]. The verdict lists how many steps it keeps and
    which steps break a rule.
    """
    for name, fraction in (("keep_fraction", keep_fraction), ("catch_fraction", catch_fraction)):
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, numbers.Real)
            or not 0.0 <= float(fraction) <= 1.0
        ):
            _say([f"{name} must be a number from 0 to 1, got {_value_text(fraction)}."])
            return False
    try:
        clean = _floats(clean_norms, "clean_norms")
        outliers = _floats(outlier_norms, "outlier_norms")
    except (TypeError, ValueError):
        _say(["clean_norms and outlier_norms must be sequences of numbers."])
        return False
    threshold = _threshold_number(threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
        if isinstance(threshold, Tensor) and threshold.numel() == 1:
            got = f"a 0-dim {str(threshold.dtype).removeprefix('torch.')} tensor"
        else:
            got = _value_text(threshold)
        _say([f"The threshold must be a real number, got {got}."])
        return False
    tau = float(threshold)
    if math.isnan(tau) or tau < 0:
        _say([f"The threshold must be a non-negative number, got {_num(tau)}."])
        return False

    def kept(norm: float) -> bool:
        return not math.isnan(norm) and tau / (norm + _EPS) >= 1.0

    kept_clean = sum(kept(n) for n in clean)
    share = kept_clean / len(clean) if clean else 1.0
    dropped_clean = sorted((n for n in clean if not kept(n)), reverse=True)
    leaked = sorted(n for n in outliers if kept(n))
    needed = math.ceil(keep_fraction * len(clean) - 1e-9)
    caught = len(outliers) - len(leaked)
    to_catch = math.ceil(catch_fraction * len(outliers) - 1e-9)
    rule = (
        "all required"
        if to_catch == len(outliers)
        else f"at least {to_catch}, {100 * catch_fraction:.3g}%, required"
    )
    lines = [
        f"Threshold {_num(tau)}: keeps {kept_clean} of {len(clean)} clean steps "
        f"({100 * share:.1f}%; at least {needed}, {100 * keep_fraction:.3g}%, required) and "
        f"ignores {caught} of {len(outliers)} outlier steps ({rule})."
    ]
    ok = True
    if kept_clean < needed:
        ok = False
        shown = ", ".join(_num(n) for n in dropped_clean[:5])
        more = f" and {len(dropped_clean) - 5} more" if len(dropped_clean) > 5 else ""
        lines.append(f"  Too low: it ignores clean steps with norms {shown}{more}.")
    if caught < to_catch:
        ok = False
        shown = ", ".join(_num(n) for n in leaked[:5])
        more = f" and {len(leaked) - 5} more" if len(leaked) > 5 else ""
        lines.append(f"  Too high: it keeps outlier steps with norms {shown}{more}.")
    if not ok:
        # the threshold must keep the `needed`-th smallest clean norm and stay below the
        # `to_catch`-th largest outlier norm (NaN: ignored by every threshold)
        ranked = sorted(n for n in clean if not math.isnan(n))
        catchable = sorted((n for n in outliers if not math.isnan(n)), reverse=True)
        nan_outliers = len(outliers) - len(catchable)
        must_catch = to_catch - nan_outliers
        lowest = catchable[must_catch - 1] if 0 < must_catch <= len(catchable) else _INF
        if needed > len(ranked) or (needed > 0 and ranked[needed - 1] >= lowest):
            lines.append(
                "  No threshold can meet both rules on these numbers: the smallest outlier is "
                "below the norm needed to keep enough clean steps."
            )
        lines.append("Not passed.")
    else:
        lines.append("Passed.")
    _say(lines)
    return ok
