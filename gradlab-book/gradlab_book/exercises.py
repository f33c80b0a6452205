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

Every check hands the answer its own list, and says so when the answer changes that
list (a caller's list of parameters is theirs to keep). The checks of functions that
decide something (clip by norm, ignore by norm or by value, clip and count) also watch
for reads of tensor values on the host, as
:class:`gradlab.sync.HostReadCounter` defines them (``.item()``, ``if t > x:``,
``t.tolist()``, ``g[mask] = 0``, ``torch.equal``, printing a tensor, ...), and name
the one found: such a read forces the program to wait for the accelerator at every
step, and the decision can always be made on the device instead. The total-norm check
watches the operators too, and rejects a concatenated copy of the tensors
(``aten.cat``), which its exercise forbids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradlab_book.exercise_kit import (
    EPS,
    INF,
    NAN,
    answer,
    grads_text,
    identical,
    norm64,
    num,
    rejects_host_read,
    same,
    say,
    tolerance,
    value_text,
)

__all__ = [
    "check_clip_and_count",
    "check_clip_grad_norm",
    "check_clip_grad_value",
    "check_grad_ignore_norm",
    "check_grad_ignore_value",
    "check_total_norm",
]

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
    return list(params), params  # the answer's own list: the check keeps the original


def _describe(case: _GradCase) -> str:
    how = {
        "list": "a list of parameters",
        "generator": "a generator of parameters (it can be iterated only once)",
        "module": "model.parameters() of an nn.Linear(3, 2) (a generator: one pass only)",
        "tensor": "one bare tensor, not in a list (as torch.nn.utils accepts)",
    }[case.kind]
    return f"{case.title}; {how}"


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
    n2 = float(norm64(three, 2))

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
    add(f"three tensors, total 2-norm {num(n2)}, under the threshold", three, 2 * n2)
    add(
        f"three tensors, total 2-norm {num(n2)}, over the threshold",
        three,
        n2 / 2,
        hint="The decision is about all the gradients together: every tensor is affected.",
    )
    for p in (1.0, 3.5, INF):
        total = float(norm64(three, p))
        add(
            f"three tensors, norm_type={num(p)}, total norm {num(total)}, under",
            three,
            2 * total,
            p,
        )
        add(
            f"three tensors, norm_type={num(p)}, total norm {num(total)}, over",
            three,
            total / 2,
            p,
        )
    close = float(norm64(three, 2))
    add("three tensors, total 2-norm 1% over the threshold", three, close / 1.01)
    add("three tensors, total 2-norm 1% under the threshold", three, close * 1.01)
    f64 = _three(20, dtype=torch.float64)
    n64 = float(norm64(f64, 2))
    add("three float64 tensors, over the threshold", f64, n64 / 3)
    add("three float64 tensors, under the threshold", f64, n64 * 3)
    f16 = (_t([0.5, -1.5], torch.float16), _t([[2.0, 0.25], [-1.0, 1.0]], torch.float16))
    add("two float16 tensors, total 2-norm 3, over the threshold", f16, 1.0)
    add("two float16 tensors, total 2-norm 3, under the threshold", f16, 4.0)
    mixed = (_t([1.0, 2.0]), _t([2.0, -4.0], torch.float64))
    add("a float32 and a float64 tensor, total 2-norm 5, over the threshold", mixed, 2.5)
    with_none = (three[0], None, three[2])
    nn2 = float(norm64(with_none, 2))
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
    ng = float(norm64(gen_grads, 2))
    gen_hint = "A generator is used up after one pass: turn it into a list first."
    add("three tensors, over the threshold", gen_grads, ng / 2, kind="generator", hint=gen_hint)
    lin = (_seeded((2, 3), 40), _seeded((2,), 41))
    nl = float(norm64(lin, 2))
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
        (three[0], _t([[0.5, NAN], [1.0, -1.0]]), three[2]),
        100.0,
        hint=nan_hint,
    )
    add(
        "three tensors, one entry is +inf",
        (three[0], three[1], _t([1.0, INF, -2.0])),
        100.0,
        hint=inf_hint,
    )
    add(
        "two tensors, one entry is -inf, norm_type=inf",
        (_t([-INF, 1.0]), _t([0.5, 0.5])),
        100.0,
        INF,
        hint=inf_hint,
    )
    add("two tensors of zeros, threshold 1", (_t([0.0, 0.0]), _t([0.0])), 1.0)
    add("three tensors, threshold inf (nothing is ever too large)", three, INF)
    # The chapters' float16 overflow: every entry is small, the norm is not.
    big16 = (torch.full((10_000,), 1000.0, dtype=torch.float16),)
    overflow_hint = (
        "A float16 norm overflows above 65504: compute the per-tensor norms and the total "
        "in float32 (torch.linalg.vector_norm(g, norm_type, dtype=torch.float32)) and "
        "return that float32 norm, as gradlab does. torch.nn.utils.clip_grad_norm_ keeps "
        "them in float16, gets inf and zeroes every gradient."
    )
    add(
        "one float16 tensor of 10000 entries of 1000: total 2-norm 1e5, above float16's "
        f"largest value 65504, {'over' if fn_name == 'clip' else 'under'} the threshold",
        big16,
        1.0 if fn_name == "clip" else 2e5,
        hint=overflow_hint,
    )
    # The boundary the chapters teach: a norm equal to the threshold.
    if fn_name == "clip":
        edge_hint = "The coefficient is min(1, max_norm / (total_norm + 1e-6))."
    else:
        edge_hint = (
            "The rule is strict: keep only when max_norm / (total_norm + 1e-6) >= 1, "
            "computed in the norm's dtype (float32 here). At norm 5 the 1e-6 makes a norm "
            "equal to the threshold too large; at norm 50, 50 + 1e-6 rounds back to 50 in "
            "float32 and the gradient is kept. 'keep if total_norm <= max_norm' gets the "
            "first wrong, a decision in float64 the second."
        )
    add(
        "one tensor (3, 4): total 2-norm 5, exactly the threshold 5",
        (_t([3.0, 4.0]),),
        5.0,
        hint=edge_hint,
    )
    add(
        "one tensor (30, 40): total 2-norm 50, exactly the threshold 50",
        (_t([30.0, 40.0]),),
        50.0,
        hint=edge_hint,
    )
    return cases


