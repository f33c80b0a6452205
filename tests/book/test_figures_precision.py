"""The mixed-precision chapter's computations: formats, fates of scaled gradients, autocast."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from gradlab_book.figures import precision
from gradlab_book.plots import png_bytes


def test_formats_are_the_ieee_numbers():
    rows = {f.name: f for f in precision.formats()}
    f16, bf16, f32 = rows["float16"], rows["bfloat16"], rows["float32"]
    assert (f16.max, f16.smallest_normal, f16.smallest_subnormal, f16.eps) == (
        65504.0,
        2.0**-14,
        2.0**-24,
        2.0**-10,
    )
    assert (bf16.smallest_normal, bf16.smallest_subnormal, bf16.eps) == (
        2.0**-126,
        2.0**-133,
        2.0**-7,
    )
    assert bf16.max == (2 - 2.0**-7) * 2.0**127
    assert f32.smallest_subnormal == 2.0**-149
    assert f16.overflow_at == 65520.0
    assert bf16.overflow_at == 2.0**128 * (1 - 2.0**-9)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32"])
def test_format_edges_are_where_torch_rounds(name):
    row = precision.format_of(name)
    dtype = precision.FORMATS[name]

    def cast(x):
        return torch.tensor(x, dtype=torch.float64).to(dtype).double().item()

    assert cast(row.smallest_subnormal) == row.smallest_subnormal
    assert cast(row.smallest_subnormal / 2) == 0.0  # the tie rounds to even: 0
    assert cast(row.smallest_subnormal * 0.51) == row.smallest_subnormal
    assert cast(row.max) == row.max
    assert cast(row.overflow_at) == math.inf
    if name != "float32":
        # the float32 neighbour: torch casts float64 to 16 bits through float32
        below = float(np.nextafter(np.float32(row.overflow_at), np.float32(0)))
        assert cast(below) == row.max


def _fates64(values, scale, name):
    """An independent classification in float64 by the format's edges."""
    row = precision.format_of(name)
    size = np.abs(values.double().numpy()) * scale
    size = size[size != 0]
    zero = size <= row.smallest_subnormal / 2
    overflow = size >= row.overflow_at
    # below the smallest normal after rounding: the largest subnormal rounds up to
    # smallest_normal only from halfway on
    largest_sub = row.smallest_normal - row.smallest_subnormal
    subnormal = ~zero & (size < largest_sub + row.smallest_subnormal / 2)
    return int(zero.sum()), int(subnormal.sum()), int(overflow.sum())


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("log2_scale", [0, 8, 16, 26, 30])
def test_fates_match_a_float64_classification(name, log2_scale):
    gen = torch.Generator().manual_seed(log2_scale)
    values = torch.randn(4000, generator=gen) * 10 ** (torch.rand(4000, generator=gen) * 16 - 12)
    if name == "bfloat16":
        values = values * 1e-28  # reach bfloat16's subnormals too
    scale = 2.0**log2_scale
    got = precision.fates(values, scale, name)
    zero, subnormal, overflow = _fates64(values, scale, name)
    assert (got.zero, got.subnormal, got.overflow) == (zero, subnormal, overflow)
    assert got.zero + got.subnormal + got.normal + got.overflow == got.total == 4000


def test_fates_of_the_model_gradients_move_with_the_scale():
    g = precision.model_gradients()
    assert g.dtype == torch.float32 and g.numel() == 12 * (32 * 32 + 32)
    assert bool((g != 0).all())
    # a wide range: ten decades
    assert math.log10(g.abs().max() / g.abs().min()) > 9
    unscaled = precision.fates(g, 1.0)
    assert unscaled.zero > g.numel() / 2  # most entries are lost without a scale
    default = precision.fates(g, 2.0**16)
    assert default.zero <= 2 and default.overflow == 0
    assert precision.fates(g, 2.0**26).overflow > 0
    assert precision.fates(g, 1.0, "bfloat16").normal == g.numel()
    with pytest.raises(ValueError, match="scale"):
        precision.fates(g, 0.0)
    with pytest.raises(ValueError, match="dtype"):
        precision.fates(g, 1.0, "float8")


