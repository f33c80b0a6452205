r"""Self-checking exercises of the chapter "Accumulation and many processes".

Three checks, each printing one verdict as :mod:`gradlab_book.exercises` does:

* :func:`check_global_norm` runs a student's ``global_norm(local_norms, p)``, the norm
  of a gradient split across ranks put together from each rank's local norm;
* :func:`check_parallel_norm` runs ``parallel_norm(ranks, p)``, the global norm of a
  model split by tensor and pipeline parallelism, where some tensors are copies on
  every tensor-parallel rank (count them once);
* :func:`check_accumulate_fp16` runs ``accumulate_step(model, optimizer, scaler,
  micro_batches, max_norm)``, one optimizer step of gradient accumulation under float16
  autocast with loss scaling, leaving out the bad micro-batches (the chapter's
  accumulator with the mixed-precision chapter's ``GradScaler``).

For :func:`check_global_norm` the expected values are computed here, independently, in
float64 with :mod:`math`:

.. math::
    \|g\|_p = \Bigl(\sum_r n_r^p\Bigr)^{1/p}
            = M\,\Bigl(\sum_r (n_r / M)^p\Bigr)^{1/p},\quad M = \max_r n_r,
    \qquad \|g\|_\infty = \max_r n_r ,

NaN if any :math:`n_r` is NaN, inf if any is inf (and none is NaN). The other two
checks compute their references in float64 from the whole model (every entry once),
and from one float64 gradient per micro-batch with the SGD formula written out.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gradlab_book.exercise_kit import (
    Raised,
    answer,
    call,
    indented,
    num,
    say,
    value_text,
)

__all__ = [
    "check_accumulate_fp16",
    "check_global_norm",
    "check_parallel_norm",
    "expected_global_norm",
]

_NAN, _INF = math.nan, math.inf


def expected_global_norm(local_norms: Sequence[float], p: float) -> float:
    """The p-norm of the whole from the ranks' p-norms, in float64 (no overflow)."""
    norms = [float(n) for n in local_norms]
    if any(math.isnan(n) for n in norms):
        return _NAN
    if any(math.isinf(n) for n in norms):
        return _INF
    if not norms:
        return 0.0
    m = max(norms)
    if p == _INF or m == 0:
        return m
    return m * math.fsum((n / m) ** p for n in norms) ** (1.0 / p)


# (title, local norms, p, hint shown when it fails)
_CASES: list[tuple[str, list[float], float, str]] = [
    ("two ranks, p=2", [3.0, 4.0], 2.0, "For p = 2: the square root of the sum of squares."),
    ("two ranks, p=1", [3.0, 4.0], 1.0, "For p = 1 the local norms simply add up."),
    ("two ranks, p=inf", [3.0, 4.0], _INF, "For p = inf: the largest local norm."),
    ("four ranks, p=2", [1.5, 2.0, 0.5, 1.0], 2.0, ""),
    ("three ranks, p=3", [1.0, 2.0, 3.0], 3.0, "(sum of n_r ** p) ** (1 / p)."),
    ("one rank, p=2", [2.5], 2.0, "With one rank the global norm is its local norm."),
    ("all zero, p=2", [0.0, 0.0], 2.0, "The norm of zeros is 0 (mind a division by 0)."),
    ("all zero, p=inf", [0.0, 0.0], _INF, ""),
    (
        "NaN on rank 1, p=2",
        [3.0, _NAN],
        2.0,
        "A NaN on one rank must make the global norm NaN.",
    ),
    (
        "NaN on rank 0, p=inf",
        [_NAN, 3.0],
        _INF,
        "A NaN on one rank must make the global norm NaN.",
    ),
    (
        "NaN on rank 1, p=inf",
        [3.0, _NAN],
        _INF,
        "Python's max(3.0, nan) is 3.0 and max(nan, 3.0) is nan (every comparison "
        "with NaN is false): the same pitfall as gloo's all_reduce MAX. Test for NaN "
        "separately (math.isnan).",
    ),
    ("inf on rank 0, p=2", [_INF, 1.0], 2.0, "An infinite local norm makes the whole inf."),
    ("inf and NaN, p=inf", [_INF, _NAN], _INF, "NaN wins over inf."),
    (
        "two ranks of norms 3e200 and 4e200, p=2",
        [3e200, 4e200],
        2.0,
        "(3e200) ** 2 overflows to inf in float64: divide by the largest local norm "
        "M first, and multiply the result by M.",
    ),
    (
        "two ranks of norms 3e-200 and 4e-200, p=2",
        [3e-200, 4e-200],
        2.0,
        "(3e-200) ** 2 underflows to 0 in float64: divide by the largest local norm "
        "M first, and multiply the result by M.",
    ),
]


