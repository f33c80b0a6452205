"""House style for every figure in the book.

Figures are built on :class:`matplotlib.figure.Figure` directly (never pyplot), so a
figure function has no global state and can be rendered to PNG in a loop. Every
figure has an opaque white background, so it stays readable in the book's dark mode.
"""

from __future__ import annotations

import io

import matplotlib
from matplotlib.figure import Figure
from PIL import Image

__all__ = [
    "CLIP",
    "IGNORE",
    "KEEP",
    "NONE",
    "SKIP",
    "THRESHOLD",
    "new_figure",
    "png_bytes",
    "use_book_style",
]

# One colour per decision, used on every page (Okabe-Ito, safe for colour blindness).
KEEP = "#0072B2"  # blue: the gradient passes unchanged
CLIP = "#E69F00"  # orange: rescaled or clamped
IGNORE = "#D55E00"  # vermillion: zeroed
SKIP = "#CC79A7"  # purple: the optimizer step is skipped outright
NONE = "#7F7F7F"  # grey: no control at all
THRESHOLD = "#000000"  # the threshold line

_RC = {
    "figure.facecolor": "white",
    "figure.edgecolor": "white",
    "savefig.facecolor": "white",
    "savefig.edgecolor": "white",
    "savefig.transparent": False,
    "axes.facecolor": "white",
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "font.size": 10,
    "legend.frameon": False,
    "svg.hashsalt": "gradlab",
}


def use_book_style() -> None:
    """Apply the book's style to matplotlib and to the notebook's inline backend.

    Call once at the top of a chapter. The inline backend's default figure
    background is transparent, which turns black text invisible in dark mode.
    """
    matplotlib.rcParams.update(_RC)
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython ships with the book's stack
        return
    shell = get_ipython()
    if shell is not None and "InlineBackend" in shell.config:
        shell.config.InlineBackend.rc = dict(_RC)
    try:
        from matplotlib_inline.backend_inline import set_matplotlib_formats
    except ImportError:  # pragma: no cover
        return
    if shell is not None:
        set_matplotlib_formats("png", facecolor="white", bbox_inches="tight")


def new_figure(width: float = 6.4, height: float = 3.6) -> Figure:
    """A fresh, opaque figure of the given size in inches, in the book's style."""
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(width, height), layout="constrained")
    fig.patch.set_facecolor("white")
    fig.patch.set_alpha(1.0)
    return fig


def png_bytes(fig: Figure, dpi: int = 96) -> bytes:
    """Render ``fig`` to a compact, opaque PNG, reproducibly (no version metadata).

    A plot uses few colours, so a 256-colour palette is visually lossless and makes
    the file about three times smaller than matplotlib's RGBA output: that is what
    keeps a page with dozens of precomputed frames light.
    """
    rgba = io.BytesIO()
    with matplotlib.rc_context(_RC):
        fig.savefig(rgba, format="png", dpi=dpi, facecolor="white", metadata={"Software": None})
    palette = io.BytesIO()
    Image.open(rgba).convert("RGB").quantize(colors=256).save(palette, format="png", optimize=True)
    return palette.getvalue()
