"""The benchmark harness: what it builds and what its baselines compute (no timings)."""

import math

import pytest
import torch
from clip_helpers import assert_all_plus_zero, assert_grads_unchanged, math_norm, snapshot

import gradlab
from gradlab.sync import HostReadError, no_host_reads
from gradlab_book.benchmark import (
    DEFAULT_CASES,
    Case,
    benchmark_table,
    floor_norm,
    format_table,
    loop_ignore_norm_,
    loop_ignore_value_,
    make_parameters,
    time_call,
    time_calls,
)


def test_make_parameters_sizes_and_seed():
    params = make_parameters(7, 100, seed=3)
    sizes = [p.numel() for p in params]
    assert sum(sizes) == 100 and max(sizes) - min(sizes) <= 1
    assert all(p.dtype == torch.float32 and p.grad.shape == p.shape for p in params)
    again = make_parameters(7, 100, seed=3)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(params, again, strict=True))
    other = make_parameters(7, 100, seed=4)
    assert not torch.equal(params[0].grad, other[0].grad)
    with pytest.raises(ValueError):
        make_parameters(0, 10)


def test_default_cases_are_the_documented_ones():
    assert [(c.n_tensors, c.n_elements) for c in DEFAULT_CASES] == [
        (10, 10_000_000),
        (300, 10_000_000),
        (3000, 10_000_000),
        (3000, 300_000),
    ]


def test_time_call_runs_warmup_and_repeats():
    calls = []
    seconds = time_call(lambda: calls.append(1), repeats=5, warmup=2)
    assert len(calls) == 7
    assert seconds >= 0.0
    with pytest.raises(ValueError):
        time_call(lambda: None, repeats=0)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_loop_ignore_norm_agrees_with_gradlab_on_finite_gradients(norm_type, factor):
    loop_params = make_parameters(5, 40, seed=1)
    ours = make_parameters(5, 40, seed=1)
    max_norm = factor * math_norm([p.grad for p in ours], norm_type)
    total_loop = loop_ignore_norm_(loop_params, max_norm, norm_type)
    total_ours = gradlab.grad_ignore_norm_(ours, max_norm, norm_type)
    assert math.isclose(float(total_loop), float(total_ours), rel_tol=1e-6)
    for a, b in zip(loop_params, ours, strict=True):
        assert torch.equal(a.grad, b.grad)


def test_loop_ignore_value_agrees_with_gradlab_on_finite_gradients():
    for clip_value in (0.1, 100.0):
        loop_params = make_parameters(5, 40, seed=2)
        ours = make_parameters(5, 40, seed=2)
        loop_ignore_value_(loop_params, clip_value)
        gradlab.grad_ignore_value_(ours, clip_value)
        for a, b in zip(loop_params, ours, strict=True):
            assert torch.equal(a.grad, b.grad)


def test_the_loop_keeps_its_known_defects():
    # What gradlab fixes: the loop lets a NaN gradient through, and fails on [].
    params = make_parameters(3, 30, seed=5)
    params[1].grad[2] = math.nan
    before = snapshot(params)
    loop_ignore_norm_(params, 1.0)
    assert_grads_unchanged(params, before)  # NaN < 1 is False: nothing ignored
    gradlab.grad_ignore_norm_(params, 1.0)
    assert_all_plus_zero(params)
    with pytest.raises(IndexError):
        loop_ignore_norm_([], 1.0)


def test_floor_norm_is_the_norm_of_the_flat_tensor():
    flat = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert math.isclose(float(floor_norm(flat)), math_norm([flat], 2.0), rel_tol=1e-6)
    assert float(floor_norm(flat, math.inf)) == float(flat.abs().max())


def test_benchmark_table_rows_and_format():
    rows = benchmark_table([Case("tiny", 4, 64)], repeats=1, warmup=0)
    (row,) = rows
    assert row["case"] == "tiny" and row["n_tensors"] == 4 and row["device"] == "cpu"
    for key in (
        "get_total_norm",
        "clip_grad_norm_",
        "grad_ignore_norm_",
        "clip_grad_value_",
        "grad_ignore_value_",
        "torch_clip_grad_norm_",
        "torch_clip_grad_value_",
        "loop_ignore_norm_",
        "loop_ignore_value_",
        "floor",
    ):
        assert isinstance(row[key], float) and row[key] >= 0.0
    assert row["grad_ignore_norm_/torch"] == row["grad_ignore_norm_"] / row["torch_clip_grad_norm_"]
    assert row["get_total_norm/floor"] == row["get_total_norm"] / row["floor"]
    text = format_table(rows, ["case", "floor"])
    lines = text.splitlines()
    assert len(lines) == 3 and lines[0].split() == ["case", "floor"] and "tiny" in lines[2]
    assert format_table([]) == ""


def test_time_calls_interleaves():
    order = []
    medians = time_calls(
        {"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=3, warmup=1
    )
    assert set(medians) == {"a", "b"} and all(v >= 0.0 for v in medians.values())
    warmup, rounds = order[:2], order[2:]
    assert warmup == ["a", "b"]
    assert len(rounds) == 6
    assert all(sorted(rounds[i : i + 2]) == ["a", "b"] for i in range(0, 6, 2)), (
        "every round runs each callable once"
    )


def test_statistic_choice():
    assert time_call(lambda: None, repeats=3, warmup=0, statistic="min") >= 0.0
    with pytest.raises(ValueError, match="statistic"):
        time_call(lambda: None, statistic="mean")
    with pytest.raises(ValueError, match="statistic"):
        benchmark_table([Case("tiny", 2, 8)], statistic="mean")


def test_time_calls_varies_the_order_between_rounds():
    order = []
    calls = {name: (lambda name=name: order.append(name)) for name in "abcde"}
    time_calls(calls, repeats=6, warmup=0)
    rounds = ["".join(order[i : i + 5]) for i in range(0, 30, 5)]
    assert all(sorted(r) == list("abcde") for r in rounds)
    assert len(set(rounds)) > 1, "no callable always follows the same neighbour"


@pytest.mark.parametrize("loop", [loop_ignore_norm_, loop_ignore_value_])
def test_the_reference_loop_algorithm_syncs(loop):
    # The per-tensor loop of the reference text branches on a tensor in Python.
    params = make_parameters(3, 4, seed=0)
    with pytest.raises(HostReadError), no_host_reads():
        loop(params, 1.0)