def _as_float(value: object) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().to("cpu", torch.float64).reshape(()))
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _agrees(expected: float, got: float) -> bool:
    if math.isnan(expected):
        return math.isnan(got)
    if math.isinf(expected):
        return got == expected
    return math.isfinite(got) and math.isclose(got, expected, rel_tol=1e-12, abs_tol=0.0)


def check_global_norm(fn: Callable) -> bool:
    """Check ``fn(local_norms, p)``: the global p-norm from the ranks' local p-norms.

    ``local_norms`` is a list of Python floats, one per rank (each rank's p-norm of
    its part of the gradient); ``p`` a positive float or ``math.inf``. The answer
    must return a number (or a 0-dim tensor) within 1e-12 relative of the float64
    value of :func:`expected_global_norm`, NaN where a rank's norm is NaN and inf
    where one is inf; it must not change ``local_norms``.
    """
    if not callable(fn):
        say([f"Expected a function, got {value_text(fn)}."])
        return False
    for index, (title, norms, p, hint) in enumerate(_CASES, start=1):
        given = list(norms)
        shown = "[" + ", ".join(num(n) for n in norms) + "]"
        call_text = f"fn({shown}, {num(p)})"
        header = [f"Case {index} of {len(_CASES)} fails: {title}.", f"  call:     {call_text}"]
        ok, result, _ = answer(fn, call_text, header, [], given, p, watch_host=False)
        if not ok:
            return False
        # first: an answer that changed its input gets that said, not a value hint
        same = len(given) == len(norms) and all(
            (a == b) or (math.isnan(a) and math.isnan(b))
            for a, b in zip(given, norms, strict=False)
        )
        if not same:
            say([*header, "  Your function changed local_norms: leave its input as it is."])
            return False
        got = _as_float(result)
        expected = expected_global_norm(norms, p)
        if got is None or not _agrees(expected, got):
            say(
                [
                    *header,
                    f"  expected: {num(expected)}",
                    f"  yours:    {value_text(result) if got is None else num(got)}",
                    *([f"  Hint: {hint}"] if hint else []),
                ]
            )
            return False
    say([f"All {len(_CASES)} cases pass."])
    return True


# ------------------------------------------------------- tensor and pipeline parallel


def _rank(tp: int, pp: int, sharded: list[Tensor], replicated: list[Tensor]) -> dict:
    return {"tp": tp, "pp": pp, "sharded": sharded, "replicated": replicated}


def _seeded(shape, seed: int, scale: float = 1.0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64) * scale


def _layout(tp: int, pp: int, seed: int, replicated: bool = True) -> list[dict]:
    """``tp`` x ``pp`` ranks: each stage's two TP-split tensors cut into ``tp`` pieces,
    and (if ``replicated``) one LayerNorm weight and one bias copied on every TP rank."""
    ranks = []
    for stage in range(pp):
        weight = _seeded((4 * tp, 3), seed + 10 * stage)
        bias = _seeded((2 * tp,), seed + 10 * stage + 1)
        copies = [_seeded((3,), seed + 10 * stage + 2), _seeded((5,), seed + 10 * stage + 3)]
        for i in range(tp):
            pieces = [weight.chunk(tp, 0)[i].clone(), bias.chunk(tp, 0)[i].clone()]
            mine = [c.clone() for c in copies] if replicated else []
            ranks.append(_rank(i, stage, pieces, mine))
    return ranks


