"""Chapters 5 and 6: the gradient stream, the ignore decisions and their figures.

The decisions are checked against torch.nn.utils and against the rules written out
by hand, never against gradlab itself.
"""

import math

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from gradlab_book.figures import ignoring
from gradlab_book.plots import png_bytes

NORM_GRID = (1.0, 80.0)
MARGIN_GRID = (0.5, 4.0)


@pytest.fixture(scope="module")
def stream():
    return ignoring.minibatch_stream()


def tiny_stream(steps):
    return ignoring.stream_from_gradients(steps)


def rule_keeps(grads, max_norm):
    """The rule written out: keep iff max_norm / (||g||_2 + 1e-6) >= 1, via torch."""
    total = torch.nn.utils.get_total_norm(grads)
    return bool(max_norm / (total + 1e-6) >= 1.0)


def test_stream_is_real_and_cached(stream):
    assert ignoring.minibatch_stream() is stream
    assert stream.steps == 60 and stream.size == 32 * 16 + 16 + 16 + 1
    assert sorted(set(stream.kinds)) == ["clean", "glitch", "labels", "nan"]
    assert stream.kinds.count("glitch") == 4 and stream.kinds.count("nan") == 1
    for step, norm, largest in zip(stream.grads, stream.norms, stream.largest, strict=True):
        expected = float(torch.nn.utils.get_total_norm(step))
        flat = torch.cat([g.flatten() for g in step])
        if math.isnan(expected):
            assert math.isnan(norm) and math.isnan(largest)
        else:
            assert norm == pytest.approx(expected, rel=1e-6)
            assert largest == float(flat.abs().max())
    clean = [n for n, k in zip(stream.norms, stream.kinds, strict=True) if k == "clean"]
    assert stream.reference_norm == max(clean)
    # the corrupted batches stand out; clean ones do not
    assert min(n for n, k in zip(stream.norms, stream.kinds, strict=True) if k == "glitch") > 0


def test_stream_validates_arguments():
    with pytest.raises(ValueError):
        ignoring.minibatch_stream(steps=3, glitches=4)
    with pytest.raises(ValueError):
        ignoring.minibatch_stream(steps=-1)
    with pytest.raises(ValueError):
        ignoring.stream_from_gradients([[torch.ones(2)]], kinds=["bad"])
    with pytest.raises(ValueError):
        ignoring.stream_from_gradients([[torch.ones(2)]], kinds=["clean", "clean"])


@pytest.mark.parametrize("max_norm", [0.0, *NORM_GRID, math.inf])
def test_norm_decisions_match_torch(stream, max_norm):
    d = ignoring.norm_decisions(stream, max_norm)
    for t, step in enumerate(stream.grads):
        keep = rule_keeps(step, max_norm)
        assert d.kept[t] == keep
        # ignoring happens exactly when torch's clip_grad_norm_ rescales
        clipped = [g.clone().requires_grad_() for g in step]
        for p, g in zip(clipped, step, strict=True):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(clipped, max_norm)
        unchanged = all(torch.equal(p.grad, g) for p, g in zip(clipped, step, strict=True))
        if not math.isnan(stream.norms[t]):
            assert unchanged == keep
            expected_clip = float(torch.nn.utils.get_total_norm([p.grad for p in clipped]))
            assert d.clip_update[t] == pytest.approx(expected_clip, rel=1e-5, abs=1e-12)
        else:
            assert math.isnan(d.clip_update[t])  # clipping leaves NaN behind
        assert d.ignore_update[t] == (stream.norms[t] if keep else 0.0) or (
            keep and d.ignore_update[t] == pytest.approx(stream.norms[t], rel=1e-6)
        )
        assert d.returned[t] == stream.norms[t] or math.isnan(stream.norms[t])
    assert d.n_kept + d.n_ignored == stream.steps
    if max_norm == 0.0:
        assert d.n_kept == 0
    if max_norm == math.inf:
        assert d.n_kept == stream.steps - stream.kinds.count("nan")


def test_nan_step_is_ignored_at_every_threshold(stream):
    t = stream.kinds.index("nan")
    for max_norm in (0.0, 1.0, 1e30, math.inf):
        d = ignoring.norm_decisions(stream, max_norm)
        assert not d.kept[t] and d.ignore_update[t] == 0.0


@pytest.mark.parametrize("margin", [0.0, *MARGIN_GRID, math.inf])
def test_value_norm_decisions_follow_the_rules(stream, margin):
    d = ignoring.value_norm_decisions(stream, margin)
    assert d.clip_value == margin * stream.reference_largest or margin == 0.0
    for t, step in enumerate(stream.grads):
        largest = float(torch.cat([g.flatten() for g in step]).abs().max())
        expected_value = not (largest < d.clip_value)  # NaN compares False: ignored
        assert d.by_value[t] == expected_value
        assert d.by_norm[t] == (not rule_keeps(step, d.max_norm))
    assert set(d.disagreements) == {t for t in range(stream.steps) if d.by_value[t] != d.by_norm[t]}
    if margin == math.inf:
        assert sum(d.by_value) == sum(d.by_norm) == stream.kinds.count("nan")
    if margin == 0.0:
        assert all(d.by_value) and all(d.by_norm)


def test_value_norm_decisions_reject_bad_margin(stream):
    with pytest.raises(ValueError):
        ignoring.value_norm_decisions(stream, -1.0)
    with pytest.raises(ValueError):
        ignoring.value_norm_decisions(stream, math.nan)


