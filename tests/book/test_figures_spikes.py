"""The loss-spike chapter's computations: spike detection, Adam after a spike, figures.

Adam's response is checked three ways: the float64 recursion against its closed form,
and torch.optim.AdamW on a tiny problem against the recursion. The stored table is
recomputed from the stored runs.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from gradlab_book.figures import spikes


def test_spike_starts_by_hand():
    flat = [2.0] * 60
    assert spikes.spike_starts(flat, window=50, ratio=1.25) == []
    one = flat.copy()
    one[55] = 2.51  # 2.51 > 1.25 * 2 = 2.5
    assert spikes.spike_starts(one, window=50, ratio=1.25) == [55]
    one[55] = 2.5  # not strictly above
    assert spikes.spike_starts(one, window=50, ratio=1.25) == []


def test_spike_starts_refractory_and_non_finite():
    losses = [1.0] * 200
    losses[60] = losses[70] = 2.0  # 70 is within 50 steps of 60: one spike
    losses[150] = None  # a non-finite loss always starts one
    assert spikes.spike_starts(losses, window=50, ratio=1.25) == [60, 150]
    assert spikes.spike_starts(losses, window=5, ratio=1.25) == [60, 70, 150]
    assert spikes.spike_starts(losses[:40], window=50) == []  # shorter than the window


def test_spike_starts_uses_the_median_of_the_window():
    losses = [1.0] * 30 + [10.0] * 20 + [1.3]  # median of the last 50 is 1.0
    assert spikes.spike_starts(losses, window=50, ratio=1.25) == [50]


def test_stale_from():
    assert spikes.stale_from("k" * 10 + "s" * 100) == 10
    assert spikes.stale_from("k" * 10 + "s" * 99) is None
    assert spikes.stale_from("s" * 100 + "k") is None
    assert spikes.stale_from("kcs" * 50, min_length=1) == 149


def test_moving_average_matches_numpy():
    x = np.arange(20, dtype=float) ** 1.5
    got = spikes.moving_average(list(x), 4)
    full = np.convolve(x, np.ones(4) / 4, mode="valid")
    assert np.allclose(got[3:], full)
    assert got[0] == x[0] and np.isclose(got[1], x[:2].mean())
    assert np.isnan(spikes.moving_average([1.0, None, 3.0], 2)[1])


@pytest.mark.parametrize(("ratio", "beta2"), [(100.0, 0.999), (10.0, 0.99), (3.0, 0.9)])
def test_the_recursion_is_its_closed_form(ratio, beta2):
    rec = spikes.adam_after_spike(ratio, 3000, 0.9, beta2)
    t = np.arange(3000)
    assert np.allclose(rec["step"], spikes.suppression(ratio, t, 0.9, beta2), rtol=1e-12)
    assert np.allclose(rec["v"] - 1, (1 - beta2) * (ratio**2 - 1) * beta2**t, rtol=1e-9)
    assert np.allclose(rec["m"] - 1, 0.1 * (ratio - 1) * 0.9**t, rtol=1e-9, atol=1e-12)


def test_torch_adamw_follows_the_recursion():
    torch.set_num_threads(1)
    moves = spikes.adamw_after_spike(100.0, 400)
    rec = spikes.adam_after_spike(100.0, 400)
    assert np.allclose(moves["spiked"], rec["step"], rtol=1e-9)
    assert np.allclose(moves["control"], 1.0, rtol=1e-9)
    # the spike's own step is large, then the step is suppressed for hundreds of steps
    assert moves["spiked"][0] > 3 and moves["spiked"][100] < 0.35 and moves["spiked"][399] < 0.4


def test_recovery_steps_solves_the_closed_form():
    for ratio, level, beta2 in [(100.0, 0.5, 0.999), (30.0, 0.8, 0.99)]:
        t = spikes.recovery_steps(ratio, level, beta2)
        v = 1 + (1 - beta2) * (ratio**2 - 1) * beta2**t
        assert math.isclose(1 / math.sqrt(v), level, rel_tol=1e-12)
    assert spikes.recovery_steps(2.0, 0.5) == 0.0
    assert math.isclose(-1 / math.log(0.999), 999.5, rel_tol=1e-4)  # the time constant


@pytest.fixture(scope="module")
def data():
    return spikes.load_runs()


@pytest.fixture(scope="module")
def rows():
    return spikes.load_table()


def test_the_table_is_recomputed_from_the_runs(data, rows):
    rule = data["spike_rule"]
    assert len(rows) == len(data["runs"]) == len(data["methods"]) * len(data["seeds"])
    for row in rows:
        run = spikes.run_of(data, row["method"], row["seed"])
        assert row["spikes"] == len(spikes.spike_starts(run["loss"], rule["window"], rule["ratio"]))
        assert row["clipped"] == run["decision"].count("c")
        assert row["skipped"] == run["decision"].count("s")
        assert row["held_out_loss"] == run["eval_loss"][-1]
        tail = [v for v in run["loss"][-data["setup"]["eval_every"] :] if v is not None]
        assert math.isclose(row["final_train_loss"], sum(tail) / len(tail), abs_tol=6e-5)
        if row["method"] in ("none", "clip", "zclip", "autoclip"):
            assert row["skipped"] == 0
        if row["method"] in ("none", "skip", "sigmaskip"):
            assert row["clipped"] == 0


def test_summary_and_lines(data, rows):
    summary = spikes.method_summary(rows, data["methods"])
    assert [s["method"] for s in summary] == data["methods"]
    assert sum(s["skipped"] for s in summary) == sum(r["skipped"] for r in rows)
    lines = spikes.table_lines(rows, data["labels"])
    assert len(lines) == len(rows) + 1 and all(len(line) <= 80 for line in lines)
    costs = spikes.load_costs()
    assert list(costs["methods"]) == data["methods"]
    assert {"platform", "processor", "cpu_count", "torch"} <= set(costs["machine"])
    assert len(spikes.costs_lines(costs, data["labels"])) == len(data["methods"]) + 1
    with pytest.raises(KeyError):
        spikes.run_of(data, "none", 12345)


def test_the_figures_draw(data, rows):
    figs = [
        spikes.adam_figure(100.0, 0.999, 500),
        spikes.adam_figure(1000.0, 0.95, 3000),  # the explorable's smallest beta2
        spikes.run_figure(data, "skip", data["seeds"][0]),
        spikes.run_figure(data, "none", data["seeds"][-1]),
        spikes.summary_figure(rows, data["methods"], data["labels"]),
        spikes.summary_figure(rows, data["methods"], data["labels"], reference=[1.9, 2.0]),
        spikes.costs_figure(spikes.load_costs(), data["labels"]),
    ]
    assert all(isinstance(f, Figure) for f in figs)


def test_the_runs_are_joined_from_their_files(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"runs": [1, 2], "more_files": ["b.json"]}))
    (tmp_path / "b.json").write_text(json.dumps({"runs": [3]}))
    assert spikes.load_runs(tmp_path / "a.json")["runs"] == [1, 2, 3]
    whole = spikes.load_runs()
    assert whole["more_files"] == ["spikes_runs_2.json"]
    assert len(whole["runs"]) == len(whole["methods"]) * len(whole["seeds"])