def expected_parallel_norm(ranks: list[dict], p: float) -> float:
    """The p-norm of the whole model, in float64: every TP-split piece once, and each
    stage's replicated tensors once (from that stage's TP rank 0)."""
    entries = []
    for r in ranks:
        entries += [t.double().reshape(-1) for t in r["sharded"]]
        if r["tp"] == 0:
            entries += [t.double().reshape(-1) for t in r["replicated"]]
    flat = torch.cat(entries) if entries else torch.zeros(0, dtype=torch.float64)
    if flat.numel() == 0:
        return 0.0
    return float(torch.linalg.vector_norm(flat, p))


def _parallel_cases() -> list[tuple[str, list[dict], float, str]]:
    doubled = (
        "the replicated tensors are the same numbers on every TP rank: count them on "
        "one rank of each stage (Megatron-LM's param_is_not_tensor_parallel_duplicate), "
        "or add their p-th powers once per stage."
    )
    cases = [
        ("TP = 2, PP = 1, p = 2", _layout(2, 1, 1), 2.0, doubled),
        (
            "TP = 1, PP = 2 (two stages, different layers), p = 2",
            _layout(1, 2, 2),
            2.0,
            "pipeline stages hold different layers: every stage's entries count.",
        ),
        (
            "TP = 2, PP = 2, p = 2",
            _layout(2, 2, 3),
            2.0,
            "each stage has its own replicated tensors: count them once per stage, not "
            "once for the whole model.",
        ),
        ("TP = 4, PP = 2, p = 1", _layout(4, 2, 4), 1.0, doubled),
        ("TP = 2, PP = 2, p = 3", _layout(2, 2, 5), 3.0, "(sum of |x|^p) ** (1 / p)."),
        (
            "TP = 2, PP = 2, p = inf",
            _layout(2, 2, 6),
            math.inf,
            "the inf-norm is the largest |entry|, copies or not.",
        ),
    ]
    shuffled = _layout(2, 2, 7)
    shuffled = [shuffled[k] for k in (3, 1, 2, 0)]  # TP rank 1 of stage 1 first
    cases.append(
        (
            "TP = 2, PP = 2, the ranks listed out of order",
            shuffled,
            2.0,
            "tell the TP rank by its 'tp' entry, not by its place in the list.",
        )
    )
    cases.append(("TP = 2, PP = 2, no replicated tensors", _layout(2, 2, 8, False), 2.0, ""))
    nan = _layout(2, 2, 9)
    nan[3]["sharded"][0][0, 0] = math.nan
    cases.append(
        (
            "TP = 2, PP = 2, a NaN in the last rank's piece, p = inf",
            nan,
            math.inf,
            "a NaN anywhere makes the norm NaN; Python's max() keeps whichever operand "
            "comes first when a comparison with NaN is false.",
        )
    )
    return cases


def _ranks_text(ranks: list[dict]) -> str:
    parts = []
    for r in ranks:
        shapes = ", ".join(str(tuple(t.shape)) for t in r["sharded"])
        copies = ", ".join(str(tuple(t.shape)) for t in r["replicated"]) or "none"
        parts.append(f"(tp {r['tp']}, pp {r['pp']}: sharded {shapes}; replicated {copies})")
    return "; ".join(parts)


def _copy_ranks(ranks: list[dict]) -> list[dict]:
    return [
        {
            **r,
            "sharded": [t.clone() for t in r["sharded"]],
            "replicated": [t.clone() for t in r["replicated"]],
        }
        for r in ranks
    ]