def test_zero_gradients_stay_zero_at_every_threshold():
    zeros = tiny_stream([[torch.zeros(3), torch.zeros(2, 2)]] * 2)
    assert zeros.reference_norm == 0.0 and zeros.reference_largest == 0.0
    for max_norm in (0.0, 1.0, math.inf):
        d = ignoring.norm_decisions(zeros, max_norm)
        # the decisions report the effect: a zero gradient comes out unchanged
        assert d.kept == (True, True)
        assert d.ignore_update == d.clip_update == (0.0, 0.0)
        assert d.returned == (0.0, 0.0)
    v = ignoring.value_norm_decisions(zeros, 2.0)
    assert v.largest_ratio == (0.0, 0.0) and v.norm_ratio == (0.0, 0.0)
    assert v.by_value == v.by_norm == (False, False)


def test_nan_and_inf_gradients_are_ignored_never_left_behind():
    steps = [
        [torch.tensor([1.0, math.nan])],
        [torch.tensor([math.inf, 0.0])],
        [torch.tensor([0.3, 0.4])],
    ]
    s = ignoring.stream_from_gradients(steps, ["nan", "glitch", "clean"])
    d = ignoring.norm_decisions(s, 10.0)
    assert d.kept == (False, False, True)
    assert d.ignore_update[:2] == (0.0, 0.0)
    assert math.isnan(d.clip_update[0]) and math.isnan(d.clip_update[1])  # inf * 0 = NaN
    assert d.clip_update[2] == pytest.approx(0.5)
    v = ignoring.value_norm_decisions(s, 3.0)
    assert v.by_value == (True, True, False) and v.by_norm == (True, True, False)
    assert math.isnan(v.largest_ratio[0]) and v.largest_ratio[1] == math.inf


@pytest.mark.parametrize("max_norm", [0.0, *NORM_GRID, math.inf])
def test_stream_figure_draws_at_the_extremes(stream, max_norm):
    fig = ignoring.ignore_norm_stream_figure(max_norm)
    assert isinstance(fig, Figure)
    assert tuple(fig.get_size_inches()) == (6.4, 3.6)
    assert png_bytes(fig)[:4] == b"\x89PNG"


@pytest.mark.parametrize("margin", [0.0, *MARGIN_GRID, math.inf])
def test_value_figure_draws_at_the_extremes(stream, margin):
    fig = ignoring.value_vs_norm_figure(margin)
    assert tuple(fig.get_size_inches()) == (6.4, 3.6)
    assert png_bytes(fig)[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "steps",
    [
        [[torch.zeros(4)]],
        [[torch.full((4,), math.nan)]],
        [[torch.tensor([math.inf, 1.0])], [torch.zeros(2)]],
    ],
)
def test_figures_survive_zero_nan_and_inf_streams(steps):
    s = ignoring.stream_from_gradients(steps)
    for max_norm in (0.0, 1.0, math.inf):
        assert png_bytes(ignoring.ignore_norm_stream_figure(max_norm, stream=s))[:4] == b"\x89PNG"
    for margin in (0.0, 1.5, math.inf):
        assert png_bytes(ignoring.value_vs_norm_figure(margin, stream=s))[:4] == b"\x89PNG"


def test_stream_figure_colours_follow_the_decisions(stream):
    from gradlab_book.plots import IGNORE, KEEP

    d = ignoring.norm_decisions(stream, 6.0)
    fig = ignoring.ignore_norm_stream_figure(6.0)
    top = fig.axes[0]
    colours = [tuple(np.round(p.get_facecolor()[:3], 3)) for p in top.patches]
    import matplotlib.colors as mcolors

    keep = tuple(np.round(mcolors.to_rgb(KEEP), 3))
    ignore = tuple(np.round(mcolors.to_rgb(IGNORE), 3))
    assert colours == [keep if k else ignore for k in d.kept]


def test_corrupted_batches_table_lists_every_corrupted_step(stream):
    table = ignoring.corrupted_batches_table(stream, 1.5).splitlines()
    corrupted = [t for t, k in enumerate(stream.kinds) if k != "clean"]
    assert len(table) == 1 + len(corrupted)
    d = ignoring.value_norm_decisions(stream, 1.5)
    for line, t in zip(table[1:], corrupted, strict=True):
        assert line.split()[0] == str(t)
        assert ignoring.KINDS[stream.kinds[t]] in line
        if math.isfinite(d.largest_ratio[t]):
            # what the chapter says: the value ratio is above the norm ratio on every
            # corrupted batch of this stream, label errors included
            assert d.largest_ratio[t] > d.norm_ratio[t]
            assert f"{d.largest_ratio[t]:.2f}" in line and f"{d.norm_ratio[t]:.2f}" in line


@pytest.mark.parametrize(
    "call",
    [
        lambda: ignoring.ignore_norm_stream_figure(0.0),
        lambda: ignoring.ignore_norm_stream_figure(1e6),
        lambda: ignoring.value_vs_norm_figure(0.0),
        lambda: ignoring.value_vs_norm_figure(100.0),
    ],
)
def test_figures_just_outside_their_sliders(call):
    # issue 21 item 13: a threshold of 0 (everything ignored) or far above every norm
    assert isinstance(call(), Figure)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: ignoring.ignore_norm_stream_figure(-1.0), "max_norm"),
        (lambda: ignoring.ignore_norm_stream_figure(math.nan), "max_norm"),
        (lambda: ignoring.value_vs_norm_figure(-1.0), "margin"),
        (lambda: ignoring.value_vs_norm_figure(math.nan), "margin"),
    ],
)
def test_bad_arguments_are_refused_by_name(call, name):
    with pytest.raises(ValueError, match=name):
        call()