def _value_cases(fn_name: str) -> list[_GradCase]:
    """The battery shared by the value-based checks (clip and ignore by value)."""
    cases: list[_GradCase] = []

    def add(title, grads, clip_value, kind="list", hint=""):
        cases.append(_GradCase(title, tuple(grads), clip_value, INF, kind, hint))

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
    elif fn_name == "count":
        nan_hint = (
            "torch.clamp leaves a NaN entry NaN: it is not changed, so it is not counted. "
            "NaN != NaN is True: count g.abs() > clip_value (False for NaN), not "
            "g != clamped."
        )
        inf_hint = "An infinite entry is clamped to +-clip_value: it counts as changed."
    else:
        nan_hint = (
            "A NaN entry must trigger the ignore: zero every gradient. Every comparison "
            "with NaN is False, and NaN * 0 is NaN: select zeros with torch.where."
        )
        inf_hint = "An infinite entry is above any threshold: zero every gradient."
    add("two tensors, one entry is NaN", (_t([0.5, NAN]), _t([0.25])), 10.0, hint=nan_hint)
    add("two tensors, one entry is +inf", (_t([0.5, 0.25]), _t([INF])), 10.0, hint=inf_hint)
    add("two tensors, one entry is -inf", (_t([-INF, 0.25]), _t([0.5])), 10.0, hint=inf_hint)
    add("one tensor, threshold 0", (_t([0.5, -0.25]),), 0.0)
    add("one tensor, threshold inf", (_t([0.5, -0.25, 1e30]),), INF)
    return cases


