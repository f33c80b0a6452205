r"""16-bit floats and gradients (taught in book/scale/mixed_precision).

A gradient entry stored in float16 is rounded to the nearest float16 number: below
half the smallest subnormal, :math:`2^{-25}`, that is 0 (the entry *underflows*);
from 65520 on, halfway between the largest finite float16, 65504, and :math:`2^{16}`,
it is ``inf`` (the entry *overflows*). A loss scale :math:`\omega = 2^k` multiplies every
gradient by :math:`\omega` before it is stored, which slides that window of representable
magnitudes over the gradients; bfloat16 has float32's exponent range and needs no
scale. The computations here (:func:`formats`, :func:`fates`,
:func:`autocast_gradients`) return plain numbers, decided by torch's own casts and
autocast; :func:`scale_figure` only draws.

Two models. The chapter's first is a deep ``tanh`` chain
(:func:`gradlab_book.demos.tanh_chain`, 12 layers of width 32, weights
:math:`0.4/\sqrt{32}`), *built* so that its gradients shrink layer by layer and span
ten decades: a vanishing-gradient construction that exercises every part of float16's
range, not a typical network. The second, for contrast, is the small pre-LN transformer
of the loss-spike chapter (:mod:`gradlab_book.char_lm`: token and position embeddings,
two blocks of width 64, LayerNorms and residual connections), on a seeded batch of
random tokens: normalisation and residual paths keep its gradients within a few
decades. :func:`autocast_loss_table` runs either (``model="chain"`` or
``"transformer"``).

The chapter prints what it teaches robustly to the last float bits (the float16
products of autocast differ between CPU kernels): a share of the entries
(:func:`percent`) and a median error to the nearest power of two (:func:`nearest_log2`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

from gradlab_book import demos
from gradlab_book.plots import CLIP, IGNORE, KEEP, SKIP, new_figure

__all__ = [
    "DEPTH",
    "FORMATS",
    "MODELS",
    "TRANSFORMER",
    "WIDTH",
    "Fates",
    "Format",
    "LossRow",
    "autocast_gradients",
    "autocast_loss_table",
    "fates",
    "formats",
    "model_gradients",
    "nearest_log2",
    "percent",
    "scale_figure",
]

#: The dtypes compared, by the names the figures use.
FORMATS = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

DEPTH = 12
WIDTH = 32
_WEIGHT_SCALE = 0.4
_BATCH = 64

#: The contrast model: :func:`gradlab_book.char_lm.make_model` with this setup, on a
#: batch of ``batch`` random sequences of ``context`` tokens (next-token targets).
TRANSFORMER = {"context": 64, "width": 64, "layers": 2, "heads": 4, "batch": 16}

#: The models :func:`autocast_loss_table` and :func:`model_gradients` know.
MODELS = ("chain", "transformer")


@dataclass(frozen=True)
class Format:
    """The range of one floating-point format, from :func:`torch.finfo`.

    Attributes:
        name: ``"float16"``, ``"bfloat16"`` or ``"float32"``.
        bits: total bits.
        max: the largest finite number.
        smallest_normal: the smallest positive normal number (full precision).
        smallest_subnormal: the smallest positive number, ``smallest_normal * eps``
            (subnormals trade precision for range below ``smallest_normal``).
        eps: the gap between 1 and the next number (:math:`2^{-p}` for p stored
            fraction bits): the relative rounding error is at most ``eps / 2``.
        overflow_at: the smallest magnitude that rounds to ``inf``: halfway from
            ``max`` to the next power of two :math:`2^{e+1}` (``max`` is
            :math:`2^e (2 - \text{eps})`), that is :math:`2^{e+1} (1 - \text{eps}/4)`;
            the tie rounds up, because ``max`` has an odd last bit.
    """

    name: str
    bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float
    overflow_at: float


def formats() -> list[Format]:
    """float16, bfloat16 and float32, as :func:`torch.finfo` gives them."""
    rows = []
    for name, dtype in FORMATS.items():
        info = torch.finfo(dtype)
        top = 2.0 ** math.floor(math.log2(info.max))  # 2**emax
        rows.append(
            Format(
                name=name,
                bits=info.bits,
                max=float(info.max),
                smallest_normal=float(info.smallest_normal),
                smallest_subnormal=float(info.smallest_normal * info.eps),
                eps=float(info.eps),
                overflow_at=2.0 * top * (1.0 - info.eps / 4.0),
            )
        )
    return rows


def format_of(dtype: str) -> Format:
    """The :class:`Format` named ``dtype``."""
    for row in formats():
        if row.name == dtype:
            return row
    raise ValueError(f"dtype must be one of {sorted(FORMATS)}, got {dtype!r}")


def percent(count: int, total: int) -> str:
    """``count`` of ``total`` as a share that the last float bits cannot move.

    ``"0"`` and ``"100%"`` only when exact; ``"<1%"`` and ``">99%"`` near the ends;
    otherwise the nearest whole percent. A share changes only when some entries move
    across a rounding edge by about a hundredth of ``total``, where a count would change
    with a single entry.
    """
    if total <= 0 or not 0 <= count <= total:
        raise ValueError(f"need 0 <= count <= total and total > 0, got {count} of {total}")
    if count == 0:
        return "0"
    if count == total:
        return "100%"
    share = 100.0 * count / total
    if share < 1.0:
        return "<1%"
    if share > 99.0:
        return ">99%"
    return f"{share:.0f}%"


def nearest_log2(x: float) -> int:
    """The integer k for which :math:`2^k` is nearest to ``x`` on a log scale.

    ``round(log2(x))``: a relative error of 1e-3 is reported as ``2**-10``, and noise of
    a few per cent (7% from the middle to the edge) does not move it.
    """
    x = float(x)
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"x must be a positive finite number, got {x!r}")
    return round(math.log2(x))


# ------------------------------------------------------------------ the fates


@dataclass(frozen=True)
class Fates:
    """What storing ``scale * g`` in a 16-bit dtype does to each nonzero entry of g.

    Attributes:
        scale: the loss scale.
        dtype: the name of the storage dtype.
        zero: entries that round to 0 (lost).
        subnormal: entries stored as subnormals (fewer significant bits).
        normal: entries stored as normal numbers (relative error at most eps / 2).
        overflow: entries that round to ``inf``.
        total: nonzero entries considered (exact zeros are left out).
    """

    scale: float
    dtype: str
    zero: int
    subnormal: int
    normal: int
    overflow: int
    total: int

    def fraction(self, name: str) -> float:
        """The share of :attr:`total` in category ``name`` (``"zero"``, ...)."""
        return getattr(self, name) / self.total if self.total else 0.0


def _stored(values: Tensor, scale: float, dtype: str) -> Tensor:
    """``scale * values`` rounded once to ``dtype`` (the product is exact in float64)."""
    if dtype not in FORMATS:
        raise ValueError(f"dtype must be one of {sorted(FORMATS)}, got {dtype!r}")
    return (values.detach().to(torch.float64) * scale).to(FORMATS[dtype])


def fates(values: Tensor, scale: float = 1.0, dtype: str = "float16") -> Fates:
    """Count how the nonzero entries of ``values`` fare when stored as ``scale * values``.

    The rounding is torch's own cast, from float64 (where the product by a power of
    two is exact) to ``dtype``.
    """
    if not (isinstance(scale, int | float) and scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    flat = values.detach().reshape(-1)
    flat = flat[flat != 0]
    stored = _stored(flat, float(scale), dtype).to(torch.float64)
    size = stored.abs()
    normal_min = format_of(dtype).smallest_normal
    zero = int((size == 0).sum())
    overflow = int(torch.isinf(size).sum())
    subnormal = int(((size > 0) & (size < normal_min)).sum())
    return Fates(
        scale=float(scale),
        dtype=dtype,
        zero=zero,
        subnormal=subnormal,
        normal=flat.numel() - zero - overflow - subnormal,
        overflow=overflow,
        total=flat.numel(),
    )


# ------------------------------------------------------------------ the model


def _model_and_batch(seed: int = 0):
    model = demos.tanh_chain(DEPTH, width=WIDTH, weight_scale=_WEIGHT_SCALE, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(_BATCH, WIDTH, generator=gen)
    y = 0.1 * torch.randn(_BATCH, WIDTH, generator=gen)
    return model, x, y


def _transformer_and_batch(seed: int = 0):
    from gradlab_book import char_lm  # the loss-spike chapter's model

    setup = TRANSFORMER
    model = char_lm.make_model(seed, setup)
    vocab = model.head.out_features
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (setup["batch"], setup["context"])
    x = torch.randint(0, vocab, shape, generator=gen)
    y = torch.randint(0, vocab, shape, generator=gen)
    return model, x, y


def _loss(model_name: str, model, out: Tensor, y: Tensor) -> Tensor:
    if model_name == "chain":
        return torch.nn.functional.mse_loss(out.float(), y)
    vocab = model.head.out_features
    return torch.nn.functional.cross_entropy(out.float().reshape(-1, vocab), y.reshape(-1))


def _check_model(model: str) -> None:
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")


@functools.lru_cache(maxsize=16)
def _gradients(autocast: str | None, scale: float, seed: int, model_name: str) -> Tensor:
    build = _model_and_batch if model_name == "chain" else _transformer_and_batch
    model, x, y = build(seed)
    if autocast is None:
        out = model(x)
    else:
        with torch.autocast("cpu", dtype=FORMATS[autocast]):
            out = model(x)
    (_loss(model_name, model, out, y) * scale).backward()
    grads = [p.grad.reshape(-1) for p in model.parameters()]
    return torch.cat(grads) / scale  # float32, as the parameters; / 2**k is exact


def model_gradients(seed: int = 0, model: str = "chain") -> Tensor:
    """All gradient entries of ``model`` (see :data:`MODELS`) in float32, no autocast, 1-D."""
    _check_model(model)
    return _gradients(None, 1.0, seed, model).clone()


def autocast_gradients(
    scale: float = 1.0, dtype: str = "float16", seed: int = 0, model: str = "chain"
) -> Tensor:
    """The same gradients from a real ``torch.autocast`` backward with loss scale ``scale``.

    The forward runs in ``dtype`` under CPU autocast, the loss is taken in float32 and
    multiplied by ``scale`` before ``backward()``; the result is divided by ``scale``
    again (exact for a power of two). The parameters, and so their ``.grad``, stay in
    float32; the weight gradients are computed by 16-bit matrix products first.
    """
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")
    _check_model(model)
    return _gradients(dtype, float(scale), seed, model).clone()


@dataclass(frozen=True)
class LossRow:
    """One row of :func:`autocast_loss_table`.

    Attributes:
        scale: the loss scale.
        lost: entries that are 0 under autocast but nonzero in float32.
        nonfinite: entries that are NaN or inf under autocast.
        median_error: the median relative error of the other entries against float32.
        total: all gradient entries.
    """

    scale: float
    lost: int
    nonfinite: int
    median_error: float
    total: int


def autocast_loss_table(
    scales: Sequence[float], dtype: str = "float16", seed: int = 0, model: str = "chain"
) -> list[LossRow]:
    """What a real autocast backward of ``model`` loses, at each loss scale, against float32."""
    reference = model_gradients(seed, model).to(torch.float64)
    rows = []
    for scale in scales:
        got = autocast_gradients(scale, dtype, seed, model).to(torch.float64)
        finite = torch.isfinite(got)
        lost = (got == 0) & (reference != 0)
        usable = finite & ~lost & (reference != 0)
        error = ((got - reference).abs() / reference.abs())[usable]
        rows.append(
            LossRow(
                scale=float(scale),
                lost=int(lost.sum()),
                nonfinite=int((~finite).sum()),
                median_error=float(error.median()) if error.numel() else math.nan,
                total=reference.numel(),
            )
        )
    return rows


# ------------------------------------------------------------------ the figure


def _fate_masks(values: Tensor, scale: float, dtype: str) -> dict[str, np.ndarray]:
    stored = _stored(values, scale, dtype).to(torch.float64).abs()
    normal_min = format_of(dtype).smallest_normal
    masks = {
        "zero": stored == 0,
        "subnormal": (stored > 0) & (stored < normal_min),
        "normal": torch.isfinite(stored) & (stored >= normal_min),
        "overflow": torch.isinf(stored),
    }
    return {k: v.numpy() for k, v in masks.items()}


_FATE_STYLE = {
    "zero": ("rounds to 0 (lost)", IGNORE),
    "subnormal": ("subnormal (fewer bits)", CLIP),
    "normal": ("stored with full precision", KEEP),
    "overflow": ("rounds to inf", SKIP),
}


def scale_figure(log2_scale: int = 16, dtype: str = "float16", seed: int = 0) -> Figure:
    r"""Histogram of a real model's :math:`|g|`, coloured by what storing :math:`2^k g` does.

    The x-axis is the *unscaled* magnitude; the shaded band is the range of
    magnitudes that ``dtype`` stores at full precision once multiplied by the loss
    scale :math:`\omega = 2^k`: :math:`[\text{smallest normal}/\omega,\ \max/\omega]`.
    """
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")
    if isinstance(log2_scale, bool) or not isinstance(log2_scale, int | float):
        raise ValueError(f"log2_scale must be a number, got {log2_scale!r}")
    if not -1000 <= log2_scale <= 1000:  # 2**k finite and nonzero in float64
        raise ValueError(f"log2_scale must be within [-1000, 1000], got {log2_scale!r}")
    scale = 2.0**log2_scale
    values = model_gradients(seed)
    values = values[values != 0]
    size = values.abs().to(torch.float64).numpy()
    info = format_of(dtype)
    counts = fates(values, scale, dtype)
    masks = _fate_masks(values, scale, dtype)
    lo, hi = math.floor(math.log2(size.min())) - 1, math.ceil(math.log2(size.max())) + 1
    edges = 2.0 ** np.arange(lo, hi + 1)
    fig = new_figure(6.4, 4.0)
    ax = fig.add_subplot()
    # the representable window of dtype, in unscaled units
    left, right = 2.0 ** (lo - 6), 2.0 ** (hi + 6)
    band_lo, band_hi = info.smallest_normal / scale, info.max / scale
    ax.axvspan(max(band_lo, left), min(band_hi, right), color=KEEP, alpha=0.08, lw=0)
    zero_edge = info.smallest_subnormal / 2 / scale  # at most this rounds to 0
    ax.axvspan(left, zero_edge, color=IGNORE, alpha=0.12, lw=0)
    ax.axvspan(zero_edge, band_lo, color=CLIP, alpha=0.12, lw=0)
    ax.axvspan(info.overflow_at / scale, right, color=SKIP, alpha=0.08, lw=0)
    for edge, text, ha in (
        (band_lo, f"smallest normal / $\\omega$\n= {band_lo:.1e}", "left"),
        (band_hi, f"max / $\\omega$\n= {band_hi:.1e}", "right"),
    ):
        if left < edge < right:
            ax.axvline(edge, color="black", lw=0.8, ls="--")
            ax.annotate(
                text,
                (edge, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3 if ha == "left" else -3, -3),
                textcoords="offset points",
                ha=ha,
                va="top",
                fontsize=7,
            )
    names = list(_FATE_STYLE)
    ax.hist(
        [size[masks[n]] for n in names],
        bins=edges,
        stacked=True,
        color=[_FATE_STYLE[n][1] for n in names],
        label=[f"{_FATE_STYLE[n][0]}: {getattr(counts, n)}" for n in names],
    )
    ax.set_xscale("log", base=10)
    ax.set_yscale("log")  # so that a single lost entry shows
    ax.set_xlim(2.0**lo / 4, 2.0**hi * 4)
    ax.set_ylim(0.5, 3e4)
    ax.set_xlabel(r"unscaled gradient magnitude $|g|$ (log scale)")
    ax.set_ylabel("entries (log scale)")
    share = 100 * (counts.zero + counts.overflow) / counts.total
    ax.set_title(
        f"{dtype}, loss scale $\\omega$ = 2^{log2_scale}: {share:.1f}% of {counts.total} "
        "entries lost to 0 or inf",
        fontsize=10,
    )
    fig.legend(loc="outside lower center", ncol=2, fontsize=8)
    return fig
