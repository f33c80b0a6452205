"""The self-checks of Part III: an exact skip in a training step, and a threshold choice.

``check_guarded_step`` (chapter "Ignoring a step correctly") and
``check_threshold_choice`` (chapter "Clip versus ignore in training"), built from
:mod:`gradlab_book.exercise_kit` like every check.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from gradlab_book.exercise_kit import (
    EPS,
    INF,
    NAN,
    answer,
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
            if poison:
                grads[0].view(-1)[0] = NAN if poison == "nan" else INF
            for p, g in zip(ref_params, grads, strict=True):
                p.grad = g.clone()
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            total = norm64(grads, 2.0)
            take = bool(torch.isfinite(total)) and bool(max_norm / (total + EPS) >= 1.0)
            if take:
                ref_opt.step()
            what = {
                "": f"gradient norm {num(float(total))}",
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
            ok, result, _ = answer(fn, call_text, header, [], arg, opt, max_norm, watch_host=False)
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
                say(
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
            say([f"{name} must be a number from 0 to 1, got {value_text(fraction)}."])
            return False
    try:
        clean = _floats(clean_norms, "clean_norms")
        outliers = _floats(outlier_norms, "outlier_norms")
    except (TypeError, ValueError):
        say(["clean_norms and outlier_norms must be sequences of numbers."])
        return False
    threshold = _threshold_number(threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
        if isinstance(threshold, Tensor) and threshold.numel() == 1:
            got = f"a 0-dim {str(threshold.dtype).removeprefix('torch.')} tensor"
        else:
            got = value_text(threshold)
        say([f"The threshold must be a real number, got {got}."])
        return False
    tau = float(threshold)
    if math.isnan(tau) or tau < 0:
        say([f"The threshold must be a non-negative number, got {num(tau)}."])
        return False

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
        lines.append("Not passed.")
    else:
        lines.append("Passed.")
    say(lines)
    return ok