# -------------------------------------------------------------- references


def _expected_clip_norm(case: _GradCase) -> tuple[list[Tensor | None], Tensor]:
    total = norm64(case.grads, case.norm_type)
    coef = torch.clamp(case.threshold / (total + EPS), max=1.0)
    out = [None if g is None else g.to(torch.float64) * coef for g in case.grads]
    return out, total


def _norm_dtype(grads: Sequence[Tensor | None]) -> torch.dtype:
    """The dtype gradlab computes and returns a total norm in: float64 or float32."""
    wide = any(g is not None and g.dtype == torch.float64 for g in grads)
    return torch.float64 if wide else torch.float32


def _expected_ignore_norm(case: _GradCase) -> tuple[list[Tensor | None], Tensor]:
    total = norm64(case.grads, case.norm_type)
    # The rule as gradlab evaluates it, in the norm's own dtype: in float32 the 1e-6 is
    # lost for norms above about 32 (the chapter's (30, 40) at 50 is kept).
    narrow = total.to(_norm_dtype(case.grads))
    keep = bool(case.threshold / (narrow + EPS) >= 1.0)  # False for a NaN total
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


def _expected_clip_and_count(case: _GradCase) -> tuple[list[Tensor | None], Tensor]:
    grads, _ = _expected_clip_value(case)
    given = [g.to(torch.float64) for g in case.grads if g is not None]
    entries = sum(g.numel() for g in given)
    changed = sum(int((g.abs() > case.threshold).sum()) for g in given)  # NaN: False
    return grads, torch.tensor(changed / entries if entries else 0.0, dtype=torch.float64)


def _expected_ignore_value(case: _GradCase) -> tuple[list[Tensor | None], Tensor]:
    largest = norm64(case.grads, INF)
    keep = bool(largest < case.threshold)  # False for NaN
    out = [
        None
        if g is None
        else (g.to(torch.float64) if keep else torch.zeros(g.shape, dtype=torch.float64))
        for g in case.grads
    ]
    return out, largest


# ---------------------------------------------------------------- the runner


_LIST_HINT = (
    "  Hint: a caller's list is theirs to keep using (it may be an optimizer's param "
    "group): read it, never remove, add or replace its items. Build your own list "
    "instead, e.g. grads = [p.grad for p in parameters if p.grad is not None] or "
    "tensors = list(tensors), and change that one."
)


def _changed_list(given: list, original: Sequence) -> str:
    """How an answer changed the list it was handed ("" if it did not).

    Compared by identity, item by item: ``list.pop``, ``append``, ``sort`` or
    ``given[i] = ...`` all count, whatever the items hold.
    """
    if len(given) != len(original):
        return f"it now holds {len(given)} items instead of {len(original)}"
    for i, (a, b) in enumerate(zip(given, original, strict=True)):
        if a is not b:
            return f"item {i} was replaced by another object"
    return ""


