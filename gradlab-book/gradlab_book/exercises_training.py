"""The self-checks of Part III: an exact skip in a training step, and a threshold choice.

``check_guarded_step`` (chapter "Ignoring a step correctly") and
``check_threshold_choice`` (chapter "Clip versus ignore in training"), built from
:mod:`gradlab_book.exercise_kit` like every check.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from gradlab.sync import HostReadCounter
from gradlab_book.exercise_kit import (
    EPS,
    INF,
    NAN,
    Raised,
    answer,
    call,
    indented,
    norm64,
    num,
    say,
    tensor_text,
    value_text,
)

__all__ = ["check_guarded_step", "check_threshold_choice"]


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
# "edge" and "below" replace the gradients by zeros and one entry whose absolute value is
# the norm: max_norm exactly, and the float32 number just below it. Both are skipped by
# the rule taught (keep if max_norm / (norm + 1e-6) >= 1); "keep if norm <= max_norm"
# keeps the first, "keep if norm < max_norm" the second.
_GUARD_STEPS: list[tuple[float, str]] = [
    (1.0, ""),
    (1.0, ""),
    (100.0, ""),
    (1.0, "nan"),
    (1.0, ""),
    (1.0, "edge"),
    (1.0, "inf"),
    (1.0, "below"),
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
    zeroed in place, but not set to None. One host read is allowed (the decision),
    beside the optimizer's own.

    Checked: a sequence of nine steps (normal, normal, a norm 100 times larger, a NaN
    gradient, normal, a norm of exactly ``max_norm``, an infinite gradient, a norm of
    the float32 number just below ``max_norm``, normal) with plain SGD, SGD with
    momentum and weight decay, Adam and AdamW, some with a frozen parameter and with
    ``model.parameters()`` passed as a generator; with SGD with momentum, Adam
    and AdamW, a sequence whose *first* step is bad (no state may be created); and,
    with Adam, a model whose only parameter is passed as a bare tensor, not in a list
    (as ``torch.nn.utils.clip_grad_norm_`` accepts it). The two boundary steps are
    skipped by the rule: ``norm <= max_norm`` or ``norm < max_norm`` without the
    ``1e-6`` is rejected there. After every step the return value, the parameters and
    the optimizer state must equal an independent reference run bit for bit (taken
    steps call ``optimizer.step()`` on identical models); after a skipped step every
    gradient must be the one passed in or zeros; and the call may read the host at most
    once more than the reference's ``optimizer.step()`` does (default Adam reads its CPU
    step counts itself), counted by :class:`gradlab.sync.HostReadCounter`. The answer
    gets its own list of the parameters, so a list it changes cannot mislead the check.
    The return value must be a bool: ``True``/``False``, a NumPy bool or a one-element
    bool tensor such as ``torch.isfinite(norm)``; a number such as 1 or 0, or a float
    tensor, is rejected.
    """
    if not callable(fn):
        say([f"Expected a function, got {value_text(fn)}."])
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
            f"{kind}, optimizer {opt_name}, max_norm={num(max_norm)}"
            + passed
            + (", one parameter frozen (its .grad is None)" if frozen else "")
        )
        for step_no, (scale, poison) in enumerate(steps, start=1):
            index += 1
            gen = torch.Generator().manual_seed(100 * run_no + step_no)
            grads = [torch.randn(p.shape, generator=gen) * scale for p in params]
            if poison in ("nan", "inf"):
                grads[0].view(-1)[0] = NAN if poison == "nan" else INF
            elif poison in ("edge", "below"):
                grads = [torch.zeros_like(g) for g in grads]
                edge = np.float32(max_norm)
                grads[0].view(-1)[0] = float(edge if poison == "edge" else np.nextafter(edge, 0))
            for p, g in zip(ref_params, grads, strict=True):
                p.grad = g.clone()
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            total = norm64(grads, 2.0)
            take = bool(torch.isfinite(total)) and bool(max_norm / (total + EPS) >= 1.0)
            own_reads = 0
            if take:
                with HostReadCounter() as reads:
                    ref_opt.step()
                own_reads = reads.count
            what = {
                "": f"gradient norm {num(float(total))}",
                "nan": "a NaN gradient",
                "inf": "an infinite gradient",
                "edge": f"gradient norm exactly max_norm = {num(max_norm)}",
                "below": f"gradient norm {float(total)!r}, the float32 number just below max_norm",
            }[poison]
            verdict = "must be taken" if take else "must be skipped"
            header = [
                f"Case {index} of {total_cases} fails: {setup}.",
                f"  step {step_no} of {len(steps)}: {what}, so the step {verdict}.",
            ]
            arg = {
                "list": list(params),  # its own list: one the answer changes misleads no one
                "generator": model.parameters(),
                "tensor": params[0] if params else params,
            }[passed_as]
            call_text = "fn(parameters, optimizer, max_norm)"
            ok, result, reads = answer(fn, call_text, header, [], arg, opt, max_norm)
            if not ok:
                return False
            allowed = 1 + own_reads
            if reads is not None and reads.count > allowed:
                mine = ""
                if own_reads:
                    mine = f", of which optimizer.step() itself makes {own_reads}"
                say(
                    [
                        *header,
                        f"  Your function read the host {reads.count} times; {allowed} "
                        f"allowed{mine}:",
                        *(f"    {k}. {op}" for k, op in enumerate(reads.operations[:5], 1)),
                        *(["    ..."] if reads.count > 5 else []),
                        "  Hint: decide on the device (keep = torch.isfinite(norm) & "
                        "(max_norm / (norm + 1e-6) >= 1)) and read that one bool once.",
                    ]
                )
                return False
            result = _as_bool(result)
            if not isinstance(result, bool):
                hint = []
                if isinstance(result, (numbers.Real, Tensor)):
                    hint = [
                        "  Hint: return a bool, True or False (or a bool tensor such as "
                        "torch.isfinite(norm)), not a number."
                    ]
                say(
                    [
                        *header,
                        f"  expected return value: {take}",
                        f"  your return value:     {value_text(result)}",
                        *hint,
                    ]
                )
                return False
            if result != take:
                hint = []
                if poison == "edge":
                    hint = [
                        "  Hint: a norm equal to max_norm is over it by the 1e-6: keep only "
                        "if max_norm / (norm + 1e-6) >= 1, not if norm <= max_norm."
                    ]
                elif poison == "below":
                    hint = [
                        "  Hint: the rule has the 1e-6 of torch's clip coefficient: keep only "
                        "if max_norm / (norm + 1e-6) >= 1, not if norm < max_norm."
                    ]
                say(
                    [
                        *header,
                        f"  expected return value: {take}",
                        f"  your return value:     {result}",
                        *hint,
                    ]
                )
                return False
            if not take:
                for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                    if p.grad is None:
                        say(
                            [
                                *header,
                                f"  After the skip, parameter {i}'s .grad is None.",
                                "  Hint: leave the gradients as they are (or zero them in "
                                "place): code after a skipped step still reads them (logging, "
                                "accumulation, DDP's buckets and flat gradient buffers hold "
                                "views of them), and None is not a gradient.",
                            ]
                        )
                        return False
                    if not (_bitwise_equal(p.grad, g) or not bool(p.grad.count_nonzero())):
                        say(
                            [
                                *header,
                                f"  After the skip, parameter {i}'s gradient is neither the one "
                                "passed in nor zeros.",
                                f"  passed in: {tensor_text(g)}",
                                f"  now:       {tensor_text(p.grad)}",
                            ]
                        )
                        return False
            for i, (rp, p) in enumerate(zip(ref_params, params, strict=True)):
                if not _bitwise_equal(rp.detach(), p.detach()):
                    change = "changed" if not take else "differ from exactly one optimizer.step()"
                    say(
                        [
                            *header,
                            f"  The values of parameter {i} {change}.",
                            f"  expected: {tensor_text(rp)}",
                            f"  yours:    {tensor_text(p)}",
                        ]
                    )
                    return False
            ref_state = _state_tensors(ref_opt, ref_params)
            state = _state_tensors(opt, params)
            if ref_state.keys() != state.keys():
                missing = sorted(set(ref_state) ^ set(state))
                status = "missing" if missing[0] in ref_state else "unexpected"
                say(
                    [
                        *header,
                        f"  The optimizer state differs: {missing[0]} is {status}.",
                    ]
                )
                return False
            for key, ref_value in ref_state.items():
                if not _bitwise_equal(ref_value, state[key]):
                    say(
                        [
                            *header,
                            f"  The optimizer's {key} differs from the reference.",
                            f"  expected: {tensor_text(ref_value)}",
                            f"  yours:    {tensor_text(state[key])}",
                            "  Hint: a skipped step must not call optimizer.step() at all: with "
                            "momentum, weight decay or Adam, even zero gradients move the "
                            "parameters and change the state.",
                        ]
                    )
                    return False
    say([f"All {total_cases} cases pass."])
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
                raise TypeError(f"{name} holds {value_text(v)}")
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