def _same_ranks(a: list[dict], b: list[dict]) -> bool:
    def eq(x: Tensor, y: Tensor) -> bool:
        return torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())

    return all(
        ra["tp"] == rb["tp"]
        and ra["pp"] == rb["pp"]
        and len(ra["sharded"]) == len(rb["sharded"])
        and len(ra["replicated"]) == len(rb["replicated"])
        and all(eq(x, y) for x, y in zip(ra["sharded"], rb["sharded"], strict=True))
        and all(eq(x, y) for x, y in zip(ra["replicated"], rb["replicated"], strict=True))
        for ra, rb in zip(a, b, strict=True)
    )


def check_parallel_norm(fn: Callable) -> bool:
    """Check ``fn(ranks, p)``: the global p-norm under tensor and pipeline parallelism.

    ``ranks`` is a list with one dict per rank: ``"tp"`` (its tensor-parallel rank),
    ``"pp"`` (its pipeline stage), ``"sharded"`` (its pieces of the tensor-parallel
    parameters' gradients: different on every TP rank) and ``"replicated"`` (its copy
    of the gradients every TP rank of its stage holds whole, LayerNorm weights and
    row-parallel biases: the same numbers on each). Different stages hold different
    layers. The answer must return the p-norm of the whole model's gradient, every
    entry counted once, as a number (or a 0-dim tensor) within 1e-12 relative of the
    float64 value of :func:`expected_parallel_norm`; NaN if any entry is NaN. It must
    not change ``ranks``.

    Checked on nine layouts: TP only, PP only, TP x PP at p = 1, 2, 3 and inf, the
    ranks out of order, no replicated tensors, and a NaN in one rank's piece.
    """
    if not callable(fn):
        say([f"Expected a function, got {value_text(fn)}."])
        return False
    cases = _parallel_cases()
    for index, (title, ranks, p, hint) in enumerate(cases, start=1):
        given = _copy_ranks(ranks)
        call_text = f"fn(ranks, {num(p)})"
        header = [
            f"Case {index} of {len(cases)} fails: {title}.",
            f"  call:  {call_text}",
            f"  ranks: {_ranks_text(ranks)}",
        ]
        ok, result, _ = answer(fn, call_text, header, [], given, p, watch_host=False)
        if not ok:
            return False
        if not _same_ranks(given, ranks):
            say([*header, "  Your function changed ranks: leave its input as it is."])
            return False
        got = _as_float(result)
        expected = expected_parallel_norm(ranks, p)
        if got is None or not _agrees(expected, got):
            lines = [
                *header,
                f"  expected: {num(expected)}",
                f"  yours:    {value_text(result) if got is None else num(got)}",
            ]
            if got is not None and math.isfinite(got) and math.isfinite(expected):
                everything = [dict(r, tp=0) for r in ranks]  # every copy counted
                if _agrees(expected_parallel_norm(everything, p), got):
                    lines.append("  That is the norm with every copy counted.")
            say([*lines, *([f"  Hint: {hint}"] if hint else [])])
            return False
    say([f"All {len(cases)} cases pass."])
    return True


# -------------------------------------------------- accumulation with loss scaling

#: The SGD of the accumulation check: a zero-gradient step still moves the parameters
#: through the weight decay, so that an exact skip and a zero step differ.
_LR, _MOMENTUM, _WEIGHT_DECAY = 0.1, 0.9, 0.1


@dataclass(frozen=True)
class _AccCase:
    what: str
    factors: tuple[float, ...]  # each micro-batch's targets are multiplied by this
    init_scale: float
    max_norm: float
    overflows: tuple[int, ...]  # the micro-batches whose scaled float16 gradient is inf
    hint: str