def _half(dtypes: Sequence[torch.dtype]) -> bool:
    return any(d in (torch.float16, torch.bfloat16) for d in dtypes)


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
        say([f"Expected a function, got {value_text(fn)}."])
        return False
    for index, case in enumerate(cases, start=1):
        arg, params = _build(case)
        before = [p.detach().clone() for p in params]
        kwargs = {"norm_type": case.norm_type} if pass_norm_type else {}
        call_text = f"fn(parameters, {threshold_name}={num(case.threshold)}"
        call_text += f", norm_type={num(case.norm_type)})" if pass_norm_type else ")"
        header = [
            f"Case {index} of {len(cases)} fails: {_describe(case)}.",
            f"  call:              {call_text}",
            f"  gradients before:  {grads_text(case.grads)}",
        ]
        hint = [f"  Hint: {case.hint}"] if case.hint else []
        ok, result, detector = answer(
            fn, call_text, header, hint, arg, case.threshold, watch_host=watch_host, **kwargs
        )
        if not ok:
            return False
        if case.kind == "list" and (how := _changed_list(arg, params)):
            say([*header, f"  Your function changed the list it was given: {how}.", _LIST_HINT])
            return False
        expected_grads, expected_return = expected_of(case)
        got_grads = [p.grad for p in params]
        dtypes = [g.dtype for g in case.grads if g is not None]
        rtol, atol = tolerance(dtypes)

        def fail(*lines: str, _header=header, _case=case) -> bool:
            say([*_header, *lines, *([f"  Hint: {_case.hint}"] if _case.hint else [])])
            return False

        # the gradients
        for i, (exp, got) in enumerate(zip(expected_grads, got_grads, strict=True)):
            if exp is None and got is None:
                continue
            if exp is None or got is None or not same(exp, got, rtol, atol):
                return fail(
                    f"  expected gradients: {grads_text(_as_input_dtypes(expected_grads, case))}",
                    f"  your gradients:     {grads_text(got_grads)}",
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
                    f"  your return value:     {value_text(result)}",
                )
        else:
            assert expected_return is not None
            what = {
                "norm": "the total norm before clipping",
                "norm_ignore": "the total norm before the decision",
                "largest": "the largest |entry|",
                "fraction": "the fraction of all gradient entries that were clamped",
            }[returns]
            ok = isinstance(result, Tensor) and result.dim() == 0
            norm_returned = returns in ("norm", "norm_ignore")
            if ok and norm_returned and _half(dtypes) and _half([result.dtype]):
                return fail(
                    f"  expected return value: tensor({num(float(expected_return))}) in "
                    f"float32, {what} (a 0-dim tensor)",
                    f"  your return value:     {value_text(result)} "
                    f"({str(result.dtype).replace('torch.', '')})",
                    "  A norm kept in 16 bits overflows above 65504 (float16) or keeps 8 "
                    "significant bits (bfloat16): return it in float32.",
                )
            if returns == "fraction":
                # a share of entries: absolute, whatever the gradients' dtype
                r_rtol, r_atol = 0.0, 1e-6
                ok = ok and result.is_floating_point()
            elif norm_returned and _half(dtypes):
                # A norm is a float32 (or float64) number even for 16-bit gradients:
                # compared at float32's precision, with room for summing 10^4 terms.
                r_rtol, r_atol = 1e-4, 1e-6
            else:
                r_rtol, r_atol = rtol, atol
            if ok:
                ok = same(expected_return.reshape(()), result, r_rtol, r_atol)
            if not ok:
                counted_after = (
                    returns == "fraction"
                    and isinstance(result, Tensor)
                    and result.numel() == 1
                    and float(expected_return) > 0
                    and float(result) == 0
                )
                kind = "floating-point tensor" if returns == "fraction" else "tensor"
                return fail(
                    f"  expected return value: tensor({num(float(expected_return))}), {what}"
                    f" (a 0-dim {kind})",
                    f"  your return value:     {value_text(result)}",
                    *(
                        ["  Count before you clamp: afterwards no entry is above clip_value."]
                        if counted_after
                        else []
                    ),
                )
        if rejects_host_read(
            detector, f"Case {index} of {len(cases)}: {_describe(case)}.", call_text
        ):
            return False
    say([f"All {len(cases)} cases pass."])
    return True


# ------------------------------------------------------------------ the checks