#: The stored runs a threshold rule is scored on, and how the chapter's exercise names them.
_RULE_RUNS = (
    ("seen", 1.0, "the chapter's run (seed 0, 10% corrupted batches)"),
    ("unseen", 1.0, "an unseen run (seed 3, 20% corrupted batches)"),
    (
        "seen",
        64.0,
        "the chapter's run with its loss multiplied by 64 and its learning rate divided "
        "by 64 (the same weights at every step; every norm, the warm-up's too, 64 times "
        "larger)",
    ),
)


def _stored_rule_runs() -> tuple[list[float], dict[str, tuple[list[float], list[float]]]]:
    """The warm-up norms and, per stored run, its (clean, corrupted) norms."""
    from gradlab_book.figures import training  # the stored experiment's reader

    data = training.load_data()
    calibration = data["calibration"]
    k = calibration["warmup_steps"]
    warmup = [float(np.float32(v)) for run in calibration["total_norm"] for v in run[:k]]
    runs = {}
    for name, run in data["threshold_runs"].items():
        norms = [math.inf if v is None else float(np.float32(v)) for v in run["total_norm"]]
        bad = training.bits_from_hex(run["corrupted"], len(norms))
        clean = [n for n, b in zip(norms, bad, strict=True) if not b]
        runs[name] = (clean, [n for n, b in zip(norms, bad, strict=True) if b])
    return warmup, runs


