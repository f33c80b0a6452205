"""The chapter 8 figures: drift of a zeroed step vs a true skip, host-read counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from gradlab.sync import HostReadCounter
from gradlab_book.figures import skipping
from gradlab_book.plots import png_bytes


@pytest.mark.parametrize("optimizer", sorted(skipping.OPTIMIZERS))
@pytest.mark.parametrize("beta", [0.0, 0.9])
def test_true_skip_has_zero_drift_and_zeroing_does_not(optimizer, beta):
    data = skipping.drift_after_bad_batch(optimizer, beta, steps=8)
    assert data.clean_ignored == 0
    assert data.bad_norm > 10 * data.threshold > 10 * data.clean_norm_max
    assert data.steps.tolist() == list(range(9))
    assert np.all(data.skipped == 0.0)
    assert np.all(np.isfinite(data.zeroed))
    if optimizer == "adamw" and beta == 0.0:
        # beta1 = 0: the zeroed step only decays the weights, (1 - lr * wd) theta ...
        assert data.zeroed[0] > 0
    assert data.zeroed[1:].max() > 1e-4  # ... but the trajectories part afterwards
    if optimizer == "sgd":
        assert data.zeroed_step_count is None
    else:
        assert data.zeroed_step_count == data.reference_step_count + 1


def test_zeroed_sgd_step_is_momentum_and_decay():
    """The zeroed SGD step moves theta by lr * (mu * b + wd * theta) exactly: check the size."""
    data = skipping.drift_after_bad_batch("sgd", 0.0, steps=0, weight_decay=0.0)
    # Plain SGD without momentum or weight decay: zeroing IS skipping.
    assert data.zeroed.tolist() == [0.0]
    data = skipping.drift_after_bad_batch("sgd", 0.5, steps=0, weight_decay=0.0)
    assert data.zeroed[0] > 0


def test_drift_arguments_are_checked():
    with pytest.raises(ValueError, match="name"):
        skipping.make_optimizer("rmsprop", [torch.zeros(1, requires_grad=True)])
    with pytest.raises(ValueError, match="beta"):
        skipping.make_optimizer("adam", [torch.zeros(1, requires_grad=True)], beta=1.0)
    with pytest.raises(ValueError, match="steps"):
        skipping.drift_after_bad_batch("adam", 0.9, steps=-1)


def test_the_zeroed_adam_step_matches_the_formula():
    """One Adam step with a zero gradient, computed by hand, equals torch's step."""
    torch.manual_seed(0)
    theta = torch.randn(5, requires_grad=True)
    opt = skipping.make_optimizer("adam", [theta], beta=0.9, weight_decay=0.0)
    theta.grad = torch.randn(5)
    opt.step()
    m, v, t = (opt.state[theta][k].clone() for k in ("exp_avg", "exp_avg_sq", "step"))
    before = theta.detach().clone()
    theta.grad = torch.zeros(5)
    opt.step()
    m, v, t = 0.9 * m, 0.999 * v, t + 1
    update = 0.01 * (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8)
    torch.testing.assert_close(theta.detach(), before - update)
    assert not torch.equal(theta.detach(), before)


@pytest.mark.parametrize("sync, expected", [(True, [1] * 6), (False, [1, 0, 0, 0, 0, 0])])
def test_host_reads(sync, expected):
    counts, decisions = skipping.host_reads_per_step(sync)
    assert counts == expected
    assert decisions == ["kept", "kept", "skipped", "kept", "skipped", "kept"]


def test_host_read_counter_counts_item():
    with HostReadCounter() as counter:
        torch.ones(()).item()
        bool(torch.ones(()) > 0)
        torch.ones(3) * 2
    assert counter.count == 2


@pytest.mark.parametrize("optimizer", sorted(skipping.OPTIMIZERS))
@pytest.mark.parametrize("beta", [0.0, 0.9])
@pytest.mark.parametrize("steps", [0, 10])
def test_figures_render_at_the_extremes(optimizer, beta, steps):
    fig = skipping.drift_figure(optimizer, beta, steps)
    assert isinstance(fig, Figure)
    assert png_bytes(fig)[:4] == b"\x89PNG"


def test_comparison_figure_renders():
    fig = skipping.drift_comparison_figure(0.9, steps=5)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    # per optimizer: the zeroed run and the scale, one more clean batch; then the skip
    assert len(labels) == 2 * len(skipping.OPTIMIZERS) + 1
    assert sum("one more clean batch" in t for t in labels) == len(skipping.OPTIMIZERS)
    assert png_bytes(fig)[:4] == b"\x89PNG"


def test_host_read_table_per_optimizer():
    # the optimizer's own reads of its CPU step counters, k = 4 parameters
    table = skipping.host_read_table(steps=4, bad_at=(2,))
    assert table["SGD, momentum 0.9"]["own"] == [0, 0, 0, 0]
    assert table["Adam (default)"]["own"] == [4, 4, 4, 4]
    assert table["Adam (default)"]["sync=True"] == [5, 5, 1, 5]
    assert table["Adam (default)"]["sync=False"] == [5, 4, 4, 4]
    for fused in ("Adam, fused=True", "AdamW, fused=True"):
        assert table[fused]["own"] == [0, 0, 0, 0]
        assert table[fused]["sync=True"] == [1, 1, 1, 1]
        assert table[fused]["sync=False"] == [1, 0, 0, 0]
    assert table["Adam (default)"]["decisions"] == ["kept", "kept", "skipped", "kept"]
    text = skipping.format_host_read_table(table)
    assert "Adam (default)" in text and max(len(line) for line in text.splitlines()) <= 80
