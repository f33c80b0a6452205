"""Tests of gradlab_book.figures.costs (chapter 9): exact counts, the cost model, figures."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

import gradlab
from gradlab_book.benchmark import loop_ignore_norm_, loop_ignore_value_, make_parameters
from gradlab_book.figures import costs
from gradlab_book.plots import png_bytes

# --------------------------------------------------------------------------- counts


def test_count_ops_sees_operators_and_host_reads():
    t = torch.ones(5)
    count = costs.count_ops(lambda: torch.linalg.vector_norm(t))
    assert (count.ops, count.host_reads, count.tensor_visits) == (1, 0, 1)
    count = costs.count_ops(lambda: torch.linalg.vector_norm(t).item())
    assert (count.ops, count.host_reads) == (2, 1)
    assert count.by_op["_local_scalar_dense.default"] == 1
    count = costs.count_ops(lambda: torch._foreach_norm([t, t, t]))
    assert (count.ops, count.tensor_visits) == (1, 3)
    assert costs.count_ops(lambda: None).ops == 0


@pytest.mark.parametrize("k", [1, 7])
def test_reference_loops_read_the_host(k):
    params = make_parameters(k, 10 * k)
    assert costs.count_ops(lambda: loop_ignore_norm_(params, 1e30)).host_reads == 1
    assert costs.count_ops(lambda: loop_ignore_value_(params, 1e30)).host_reads == k
    # a value that trips the first tensor stops the loop after one read
    params[0].grad[0] = 1e6
    assert costs.count_ops(lambda: loop_ignore_value_(params, 10.0)).host_reads == 1


def test_library_functions_make_no_host_read():
    params = make_parameters(5, 50)
    for name, fn in costs.IMPLEMENTATIONS.items():
        if not name.startswith("reference"):
            assert costs.count_ops(lambda fn=fn: fn(params)).host_reads == 0, name
    nan_params = make_parameters(3, 9)
    nan_params[1].grad[0] = math.nan
    assert costs.count_ops(lambda: gradlab.grad_ignore_norm_(nan_params, 1.0)).host_reads == 0
    assert all(torch.isfinite(p.grad).all() for p in nan_params)


def test_count_table_operator_formulas():
    sizes = [1, 4, 16]
    table = costs.count_table(sizes, 64)
    assert set(table) == set(costs.IMPLEMENTATIONS)
    assert [c.ops for c in table["reference loop, ignore norm"]] == [2 * k + 7 for k in sizes]
    assert [c.ops for c in table["torch clip norm, foreach=True"]] == [8, 8, 8]
    assert [c.ops for c in table["gradlab clip norm, foreach=True"]] == [8, 8, 8]


# --------------------------------------------------------------------- timings, model


def test_time_sweep_tiny():
    sweep = costs.time_sweep([1, 4], 64, repeats=1, warmup=0)
    assert list(sweep.n_tensors) == [1, 4] and sweep.n_elements == 64
    assert costs.FLOOR in sweep.times and set(costs.IMPLEMENTATIONS) <= set(sweep.times)
    for times in sweep.times.values():
        assert times.shape == (2,) and np.all(times > 0) and np.all(np.isfinite(times))
    assert all(len(v) == 2 for v in sweep.counts.values())


def _synthetic_sweep(c_op: float, c_tensor: float, per_byte: float) -> costs.Sweep:
    sizes = [1, 10, 100, 1000]
    counts = costs.count_table(sizes, 1000)
    counts[costs.FLOOR] = [costs.OpCount(ops=1, tensor_visits=1) for _ in sizes]
    sweep = costs.Sweep(np.array(sizes), 1000, {}, counts)
    model = costs.CostModel(c_op, c_tensor, per_byte)
    sweep.times = {name: np.ones(len(sizes)) for name in counts}
    sweep.times = {name: costs.predict(model, sweep, name) for name in counts}
    return sweep


def test_fit_recovers_known_constants():
    sweep = _synthetic_sweep(2e-6, 5e-7, 1e-10)
    model = costs.fit_cost_model(sweep)
    for name in sweep.times:
        np.testing.assert_allclose(costs.predict(model, sweep, name), sweep.times[name], rtol=0.05)
    assert model.bandwidth == pytest.approx(1e10, rel=0.1)


def test_fit_with_no_usable_time_is_zero():
    sweep = _synthetic_sweep(0.0, 0.0, 0.0)
    model = costs.fit_cost_model(sweep)
    assert (model.c_op, model.c_tensor, model.seconds_per_byte) == (0.0, 0.0, 0.0)
    assert math.isinf(model.bandwidth)


# ----------------------------------------------------------------------- figures


def _render(fig: Figure) -> None:
    assert isinstance(fig, Figure)
    assert png_bytes(fig).startswith(b"\x89PNG")


def test_figures_render_including_degenerate_times():
    sweep = _synthetic_sweep(2e-6, 5e-7, 1e-10)
    model = costs.fit_cost_model(sweep)
    for n in [1, 1000, 3]:  # 3 was not measured: the figure says so
        _render(costs.sweep_figure(n, sweep))
    _render(costs.overhead_figure(sweep))
    _render(costs.foreach_figure(sweep))
    _render(costs.model_check_figure(sweep, model))
    # zero and NaN timings: no exception
    broken = _synthetic_sweep(0.0, 0.0, 0.0)
    broken.times[costs.FLOOR] = np.array([0.0, math.nan, 1e-3, 1e-3])
    _render(costs.sweep_figure(1, broken))
    _render(costs.overhead_figure(broken))
    _render(costs.foreach_figure(broken))
    _render(costs.model_check_figure(broken, costs.CostModel(0.0, 0.0, 0.0)))


def test_fit_by_kind_recovers_two_prices_and_reports_the_floor_bias():
    # reductions twice as expensive per byte as elementwise passes
    sizes = [1, 10, 100, 1000]
    counts = costs.count_table(sizes, 1000)
    counts[costs.FLOOR] = [costs.OpCount(ops=1, tensor_visits=1) for _ in sizes]
    sweep = costs.Sweep(np.array(sizes), 1000, {}, counts)
    truth = costs.CostModel(2e-6, 5e-7, 2e-10, 1e-10)
    sweep.times = {name: costs.predict(truth, sweep, name) for name in counts}
    fitted = costs.fit_cost_model(sweep, by_kind=True)
    for name in sweep.times:
        np.testing.assert_allclose(costs.predict(fitted, sweep, name), sweep.times[name], rtol=0.05)
    assert fitted.elementwise_bandwidth == pytest.approx(1e10, rel=0.1)
    one = costs.fit_cost_model(sweep)
    assert one.elementwise_bandwidth is None
    report = costs.fit_report(sweep, {"one": one, "by kind": fitted})
    assert "bandwidth implied by the floor" in report and "elementwise" in report
    bias = float(np.median(costs.predict(fitted, sweep, costs.FLOOR) / sweep.times[costs.FLOOR]))
    assert bias == pytest.approx(1.0, rel=0.05)


def test_ratio_table_and_sync_free_cost():
    sweep = _synthetic_sweep(2e-6, 5e-7, 1e-10)
    text = costs.ratio_table(sweep)
    assert text.splitlines()[0].startswith("time / floor")
    assert "at 1 tensor(s):" in text and max(len(line) for line in text.splitlines()) <= 80
    cost = costs.sync_free_cost(sweep)
    loop = sweep.times["reference loop, ignore norm"]
    np.testing.assert_allclose(
        cost["foreach=True"], sweep.times["gradlab ignore norm, foreach=True"] / loop
    )
    assert set(cost) == {"foreach=False", "foreach=True"}