def _score(
    tau: float,
    clean: list[float],
    outliers: list[float],
    keep_fraction: float,
    catch_fraction: float,
) -> tuple[bool, list[str]]:
    """Whether ``tau`` meets both rules on one run, and the lines that say so."""

    def kept(norm: float) -> bool:
        return not math.isnan(norm) and tau / (norm + EPS) >= 1.0

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
        f"Threshold {num(tau)}: keeps {kept_clean} of {len(clean)} clean steps "
        f"({100 * share:.1f}%; at least {needed}, {100 * keep_fraction:.3g}%, required) and "
        f"ignores {caught} of {len(outliers)} outlier steps ({rule})."
    ]
    ok = True
    if kept_clean < needed:
        ok = False
        shown = ", ".join(num(n) for n in dropped_clean[:5])
        more = f" and {len(dropped_clean) - 5} more" if len(dropped_clean) > 5 else ""
        lines.append(f"  Too low: it ignores clean steps with norms {shown}{more}.")
    if caught < to_catch:
        ok = False
        shown = ", ".join(num(n) for n in leaked[:5])
        more = f" and {len(leaked) - 5} more" if len(leaked) > 5 else ""
        lines.append(f"  Too high: it keeps outlier steps with norms {shown}{more}.")
    if not ok:
        # the threshold must keep the `needed`-th smallest clean norm and stay below the
        # `to_catch`-th largest outlier norm (NaN: ignored by every threshold)
        ranked = sorted(n for n in clean if not math.isnan(n))
        catchable = sorted((n for n in outliers if not math.isnan(n)), reverse=True)
        nan_outliers = len(outliers) - len(catchable)
        must_catch = to_catch - nan_outliers
        lowest = catchable[must_catch - 1] if 0 < must_catch <= len(catchable) else INF
        if needed > len(ranked) or (needed > 0 and ranked[needed - 1] >= lowest):
            lines.append(
                "  No threshold can meet both rules on these numbers: the smallest outlier is "
                "below the norm needed to keep enough clean steps."
            )
    return ok, lines


def _tau_or_reason(threshold: object) -> tuple[float | None, str]:
    """``threshold`` as a non-negative float, or None and the sentence that says why not."""
    threshold = _threshold_number(threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
        if isinstance(threshold, Tensor) and threshold.numel() == 1:
            got = f"a 0-dim {str(threshold.dtype).removeprefix('torch.')} tensor"
        else:
            got = value_text(threshold)
        return None, f"The threshold must be a real number, got {got}."
    tau = float(threshold)
    if math.isnan(tau) or tau < 0:
        return None, f"The threshold must be a non-negative number, got {num(tau)}."
    return tau, ""


def _check_fractions(keep_fraction: object, catch_fraction: object) -> bool:
    for name, fraction in (("keep_fraction", keep_fraction), ("catch_fraction", catch_fraction)):
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, numbers.Real)
            or not 0.0 <= float(fraction) <= 1.0
        ):
            say([f"{name} must be a number from 0 to 1, got {value_text(fraction)}."])
            return False
    return True