def _acc_cases() -> list[_AccCase]:
    return [
        _AccCase(
            "four clean micro-batches, scale 2**12",
            (1, 1, 1, 1),
            2.0**12,
            5.0,
            (),
            "divide each micro-batch's loss by the number of micro-batches, and test the "
            "unscaled gradient: MicroBatchAccumulator(..., scaler=scaler).",
        ),
        _AccCase(
            "micro-batch 2's targets 100 times too large (finite, norm about 50 > 5), scale 2**8",
            (1, 1, 100, 1),
            2.0**8,
            5.0,
            (),
            "leave the bad micro-batch out and take the mean of the three others: the "
            "sum of the kept ones times A / kept (finish_() does it).",
        ),
        _AccCase(
            "micro-batch 1 overflows in float16 (targets 1e5 times too large), scale 2**12",
            (1, 1e5, 1, 1),
            2.0**12,
            5.0,
            (1,),
            "the overflowed micro-batch is left out, the step is taken on the other three, "
            "and the scaler must see the inf and halve its scale: give the accumulator "
            "the scaler, finish_(optimizer), then scaler.update().",
        ),
        _AccCase(
            "every micro-batch overflows, scale 2**40",
            (1, 1, 1, 1),
            2.0**40,
            5.0,
            (0, 1, 2, 3),
            "with none kept the step must not happen at all: "
            "gradlab.step_if_(optimizer, kept > 0, sync=False), not optimizer.step() on a "
            "zero gradient; and the scaler halves its scale.",
        ),
        _AccCase(
            "every micro-batch finite but over max_norm = 0.001, scale 2**8",
            (1, 1, 1, 1),
            2.0**8,
            1e-3,
            (),
            "with none kept the step must not happen at all, and nothing overflowed: "
            "scaler.step(optimizer) would step on the zero gradient here (it knows "
            "only about infs); use gradlab.step_if_(optimizer, kept > 0, sync=False).",
        ),
    ]


def _acc_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return model.to(dtype)


def _acc_batches(factors: Sequence[float]) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for f in factors:
        x = torch.randn(8, 4, generator=gen)
        y = torch.randn(8, 1, generator=gen) * f
        out.append((x, y))
    return out


def _acc_expected(case: _AccCase) -> tuple[int, list[Tensor] | None, float]:
    """(kept, parameters after the step or None for no step, scale after), in float64."""
    model = _acc_model(torch.float64)
    params = [p.detach().clone() for p in model.parameters()]
    batches = _acc_batches(case.factors)
    a = len(batches)
    kept = []
    for i, (x, y) in enumerate(batches):
        model.zero_grad()
        (nn.functional.mse_loss(model(x.double()), y.double()) / a).backward()
        grad = [p.grad.detach().clone() for p in model.parameters()]
        norm = float(torch.cat([g.reshape(-1) for g in grad]).norm())
        if i not in case.overflows and case.max_norm / (norm + 1e-6) >= 1.0:
            kept.append(grad)
    scale = case.init_scale / 2 if case.overflows else case.init_scale
    if not kept:
        return 0, None, scale
    mean = [a * sum(gs) / len(kept) for gs in zip(*kept, strict=True)]  # A/kept * sum g_i/A
    # SGD's first step with momentum and weight decay: the buffer is g + wd p
    after = [p - _LR * (g + _WEIGHT_DECAY * p) for p, g in zip(params, mean, strict=True)]
    return len(kept), after, scale