def check_clip_grad_norm(fn: Callable) -> bool:
    """Check ``fn(parameters, max_norm, norm_type=...)`` against clip-by-norm.

    Checked on every case: the gradients afterwards equal
    ``g * min(1, max_norm / (total_norm + 1e-6))`` (what :func:`gradlab.clip_grad_norm_`
    gives, NaN and inf included), within a tolerance suited to the dtype; the
    parameters' values and the list passed in are unchanged; the return value is the
    total norm *before* clipping, a 0-dim tensor, in float32 for 16-bit gradients;
    gradients that are None stay None; no tensor value is read on the host. A float16
    gradient whose norm (1e5) exceeds float16's range is among the cases:
    :func:`torch.nn.utils.clip_grad_norm_`, which keeps its norms in float16, fails it.
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
    ``max_norm / (total_norm + 1e-6) < 1``, evaluated in the norm's dtype (float32, or
    float64 if any gradient is float64), or the total norm is NaN (so an infinite or
    NaN gradient leaves zeros, never NaN), and left exactly as it was otherwise; the
    boundary cases (3, 4) at 5 (ignored) and (30, 40) at 50 (kept: float32 loses the
    1e-6) are among them; the parameters' values and the list passed in are
    unchanged; the return value is the total norm before the decision, a 0-dim tensor,
    in float32 for 16-bit gradients (a float16 gradient of norm 1e5 is among the
    cases); gradients that are None stay None; no tensor value is read on the host.
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


def check_clip_and_count(fn: Callable) -> bool:
    """Check ``fn(parameters, clip_value)``: clip by value, and count what it clamped.

    Checked on every case: every gradient entry is clamped into
    ``[-clip_value, clip_value]`` in place (a NaN entry stays NaN, as with
    :func:`torch.nn.utils.clip_grad_value_`); the return value is the fraction of all
    gradient entries that the clamp changed (``|g| > clip_value``: an infinite entry
    counts, a NaN entry does not), a 0-dim floating-point tensor (``tensor(0.)`` with
    no entries), within 1e-6; the parameters' values and the list passed in are
    unchanged; gradients that are None stay None; no tensor value is read on the host,
    so that a training loop can log the fraction at every step and read it only when
    it prints.
    """
    return _run_grad_cases(
        fn,
        _value_cases("count"),
        _expected_clip_and_count,
        threshold_name="clip_value",
        pass_norm_type=False,
        returns="fraction",
        watch_host=True,
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


class _Concatenations(TorchDispatchMode):
    """Counts the concatenations (``aten.cat``) of more numbers than there are tensors.

    ``torch.cat``, ``torch.concat``, ``torch.hstack`` and
    ``torch.nn.utils.parameters_to_vector`` all reach ``aten.cat``; ``torch.stack`` of
    the per-tensor norms is its own operator.
    """

    def __init__(self, tensors: int) -> None:
        super().__init__()
        self.tensors = tensors
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Joining the k per-tensor norms (gradlab does, per dtype) copies k numbers;
        # joining the entries copies more.
        if func.overloadpacket is torch.ops.aten.cat and out.numel() > self.tensors:
            self.count += 1
        return out


def check_total_norm(fn: Callable) -> bool:
    """Check ``fn(tensors, norm_type)``: the total norm of tensors seen as one vector.

    ``tensors`` holds the values themselves (e.g. gradients), not parameters. Checked
    on every case: the result is a 0-dim tensor equal, within a tolerance suited to
    the dtype, to ``(sum of |x|**p over every entry) ** (1/p)``, or the largest
    ``|x|`` for ``norm_type=inf``; NaN entries give NaN, infinite ones inf; no
    tensors give ``tensor(0.)``; a generator of tensors, and one bare tensor not in
    a list, work; 16-bit inputs give a float32 (or wider) result, also where a
    per-tensor or the total norm exceeds float16's largest value 65504; the tensors
    are not modified, NaN and inf entries included, nor is the list holding them; no
    concatenated copy of the tensors is made (``torch.cat``, as the exercise asks).
    """
    if not callable(fn):
        say([f"Expected a function, got {value_text(fn)}."])
        return False
    three = _three(50)
    cases: list[tuple[str, tuple[Tensor, ...], float, bool]] = []
    for p in (1.0, 2.0, 3.5, INF):
        cases.append((f"one tensor, norm_type={num(p)}", (_t([3.0, -4.0]),), p, False))
        cases.append((f"three tensors, norm_type={num(p)}", three, p, False))
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
        ("three float64 tensors, norm_type=inf", _three(60, dtype=torch.float64), INF, False),
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
        ("no tensors at all (an empty list), norm_type=inf", (), INF, False),
        ("two tensors, one entry is NaN, norm_type=2", (_t([1.0, NAN]), _t([2.0])), 2.0, False),
        ("two tensors, one entry is NaN, norm_type=inf", (_t([1.0, NAN]), _t([2.0])), INF, False),
        ("two tensors, one entry is +inf, norm_type=1", (_t([1.0, INF]), _t([2.0])), 1.0, False),
        (
            "two tensors, one entry is -inf, norm_type=inf",
            (_t([1.0, -INF]), _t([2.0])),
            INF,
            False,
        ),
    ]
    for index, (title, given, p, as_gen) in enumerate(cases, start=1):
        bare = isinstance(given, Tensor)
        tensors = (given,) if bare else given
        inputs = [t.clone() for t in tensors]
        given = list(inputs)  # the answer's own list
        arg = inputs[0] if bare else ((t for t in inputs) if as_gen else given)
        call_text = f"fn(tensors, norm_type={num(p)})"
        header = [
            f"Case {index} of {len(cases)} fails: {title}.",
            f"  call:     {call_text}",
            f"  tensors:  {grads_text(list(tensors))}",
        ]
        bare_hint = (
            "  Hint: one tensor may be passed instead of a list: "
            "if isinstance(tensors, torch.Tensor): tensors = [tensors]."
        )
        with _Concatenations(len(tensors)) as concatenations:
            ok, result, _ = answer(
                fn, call_text, header, [bare_hint] if bare else [], arg, p, watch_host=False
            )
        if not ok:
            return False
        if concatenations.count:
            say(
                [
                    *header,
                    "  Your function concatenates the tensors (torch.cat): that copies "
                    "every entry into one new vector, as large as the model.",
                    "  Hint: take one norm per tensor, then the norm of those norms: "
                    "||g||_p = ||(||g_1||_p, ..., ||g_k||_p)||_p (torch.stack the 0-dim "
                    "norms).",
                ]
            )
            return False
        if not (bare or as_gen) and (how := _changed_list(given, inputs)):
            say([*header, f"  Your function changed the list it was given: {how}.", _LIST_HINT])
            return False
        expected = norm64(tensors, p)
        rtol, atol = tolerance([t.dtype for t in tensors])
        half = any(t.dtype in (torch.float16, torch.bfloat16) for t in tensors)
        narrow = isinstance(result, Tensor) and result.dtype in (torch.float16, torch.bfloat16)
        if half and narrow:
            say(
                [
                    *header,
                    f"  expected: tensor({num(float(expected))}) in float32 (a 0-dim tensor)",
                    f"  yours:    {value_text(result)} ({str(result.dtype)[6:]})",
                    "  Hint: a 16-bit norm overflows above 65504 (float16) or loses digits "
                    "(bfloat16): accumulate and return it in float32.",
                ]
            )
            return False
        if not (
            isinstance(result, Tensor) and result.dim() == 0 and same(expected, result, rtol, atol)
        ):
            hint = []
            if not tensors:
                hint = ["  Hint: the norm of nothing is tensor(0.)."]
            elif as_gen:
                hint = ["  Hint: a generator is used up after one pass: turn it into a list first."]
            elif bare:
                hint = [bare_hint]
            say(
                [
                    *header,
                    f"  expected: tensor({num(float(expected))}) (a 0-dim tensor)",
                    f"  yours:    {value_text(result)}",
                    *hint,
                ]
            )
            return False
        for i, (t, t_in) in enumerate(zip(tensors, inputs, strict=True)):
            if not identical(t, t_in):
                say(
                    [
                        *header,
                        f"  Your function modified tensor {i}: a norm must not change its input.",
                    ]
                )
                return False
    say([f"All {len(cases)} cases pass."])
    return True