def test_autocast_gradients_lose_what_the_storage_model_predicts():
    table = precision.autocast_loss_table([1.0, 2.0**16, 2.0**26])
    unscaled, default, large = table
    assert unscaled.lost > unscaled.total / 2 and unscaled.nonfinite == 0
    assert default.lost == 0 and default.nonfinite == 0
    assert default.median_error < 2e-3  # about float16's eps
    assert large.nonfinite > 0
    predicted = precision.fates(precision.model_gradients(), 1.0)
    assert abs(unscaled.lost - predicted.zero) < 0.1 * unscaled.total
    bf16 = precision.autocast_loss_table([1.0], "bfloat16")[0]
    assert bf16.lost == 0 and bf16.nonfinite == 0
    assert 1e-3 < bf16.median_error < 2e-2  # bfloat16 keeps 8 significant bits


def test_autocast_gradients_are_float32_and_unscaled():
    ref = precision.model_gradients().double()
    got = precision.autocast_gradients(2.0**16).double()
    assert precision.autocast_gradients(2.0**16).dtype == torch.float32
    rel = ((got - ref).abs() / ref.abs()).median()
    assert rel < 2e-3
    with pytest.raises(ValueError, match="dtype"):
        precision.autocast_gradients(1.0, "float32")


@pytest.mark.parametrize("log2_scale, dtype", [(0, "float16"), (26, "float16"), (0, "bfloat16")])
def test_scale_figure_renders_with_its_counts(log2_scale, dtype):
    fig = precision.scale_figure(log2_scale, dtype)
    assert isinstance(fig, Figure)
    counts = precision.fates(precision.model_gradients(), 2.0**log2_scale, dtype)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert f"rounds to 0 (lost): {counts.zero}" in labels
    assert f"rounds to inf: {counts.overflow}" in labels
    assert png_bytes(fig)[:4] == b"\x89PNG"
    with pytest.raises(ValueError):
        precision.scale_figure(0, "float32")


@pytest.mark.parametrize("log2_scale", [-8, -1, 29, 32, 40, 64])
def test_scale_figure_just_outside_its_slider(log2_scale):
    # the slider runs 0..28: a loss scale a little outside still draws, with its counts
    fig = precision.scale_figure(log2_scale)
    counts = precision.fates(precision.model_gradients(), 2.0**log2_scale)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert f"rounds to inf: {counts.overflow}" in labels
    with pytest.raises(ValueError, match="log2_scale"):
        precision.scale_figure(2000)
    with pytest.raises(ValueError, match="log2_scale"):
        precision.scale_figure("16")


@pytest.mark.parametrize(
    "count, total, text",
    [
        (0, 10, "0"),
        (10, 10, "100%"),
        (1, 1000, "<1%"),
        (999, 1000, ">99%"),
        (8761, 12672, "69%"),
        (8752, 12672, "69%"),
        (8272, 12672, "65%"),
        (1, 3, "33%"),
    ],
)
def test_percent_is_a_share_that_few_entries_cannot_move(count, total, text):
    assert precision.percent(count, total) == text


def test_percent_refuses_impossible_counts():
    for count, total in ((1, 0), (-1, 5), (6, 5)):
        with pytest.raises(ValueError):
            precision.percent(count, total)


@pytest.mark.parametrize(
    "x, k",
    [(1e-3, -10), (1.0092e-3, -10), (3.54e-3, -8), (0.33, -2), (8.26e-3, -7), (1.0, 0), (3.0, 2)],
)
def test_nearest_log2(x, k):
    assert precision.nearest_log2(x) == k
    # independent: 2**k is the nearest power of two on a log scale
    assert abs(math.log2(x) - k) <= 0.5


def test_nearest_log2_refuses_what_has_no_logarithm():
    for x in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            precision.nearest_log2(x)


def test_the_chain_is_built_to_span_the_range_and_the_transformer_is_not():
    chain = precision.model_gradients().double().abs()
    tf = precision.model_gradients(model="transformer").double().abs()
    assert tf.dtype == torch.float64 and tf.numel() > 100_000
    # ten decades against the transformer's middle half within two decades
    assert math.log10(chain.max() / chain.min()) > 9
    q1, q3 = torch.quantile(tf[tf > 0], torch.tensor([0.25, 0.75], dtype=torch.float64))
    assert math.log10(q3 / q1) < 2
    chain_lost = precision.fates(chain, 1.0).fraction("zero")
    tf_lost = precision.fates(tf, 1.0).fraction("zero")
    assert chain_lost > 0.5 and tf_lost < 0.01
    rows = precision.autocast_loss_table([1.0, 2.0**16], model="transformer")
    assert rows[0].lost < 0.001 * rows[0].total and rows[0].nonfinite == 0
    assert rows[1].lost == 0 and rows[1].median_error < 4e-3
    with pytest.raises(ValueError, match="model"):
        precision.model_gradients(model="resnet")
