"""check_global_norm passes a correct answer and names the first wrong case of others."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from verdicts import assert_fails, assert_passes

import gradlab
from gradlab_book.exercises_distributed import (
    check_accumulate_fp16,
    check_global_norm,
    check_parallel_norm,
    expected_global_norm,
    expected_parallel_norm,
)


def _correct(local_norms, p):
    norms = [float(n) for n in local_norms]
    if any(math.isnan(n) for n in norms):
        return math.nan
    m = max(norms)
    if p == math.inf or m == 0 or math.isinf(m):
        return m
    return m * math.fsum((n / m) ** p for n in norms) ** (1 / p)


def _as_tensor(local_norms, p):
    t = torch.tensor(local_norms, dtype=torch.float64)
    if bool(torch.isnan(t).any()):
        return torch.tensor(math.nan)
    m = t.max()
    if p == math.inf or m == 0 or torch.isinf(m):
        return m
    return m * torch.linalg.vector_norm(t / m, p)


def _naive(local_norms, p):
    if p == math.inf:
        return max(local_norms)
    return sum(n**p for n in local_norms) ** (1 / p)


def _no_nan_check(local_norms, p):
    m = max(local_norms)
    if p == math.inf or m == 0 or math.isinf(m):
        return m
    return m * sum((n / m) ** p for n in local_norms) ** (1 / p)


def _sum(local_norms, p):
    return sum(local_norms)


def _mutates(local_norms, p):
    value = _correct(local_norms, p)
    local_norms.append(0.0)
    return value


def _stub(local_norms, p):
    raise NotImplementedError


def _raises(local_norms, p):
    raise ZeroDivisionError("boom")


def test_correct_answers_pass(capsys):
    assert check_global_norm(_correct) is True
    assert check_global_norm(_as_tensor) is True
    assert capsys.readouterr().out.count("cases pass.") == 2


@pytest.mark.parametrize(
    "fn, words",
    [
        (_naive, ["Case 11", "max(3.0, nan)"]),
        (_no_nan_check, ["Case 11", "expected: nan"]),
        (_sum, ["Case 1 ", "p=2"]),
        (_mutates, ["changed local_norms"]),
        (_stub, ["Not implemented"]),
        (_raises, ["ZeroDivisionError", "boom"]),
        (3, ["Expected a function"]),
    ],
)
def test_wrong_answers_fail_with_a_reason(capsys, fn, words):
    assert check_global_norm(fn) is False
    out = capsys.readouterr().out
    for word in words:
        assert word in out, out


def test_an_answer_that_changes_its_input_is_told_so_first(capsys):
    def sorts_in_place(local_norms, p):
        local_norms.sort(reverse=True)  # changes the caller's list, and is wrong too
        return 2 * local_norms[0]

    out = assert_fails(check_global_norm, sorts_in_place, capsys, "changed local_norms")
    assert "expected:" not in out  # a value hint would mislead (issue 21, item 13)


def test_overflow_case_is_reached_by_an_answer_correct_otherwise(capsys):
    def unscaled(local_norms, p):
        if any(math.isnan(n) for n in local_norms):
            return math.nan
        if p == math.inf:
            return max(local_norms)
        return sum(n**p for n in local_norms) ** (1 / p)

    assert check_global_norm(unscaled) is False
    assert "3e200" in capsys.readouterr().out


@pytest.mark.parametrize(
    "norms, p, want",
    [
        ([3.0, 4.0], 2.0, 5.0),
        ([3.0, 4.0], 1.0, 7.0),
        ([3.0, 4.0], math.inf, 4.0),
        ([3e200, 4e200], 2.0, 5e200),
        ([3e-200, 4e-200], 2.0, 5e-200),
        ([0.0, 0.0], 2.0, 0.0),
        ([], 2.0, 0.0),
    ],
)
def test_expected_values(norms, p, want):
    assert expected_global_norm(norms, p) == pytest.approx(want, rel=1e-14)


def test_expected_nonfinite():
    assert math.isnan(expected_global_norm([3.0, math.nan], math.inf))
    assert math.isnan(expected_global_norm([math.inf, math.nan], 2.0))
    assert expected_global_norm([math.inf, 1.0], 2.0) == math.inf


# --------------------------------------------------------------- parallel norm


def _parallel_correct(ranks, p):
    # every entry once: the TP-split pieces of every rank, the copies of TP rank 0
    entries = []
    for r in ranks:
        entries += [t.reshape(-1) for t in r["sharded"]]
        if r["tp"] == 0:
            entries += [t.reshape(-1) for t in r["replicated"]]
    return float(torch.linalg.vector_norm(torch.cat(entries), p))


def _parallel_powers(ranks, p):
    # Megatron-style: per rank, its sharded p-th powers, plus its copies' / TP size
    if p == math.inf:
        return max(
            (float(t.abs().max()) for r in ranks for t in r["sharded"] + r["replicated"]),
            key=lambda v: (math.isnan(v), v),
        )
    tp = max(r["tp"] for r in ranks) + 1
    total = 0.0
    for r in ranks:
        total += sum(float(t.abs().pow(p).sum()) for t in r["sharded"])
        total += sum(float(t.abs().pow(p).sum()) for t in r["replicated"]) / tp
    return total ** (1 / p)


def _parallel_every_copy(ranks, p):
    entries = [t.reshape(-1) for r in ranks for t in r["sharded"] + r["replicated"]]
    return float(torch.linalg.vector_norm(torch.cat(entries), p))


def _parallel_first_stage(ranks, p):
    return _parallel_correct([r for r in ranks if r["pp"] == 0], p)


def _parallel_copies_once(ranks, p):
    # the replicated tensors of one rank only, as if every stage held the same ones
    entries = [t.reshape(-1) for r in ranks for t in r["sharded"]]
    entries += [t.reshape(-1) for t in ranks[0]["replicated"]]
    return float(torch.linalg.vector_norm(torch.cat(entries), p))


def _parallel_by_position(ranks, p):
    # TP rank 0 taken as every TP-th entry of the list (rank r = tp + TP * pp)
    tp = max(r["tp"] for r in ranks) + 1
    entries = []
    for i, r in enumerate(ranks):
        entries += [t.reshape(-1) for t in r["sharded"]]
        if i % tp == 0:
            entries += [t.reshape(-1) for t in r["replicated"]]
    return float(torch.linalg.vector_norm(torch.cat(entries), p))


def _parallel_norms_over_tp(ranks, p):
    # divides the copies' norm (not its p-th power) by the TP size
    tp = max(r["tp"] for r in ranks) + 1
    total = 0.0
    for r in ranks:
        total += sum(float(torch.linalg.vector_norm(t, p)) ** p for t in r["sharded"])
        total += sum((float(torch.linalg.vector_norm(t, p)) / tp) ** p for t in r["replicated"])
    return total ** (1 / p) if p != math.inf else _parallel_correct(ranks, p)


def _parallel_python_max(ranks, p):
    if p == math.inf:
        return max(float(t.abs().max()) for r in ranks for t in r["sharded"] + r["replicated"])
    return _parallel_correct(ranks, p)


def _parallel_mutates(ranks, p):
    value = _parallel_correct(ranks, p)
    ranks[0]["replicated"].clear()
    return value


PARALLEL_CORRECT = [_parallel_correct, _parallel_powers]
PARALLEL_WRONG = [
    (_parallel_every_copy, ["Case 1 of 9", "every copy counted", "count them on"]),
    (_parallel_first_stage, ["Case 2 of 9", "every stage's entries count"]),
    (_parallel_copies_once, ["Case 2 of 9", "expected:"]),
    (_parallel_by_position, ["Case 7 of 9", "out of order", "'tp' entry"]),
    (_parallel_norms_over_tp, ["Case 1 of 9", "expected:"]),
    (_parallel_python_max, ["Case 9 of 9", "NaN", "expected: nan"]),
    (_parallel_mutates, ["changed ranks"]),
]


def test_expected_parallel_norm_counts_each_entry_once():
    w, c = torch.tensor([[3.0], [4.0]], dtype=torch.float64), torch.tensor([12.0])
    ranks = [
        {"tp": 0, "pp": 0, "sharded": [w[:1]], "replicated": [c]},
        {"tp": 1, "pp": 0, "sharded": [w[1:]], "replicated": [c.clone()]},
    ]
    assert expected_parallel_norm(ranks, 2.0) == pytest.approx(13.0)  # 3, 4, 12 once
    assert expected_parallel_norm(ranks, 1.0) == pytest.approx(19.0)


# ------------------------------------------------- accumulation with loss scaling


def _acc_loss(model, x, y, a):
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return nn.functional.mse_loss(out.float(), y) / a


def _accumulate_scaled(model, optimizer, scaler, micro_batches, max_norm, loss_divisor=None):
    # the accumulation every answer below shares (the accumulator holds the scaler and
    # unscales at finish_); the answers differ in how they step. Returns the kept count.
    divisor = len(micro_batches) if loss_divisor is None else loss_divisor
    acc = gradlab.MicroBatchAccumulator(model.parameters(), max_norm, scaler=scaler)
    for x, y in micro_batches:
        scaler.scale(_acc_loss(model, x, y, divisor)).backward()
        acc.add_()
    return acc.finish_(optimizer)


def acc_gradlab(model, optimizer, scaler, micro_batches, max_norm):
    kept = _accumulate_scaled(model, optimizer, scaler, micro_batches, max_norm)
    gradlab.step_if_(optimizer, kept > 0, sync=False)
    scaler.update()
    optimizer.zero_grad()
    return kept


def acc_by_hand(model, optimizer, scaler, micro_batches, max_norm):
    # independent of gradlab: unscale each micro-batch by hand, a plain if to skip,
    # and GradScaler's public update(new_scale=) for the back-off
    params = list(model.parameters())
    a, scale = len(micro_batches), scaler.get_scale()
    kept, overflow = [], False
    for x, y in micro_batches:
        grads = torch.autograd.grad(scaler.scale(_acc_loss(model, x, y, a)), params)
        grads = [g.double() / scale for g in grads]
        norm = float(torch.cat([g.reshape(-1) for g in grads]).norm())
        if not math.isfinite(norm):
            overflow = True
        elif max_norm / (norm + 1e-6) >= 1.0:
            kept.append(grads)
    if kept:
        for p, *gs in zip(params, *kept, strict=True):
            p.grad = (a * sum(gs) / len(kept)).to(p.dtype)  # the kept ones' mean
        optimizer.step()
    if overflow:
        scaler.update(new_scale=scale * scaler.get_backoff_factor())
    optimizer.zero_grad()
    return len(kept)


def acc_old_recipe(model, optimizer, scaler, micro_batches, max_norm):
    # the recipe before the accumulator took a scaler: it tests the scaled gradient
    acc = gradlab.MicroBatchAccumulator(model.parameters(), max_norm)
    for x, y in micro_batches:
        scaler.scale(_acc_loss(model, x, y, len(micro_batches))).backward()
        acc.add_()
    kept = acc.finish_()
    scaler.unscale_(optimizer)
    optimizer.step()
    scaler.update()
    return kept


def acc_optimizer_step(model, optimizer, scaler, micro_batches, max_norm):
    kept = _accumulate_scaled(model, optimizer, scaler, micro_batches, max_norm)
    optimizer.step()  # a zero gradient when none is kept: zeroing, not skipping
    scaler.update()
    return kept


def acc_scaler_step(model, optimizer, scaler, micro_batches, max_norm):
    kept = _accumulate_scaled(model, optimizer, scaler, micro_batches, max_norm)
    scaler.step(optimizer)  # skips on an inf, steps on the zero gradient otherwise
    scaler.update()
    return kept


def acc_no_update(model, optimizer, scaler, micro_batches, max_norm):
    kept = _accumulate_scaled(model, optimizer, scaler, micro_batches, max_norm)
    gradlab.step_if_(optimizer, kept > 0, sync=False)
    return kept


def acc_loss_not_divided(model, optimizer, scaler, micro_batches, max_norm):
    kept = _accumulate_scaled(model, optimizer, scaler, micro_batches, max_norm, loss_divisor=1)
    gradlab.step_if_(optimizer, kept > 0, sync=False)
    scaler.update()
    return kept


FP16_CORRECT = [acc_gradlab, acc_by_hand]
FP16_WRONG = [
    (acc_old_recipe, ["Case 1 of 5", "expected 4 micro-batches kept", "unscaled"]),
    (acc_optimizer_step, ["Case 4 of 5", "the parameters moved", "zeroing is not skipping"]),
    (acc_scaler_step, ["Case 3 of 5", "skipped the step", "3 micro-batches were kept"]),
    (acc_no_update, ["Case 3 of 5", "scale is 4096", "expected 2048"]),
    (acc_loss_not_divided, ["Case 1 of 5", "expected 4 micro-batches kept"]),
]


def test_accumulate_fp16_rejects_a_step_without_the_rescaling(capsys):
    # the accumulator's A / kept left out: the mean of three becomes three quarters of it
    def short(model, optimizer, scaler, micro_batches, max_norm):
        kept = _accumulate_scaled(model, optimizer, scaler, micro_batches, max_norm)
        with torch.no_grad():
            for p in model.parameters():
                p.grad *= kept / len(micro_batches)
        gradlab.step_if_(optimizer, kept > 0, sync=False)
        scaler.update()
        return kept

    assert_fails(check_accumulate_fp16, short, capsys, "Case 2 of 5", "0.75", "A / kept")


# ------------------------------------------------------- verdicts on the tables above


def _case_id(x):
    return getattr(x, "__name__", "")


CORRECT_ANSWERS = [(check_parallel_norm, fn) for fn in PARALLEL_CORRECT] + [
    (check_accumulate_fp16, fn) for fn in FP16_CORRECT
]
WRONG_ANSWERS = [(check_parallel_norm, *case) for case in PARALLEL_WRONG] + [
    (check_accumulate_fp16, *case) for case in FP16_WRONG
]


@pytest.mark.parametrize("check, fn", CORRECT_ANSWERS, ids=_case_id)
def test_accepts_correct_answers(check, fn, capsys):
    assert_passes(check, fn, capsys)


@pytest.mark.parametrize("check, fn, fragments", WRONG_ANSWERS, ids=_case_id)
def test_rejects_wrong_answers(check, fn, fragments, capsys):
    assert_fails(check, fn, capsys, *fragments)