def _check_rule(rule: object, keep_fraction: float, catch_fraction: float) -> bool:
    """The chapter's exercise: a rule of the warm-up norms, scored on three stored runs."""
    if not callable(rule):
        say(
            [
                f"Expected your rule, a function of warmup_norms, got {value_text(rule)}.",
                "  A number typed in, or computed once from the warm-up you saw, cannot be "
                "scored on a run it has not seen. Write",
                "      def choose_threshold(warmup_norms):",
                "          return ...  # computed from warmup_norms",
                "  and pass choose_threshold itself: check_threshold_choice(choose_threshold).",
            ]
        )
        return False
    warmup, runs = _stored_rule_runs()
    ok, taus = True, []
    for name, units, label in _RULE_RUNS:
        given = [units * n for n in warmup]  # exact: a power of two
        try:
            threshold = call(rule, "choose_threshold(warmup_norms)", list(given))
        except Raised as raised:
            say([f"On {label}:", *indented(raised.lines)])
            return False
        tau, reason = _tau_or_reason(threshold)
        if tau is None:
            say([f"On {label}:", f"  {reason}"])
            return False
        taus.append(tau)
        clean, bad = runs[name]
        passed, lines = _score(
            tau, [units * n for n in clean], [units * n for n in bad], keep_fraction, catch_fraction
        )
        say([f"On {label}:", *indented(lines)])
        ok = ok and passed
    if taus[2] == taus[0]:
        ok = False
        say(
            [
                "Your rule returned the same threshold for warm-ups 64 times apart: a "
                "threshold is in the units of the norm, so compute it from warmup_norms "
                "(a percentile, a multiple of the median, ...), don't type it in."
            ]
        )
    say(["Passed." if ok else "Not passed."])
    return ok


def check_threshold_choice(
    threshold: object,
    clean_norms: Sequence[float] | Tensor | None = None,
    outlier_norms: Sequence[float] | Tensor | None = None,
    *,
    keep_fraction: float | None = None,
    catch_fraction: float | None = None,
) -> bool:
    """Check a ``max_norm`` for ignore-by-norm: a rule of the warm-up norms, or a number.

    **The chapter's exercise**, ``check_threshold_choice(choose_threshold)``: the answer
    is a rule, a function of ``warmup_norms`` (the total norms of the first 20 steps of
    the three clean calibration runs that ``experiments/clip_vs_ignore_grid.py``
    stored), that returns a threshold. It is scored on three stored runs whose labels
    only the check sees: the chapter's run (seed 0, 10% corrupted batches), an unseen
    run (seed 3, 20%), and the chapter's run in other units (the loss multiplied by 64
    and the learning rate divided by 64: the same weights at every step, every norm 64
    times larger, the warm-up's too). It passes when, on all three, its threshold
    keeps at least ``keep_fraction`` (default 95%) of the clean steps and ignores at
    least ``catch_fraction`` (default 90%) of the corrupted ones. No number passes: a
    bare number is refused with the reason, and a rule that returns the same number
    whatever the warm-up fails in the other units. The rule gets a fresh list each
    time, so one that sorts its argument in place changes nothing.

    **A number on a recorded run**, ``check_threshold_choice(threshold, clean_norms,
    outlier_norms)``: ``clean_norms`` are the total gradient norms of the run's ordinary
    batches, ``outlier_norms`` those of the batches known to be bad (they may be inf or
    NaN; a NaN clean norm counts as a clean step that every threshold ignores). The
    threshold passes when it keeps at least ``keep_fraction`` (default 99%) of the
    clean steps and ignores at least ``catch_fraction`` (default all) of the outliers.

    In both, a step is kept exactly when ``grad_ignore_norm_`` would keep it:
    ``threshold / (norm + 1e-6) >= 1`` (and the norm is not NaN). The norms may be lists
    of numbers or of 0-dim tensors, or tensors of any shape. A threshold may be a Python
    or NumPy number, or a 0-dim (or one-element) real tensor such as
    ``torch.quantile(norms, 0.99)``; a bool, a bool or complex tensor, or a tensor of
    several numbers is rejected, as is a negative or NaN one. Both fractions must lie
    in [0, 1]. The verdict lists how many steps a threshold keeps and which steps
    break a rule.
    """
    by_rule = clean_norms is None and outlier_norms is None
    if keep_fraction is None:
        keep_fraction = 0.95 if by_rule else 0.99
    if catch_fraction is None:
        catch_fraction = 0.9 if by_rule else 1.0
    if not _check_fractions(keep_fraction, catch_fraction):
        return False
    if by_rule:
        return _check_rule(threshold, float(keep_fraction), float(catch_fraction))
    try:
        clean = _floats(clean_norms, "clean_norms")
        outliers = _floats(outlier_norms, "outlier_norms")
    except (TypeError, ValueError):
        say(["clean_norms and outlier_norms must be sequences of numbers."])
        return False
    tau, reason = _tau_or_reason(threshold)
    if tau is None:
        say([reason])
        return False
    ok, lines = _score(tau, clean, outliers, float(keep_fraction), float(catch_fraction))
    say([*lines, "Passed." if ok else "Not passed."])
    return ok