def check_accumulate_fp16(fn: Callable) -> bool:
    """Check ``fn(model, optimizer, scaler, micro_batches, max_norm)``: one accumulated step.

    The contract: for each ``(x, y)`` of ``micro_batches`` run the forward under
    ``torch.autocast("cpu", dtype=torch.float16)``, take ``mse_loss(out.float(), y)``
    divided by the number of micro-batches, and backpropagate it scaled by ``scaler``
    (a ``torch.amp.GradScaler``); leave out every micro-batch whose *unscaled* gradient
    norm is above ``max_norm`` or not finite; step ``optimizer`` on the mean gradient of
    the kept micro-batches, or not at all (parameters and optimizer state untouched)
    when none is kept; make the scaler halve its scale when a micro-batch overflowed;
    end with ``scaler.update()``. Return the number kept (an int or a 0-dim tensor).

    Each case builds a fresh float32 MLP (4-16-1), ``SGD(lr=0.1, momentum=0.9,
    weight_decay=0.1)`` and ``GradScaler("cpu", init_scale=..., growth_interval=1000)``.
    The expected step is computed in float64 without autocast, one micro-batch at a
    time, with SGD's first step written out (``p - lr (g + wd p)``); the answer's step
    must agree within 2% (float16 rounding), and a skipped step must leave the
    parameters bit for bit. Five cases: all clean, one too large, one overflowing,
    all overflowing, all over ``max_norm``.
    """
    if not callable(fn):
        say([f"Expected a function, got {value_text(fn)}."])
        return False
    cases = _acc_cases()
    for index, case in enumerate(cases, start=1):
        model = _acc_model()
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(
            model.parameters(), lr=_LR, momentum=_MOMENTUM, weight_decay=_WEIGHT_DECAY
        )
        scaler = torch.amp.GradScaler("cpu", init_scale=case.init_scale, growth_interval=1000)
        batches = _acc_batches(case.factors)
        call_text = f"fn(model, optimizer, scaler, micro_batches, max_norm={num(case.max_norm)})"
        header = [f"Case {index} of {len(cases)} fails: {case.what}.", f"  call: {call_text}"]
        hint = [f"  Hint: {case.hint}"]
        try:
            result = call(
                fn, call_text, model, optimizer, scaler, copy.deepcopy(batches), case.max_norm
            )
        except Raised as raised:
            say(
                raised.lines
                if raised.lines[0].startswith("Not implemented")
                else [*header, *indented(raised.lines), *hint]
            )
            return False
        kept, after, scale = _acc_expected(case)
        got_kept = _as_float(result)
        lines = list(header)
        now = [p.detach() for p in model.parameters()]
        if got_kept is None or got_kept != kept:
            lines.append(
                f"  expected {kept} micro-batches kept; your function returned "
                f"{value_text(result)}."
            )
        elif after is None and not all(torch.equal(p, b) for p, b in zip(now, before, strict=True)):
            moved = max(float((p - b).abs().max()) for p, b in zip(now, before, strict=True))
            lines.append(
                f"  No micro-batch is kept, so the step must be skipped, but the parameters "
                f"moved (by up to {num(moved)}): a zero gradient still carries the weight decay "
                "and the momentum (zeroing is not skipping)."
            )
        elif after is not None:
            delta = torch.cat(
                [(p.double() - b.double()).reshape(-1) for p, b in zip(now, before, strict=True)]
            )
            want = torch.cat(
                [(w - b.double()).reshape(-1) for w, b in zip(after, before, strict=True)]
            )
            if not bool(torch.isfinite(delta).all()):
                lines.append("  The parameters are not finite after your step.")
            elif not bool(delta.any()):
                lines.append(
                    f"  Your function skipped the step, but {kept} micro-batches were kept: "
                    "step on their mean (scaler.step(optimizer) skips the whole step when "
                    "any micro-batch overflowed)."
                )
            elif float((delta - want).norm()) > 0.02 * float(want.norm()):
                ratio = float(delta @ want / (want @ want))
                lines.append(
                    f"  the parameters moved by a step of norm {num(delta.norm())}, expected "
                    f"{num(want.norm())} (yours is {num(ratio)} times the expected one along it)."
                )
        if len(lines) == len(header) and scaler.get_scale() != scale:
            lines.append(
                f"  the scaler's scale is {num(scaler.get_scale())} after the step, expected "
                f"{num(scale)}"
                + (" (halved: a micro-batch overflowed)." if case.overflows else ".")
            )
        if len(lines) > len(header):
            say([*lines, *hint])
            return False
    say([f"All {len(cases)} cases pass."])
    return True
