r"""Figures the reader holds in the hand: closed-form 2-D explorables, in the page.

The frame slideshows of :mod:`gradlab_book.interactive` need torch to compute each
frame, so they are precomputed. The figures here are closed-form and two-dimensional,
so a few lines of dependency-free JavaScript compute them exactly, while the reader
drags a point with the mouse (or a finger, or the arrow keys):

* :func:`cliff_html`: the "cliff" of Pascanu, Mikolov and Bengio (2013), a loss
  surface with a steep wall; drag the start of SGD with momentum and compare no
  control, clip by norm, zeroing (``grad_ignore_norm_``) and a true skip
  (``StepGuard(mode="skip")``);
* :func:`norm_ball_html`: clip by norm in 2-D, the projection onto the l2 ball
  (and ``grad_ignore_norm_``, which zeroes instead);
* :func:`value_cube_html`: clip by value, the projection onto the l-infinity box
  (and ``grad_ignore_value_``);
* :func:`unit_balls_html`: the unit balls of several p-norms and the p-norms of a
  point.

Each returns a :class:`DirectHTML`: a ``str`` of self-contained HTML (its CSS and
JavaScript inlined, ids unique per call) that displays as HTML in a notebook, in
JupyterLab (trusted outputs run their scripts) as on the built site. The JavaScript
uses the library's formulas: the clip coefficient
:math:`\gamma = \min(1, \tau / (\|g\|_2 + \varepsilon))` with
:math:`\varepsilon = 10^{-6}` (``gradlab.clip.EPS``), kept iff
:math:`\tau / (\|g\|_2 + \varepsilon) \ge 1`, clamping, :math:`\|g\|_\infty < c` to
keep by value, and :math:`(\sum_i |x_i|^p)^{1/p}`. Every figure writes its current
numbers into ``data-`` attributes of its root element; the browser suite
(``tests/browser/test_direct_manipulation.py``) drags them and checks those numbers
against :mod:`gradlab`.

Colours: the book's Okabe-Ito palette (:mod:`gradlab_book.plots`), with a dash
pattern per mode as well, so no distinction rests on colour alone.

:func:`write_hero` writes the hero figure of the introduction; the repository's
``python -m booktools.hero`` rewrites ``book/_static/explorables/cliff.html`` with it
(included by ``book/intro.md``).
"""

# The text is typeset maths for readers: γ, τ, − (minus) and – are meant.
# ruff: noqa: RUF001

from __future__ import annotations

import html
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradlab.clip import EPS

__all__ = [
    "CLIFF_SURFACE",
    "PALETTE",
    "DirectHTML",
    "cliff_html",
    "norm_ball_html",
    "unit_balls_html",
    "value_cube_html",
    "write_hero",
]

#: The book's colours (the same as :mod:`gradlab_book.plots`, which needs matplotlib).
PALETTE = {
    "keep": "#0072B2",  # blue: the gradient passes unchanged
    "clip": "#E69F00",  # orange: rescaled or clamped
    "ignore": "#D55E00",  # vermillion: zeroed
    "skip": "#CC79A7",  # reddish purple: the step is skipped outright
    "none": "#7F7F7F",  # grey: no control at all
    "threshold": "#000000",  # the threshold, the raw gradient
}

#: The cliff's loss, with :math:`u = \theta_1 - x_0`, :math:`v = \theta_2 - y_0`:
#: :math:`L = \tfrac{a}{2}u^2 + \tfrac{b}{2}v^2 + H\,\sigma(k(\theta_1 - c - s\,\theta_2))`,
#: a valley whose floor runs into a wall of height ``H`` and steepness ``k`` along the
#: line :math:`\theta_1 = c + s\,\theta_2`. Its wall term's gradient reaches :math:`Hk/4 = 16`
#: (the whole gradient's norm about 17); in the valley the norm is between 0 and 2.
CLIFF_SURFACE = {"a": 0.5, "b": 1.0, "x0": 0.6, "y0": 0.0, "H": 4.0, "k": 16.0, "c": 0.9, "s": 0.3}

_counter = itertools.count(1)


class DirectHTML(str):
    """HTML of one direct-manipulation figure: a ``str`` that a notebook shows as HTML."""

    kind: str = "figure"

    def __new__(cls, text: str, kind: str = "figure") -> DirectHTML:
        obj = super().__new__(cls, text)
        obj.kind = kind
        return obj

    def _repr_html_(self) -> str:
        return str(self)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, Any]:
        return {"text/plain": f"<gradlab direct figure: {self.kind}>", "text/html": str(self)}

    def __repr__(self) -> str:
        return f"<gradlab direct figure: {self.kind}>"


# ----------------------------------------------------------------------------- helpers


def _uid(kind: str, uid: str | None) -> str:
    if uid is None:
        return f"gldm-{kind}-{next(_counter)}"
    if not uid.replace("-", "").replace("_", "").isalnum() or not uid[0].isalpha():
        raise ValueError(f"uid must be letters, digits, - and _, starting with a letter: {uid!r}")
    return uid


def _json(data: Any) -> str:
    """JSON safe inside a <script> element."""
    return json.dumps(data, allow_nan=False).replace("</", "<\\/")


def _vector2(name: str, v: Sequence[float]) -> list[float]:
    values = [float(x) for x in v]
    if len(values) != 2 or not all(math.isfinite(x) for x in values):
        raise ValueError(f"{name} must be two finite numbers, got {v!r}")
    return values


def _positive(name: str, x: float) -> float:
    x = float(x)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be a positive number, got {x!r}")
    return x


def _slider(
    uid: str,
    param: str,
    label: str,
    lo: float,
    hi: float,
    step: float,
    value: float,
    digits: int,
) -> str:
    if not lo <= value <= hi:
        raise ValueError(f"{param}={value} is outside [{lo}, {hi}]")
    sid = f"{uid}-{param}"
    shown = f"{value:.{digits}f}"
    return (
        f'<label class="gldm-slider" for="{sid}">'
        f'<span class="gldm-slider-name">{html.escape(label)}</span>'
        f'<input type="range" id="{sid}" data-param="{param}" data-digits="{digits}" '
        f'min="{lo:g}" max="{hi:g}" step="{step:g}" value="{value:g}" '
        f'aria-valuetext="{shown}">'
        f'<output class="gldm-value" for="{sid}">{shown}</output></label>'
    )


# The cliff's end-of-run markers, as drawn by its JavaScript (marker()), for the legend.
_MARKERS = {
    "none": '<path d="M29,1h8v8h-8Z"',
    "clip": '<circle cx="33" cy="5" r="4.5"',
    "zero": '<path d="M33,0L37.5,9h-9Z"',
    "skip": '<path d="M33,0L38,5L33,10L28,5Z"',
}


def _modes(
    uid: str,
    legend: str,
    modes: Sequence[tuple[str, str, str, str]],
    chosen: str,
    markers: bool = False,
) -> str:
    """A fieldset of radio buttons: (value, label, colour or "", dash pattern) per mode."""
    if chosen not in [m[0] for m in modes]:
        raise ValueError(f"mode must be one of {[m[0] for m in modes]}, got {chosen!r}")
    rows = []
    for value, label, colour, dash in modes:
        checked = " checked" if value == chosen else ""
        swatch = ""
        if colour:
            mark = (
                f'{_MARKERS[value]} fill="{colour}" stroke="#000" stroke-width="1"/>'
                if markers
                else ""
            )
            width = 40 if markers else 28
            swatch = (
                f'<svg class="gldm-swatch" width="{width}" height="10" aria-hidden="true" '
                'focusable="false"><line x1="1" y1="5" x2="27" y2="5" '
                f'stroke="{colour}" stroke-width="3" stroke-dasharray="{dash}"/>{mark}</svg>'
            )
        rows.append(
            f'<label class="gldm-mode"><input type="radio" name="{uid}-mode" '
            f'value="{value}"{checked}>{swatch}<span>{html.escape(label)}</span></label>'
        )
    return (
        f'<fieldset class="gldm-modes"><legend>{html.escape(legend)}</legend>'
        f"{''.join(rows)}</fieldset>"
    )


def _figure(
    kind: str,
    uid: str,
    *,
    title: str,
    caption: str,
    controls: str,
    config: dict[str, Any],
    help_text: str,
    extra: str = "",
) -> DirectHTML:
    config = {"eps": EPS, "palette": PALETTE, **config}
    text = (
        f'<div class="gldm gldm-{kind}" id="{uid}" data-figure="{kind}" role="group" '
        f'aria-labelledby="{uid}-title" aria-describedby="{uid}-caption">'
        f"<style>{_CSS}</style>"
        f'<p class="gldm-title" id="{uid}-title">{html.escape(title)}</p>'
        f'<p class="gldm-caption" id="{uid}-caption">{html.escape(caption)}</p>'
        f'<div class="gldm-controls">{controls}</div>'
        f'<div class="gldm-stage"><svg class="gldm-svg" id="{uid}-svg" '
        f'aria-describedby="{uid}-readout"></svg></div>'
        f'<p class="gldm-readout" id="{uid}-readout" aria-live="polite">'
        "This figure needs JavaScript (in JupyterLab: run the cell or trust the notebook).</p>"
        f"{extra}"
        f'<p class="gldm-help">{html.escape(help_text)}</p>'
        f'<script type="application/json" class="gldm-config">{_json(config)}</script>'
        f"<script>{_CORE_JS}\n{_MODULES[kind]}\n"
        f"window.GradlabDirect.{kind}(document.getElementById({json.dumps(uid)})"
        " || document.currentScript.parentElement);</script>"
        "</div>"
    )
    return DirectHTML(text, kind)


_DRAG_HELP = (
    "Drag the white dot with the mouse or a finger, or press Tab to focus it and move it "
    "with the arrow keys (Shift: ten times further; Home: {home})."
)


# ----------------------------------------------------------------------------- figures


def cliff_html(
    start: Sequence[float] = (-0.8, 1.3),
    mode: str = "clip",
    max_norm: float = 1.5,
    lr: float = 0.1,
    momentum: float = 0.9,
    steps: int = 80,
    uid: str | None = None,
) -> DirectHTML:
    r"""The cliff: SGD with momentum on a loss with a wall, four ways to treat the wall.

    The update is PyTorch's SGD, :math:`b_t = \mu b_{t-1} + g_t`,
    :math:`\theta_t = \theta_{t-1} - \eta b_t`, on the gradient :math:`g_t` of
    :data:`CLIFF_SURFACE` after the chosen control: none; clip by norm,
    :math:`g \leftarrow \gamma g`; zero (``grad_ignore_norm_``), :math:`g \leftarrow 0`
    when :math:`\tau / (\|g\| + \varepsilon) < 1`, the step still taken, so momentum
    coasts on; skip (``StepGuard(mode="skip")``), no step at all, :math:`b` untouched.
    """
    start = _vector2("start", start)
    steps = int(steps)
    if not 1 <= steps <= 1000:
        raise ValueError(f"steps must be in [1, 1000], got {steps}")
    uid = _uid("cliff", uid)
    modes = (
        ("none", "No control", PALETTE["none"], "none"),
        ("clip", "Clip by norm", PALETTE["clip"], "none"),
        ("zero", "Zero the gradient", PALETTE["ignore"], "7 4"),
        ("skip", "Skip the step", PALETTE["skip"], "2 3"),
    )
    controls = _modes(uid, "At a gradient over τ", modes, mode, markers=True) + (
        '<div class="gldm-sliders">'
        + _slider(uid, "tau", "threshold τ", 0.25, 5.0, 0.25, max_norm, 2)
        + _slider(uid, "lr", "learning rate η", 0.01, 0.2, 0.01, lr, 2)
        + _slider(uid, "momentum", "momentum μ", 0.0, 0.95, 0.05, momentum, 2)
        + "</div>"
    )
    config = {
        "surface": CLIFF_SURFACE,
        "view": {"x0": -4.0, "x1": 3.0, "y0": -2.0, "y1": 2.0},
        "start": start,
        "steps": steps,
        "modes": [m[0] for m in modes],
        "labels": {m[0]: m[1] for m in modes},
        "dash": {m[0]: m[3] for m in modes},
        "colour": {m[0]: m[2] for m in modes},
    }
    return _figure(
        "cliff",
        uid,
        title="The cliff: what each control does at a wall in the loss",
        caption=(
            "A loss surface over two parameters θ1 and θ2, drawn as shaded contour bands "
            "(darker is higher): a valley whose floor runs into a steep wall, the cliff, "
            "marked by a dashed line; beyond it lies a high plateau. From the white start "
            f"point, {steps} steps of gradient descent with momentum are drawn for each "
            "control: the chosen one bold, the other three faint, each ending in its own "
            "marker (square, circle, triangle, diamond, as in the legend). On the wall the "
            "gradient's norm reaches about 17; in the valley it is between 0 and 2."
        ),
        controls=controls,
        config=config,
        help_text=_DRAG_HELP.format(home="back to the first start"),
        extra='<p class="gldm-compare"></p>',
    )


def norm_ball_html(
    gradient: Sequence[float] = (-6.8474, 2.2039),
    max_norm: float = 3.0,
    extent: float = 8.0,
    mode: str = "clip",
    uid: str | None = None,
) -> DirectHTML:
    r"""Clip by norm in 2-D: drag the gradient's tip, see it projected onto the τ-ball.

    ``gradient`` defaults to :func:`gradlab_book.figures.clipping.example_gradient_2d`,
    rounded to four decimals (a draggable start, not a reference value).
    Modes: ``"clip"`` (:func:`gradlab.clip_grad_norm_`, :math:`g \leftarrow \gamma g`)
    and ``"zero"`` (:func:`gradlab.grad_ignore_norm_`).
    """
    gradient = _vector2("gradient", gradient)
    extent = _positive("extent", extent)
    uid = _uid("normball", uid)
    modes = (
        ("clip", "Clip by norm (clip_grad_norm_)", PALETTE["clip"], "none"),
        ("zero", "Zero it (grad_ignore_norm_)", PALETTE["ignore"], "7 4"),
    )
    controls = _modes(uid, "When ‖g‖₂ is over τ", modes, mode) + (
        '<div class="gldm-sliders">'
        + _slider(uid, "tau", "max_norm τ", 0.0, extent, extent / 16, max_norm, 2)
        + "</div>"
    )
    return _figure(
        "normball",
        uid,
        title="Clipping by norm is a projection onto a ball",
        caption=(
            "The plane of a two-entry gradient g. The shaded disc is the ball of radius τ. "
            "The black arrow is g, the coloured arrow what is left of it: scaled by "
            "γ = min(1, τ / (‖g‖₂ + 10⁻⁶)) onto the ball, keeping its direction, or "
            "zeroed when it lies outside."
        ),
        controls=controls,
        config={"view": extent, "g": gradient, "labels": {m[0]: m[1] for m in modes}},
        help_text=_DRAG_HELP.format(home="to the origin"),
    )


def value_cube_html(
    gradient: Sequence[float] = (-6.8474, 2.2039),
    clip_value: float = 3.0,
    extent: float = 8.0,
    mode: str = "clip",
    uid: str | None = None,
) -> DirectHTML:
    r"""Clip by value in 2-D: drag the gradient, see it clamped into the box (the l∞ ball).

    Modes: ``"clip"`` (:func:`gradlab.clip_grad_value_`, each entry clamped to
    :math:`[-c, c]`) and ``"zero"`` (:func:`gradlab.grad_ignore_value_`: every entry
    zeroed when :math:`\|g\|_\infty \ge c`). The norm-clipped gradient is drawn too,
    for the angle between the two.
    """
    gradient = _vector2("gradient", gradient)
    extent = _positive("extent", extent)
    uid = _uid("valuecube", uid)
    modes = (
        ("clip", "Clamp each entry (clip_grad_value_)", PALETTE["clip"], "none"),
        ("zero", "Zero it (grad_ignore_value_)", PALETTE["ignore"], "7 4"),
    )
    controls = _modes(uid, "When an entry reaches c", modes, mode) + (
        '<div class="gldm-sliders">'
        + _slider(uid, "tau", "clip_value c", 0.0, extent, extent / 16, clip_value, 2)
        + "</div>"
    )
    return _figure(
        "valuecube",
        uid,
        title="Clipping by value is a projection onto a box",
        caption=(
            "The plane of a two-entry gradient g. The shaded square is the box "
            "|g1| ≤ c, |g2| ≤ c, the ball of the ∞-norm. The black arrow is g, the "
            "coloured arrow what is left of it: each entry clamped into [−c, c], which "
            "can turn it, or every entry zeroed once one reaches c. The grey arrowhead "
            "on g marks clipping by norm with the same threshold, which keeps the direction."
        ),
        controls=controls,
        config={"view": extent, "g": gradient, "labels": {m[0]: m[1] for m in modes}},
        help_text=_DRAG_HELP.format(home="to the origin"),
    )


_UNIT_PS = (1.0, 1.5, 2.0, 3.0, 4.0, 8.0, math.inf)


def unit_balls_html(
    point: Sequence[float] = (-2.5609, 0.4711),
    p: float = 2.0,
    ps: Sequence[float] = _UNIT_PS,
    extent: float | None = None,
    uid: str | None = None,
) -> DirectHTML:
    r"""The unit balls of several p-norms; drag a point, read off all its p-norms.

    ``point`` defaults to :func:`gradlab_book.figures.norms.real_gradient_2d`, rounded
    to four decimals (its last float32 bits depend on the CPU's kernels). For each
    p of ``ps`` (positive, ``math.inf`` allowed) the figure shows
    :math:`\|v\|_p = (|v_1|^p + |v_2|^p)^{1/p}` (:math:`\max_i |v_i|` for
    :math:`p = \infty`), and for the chosen p the sphere :math:`\|w\|_p = \|v\|_p`
    through v and the point :math:`v / \|v\|_p` on the unit ball.
    """
    point = _vector2("point", point)
    values = [float(q) for q in ps]
    if not values or any(math.isnan(q) or q <= 0 for q in values):
        raise ValueError(f"ps must be positive numbers or inf, got {ps!r}")
    if float(p) not in values:
        raise ValueError(f"p={p!r} is not one of ps={values!r}")
    if extent is None:
        extent = max(1.5, 1.25 * max(abs(x) for x in point))
    extent = _positive("extent", extent)
    uid = _uid("unitballs", uid)
    names = ["inf" if math.isinf(q) else f"{q:g}" for q in values]
    modes = [(name, "p = ∞" if name == "inf" else f"p = {name}", "", "none") for name in names]
    chosen = "inf" if math.isinf(float(p)) else f"{float(p):g}"
    rows = "".join(
        f'<tr data-p="{name}"><th scope="row">{label}</th><td class="gldm-norm">–</td></tr>'
        for name, label, _, _ in modes
    )
    table = (
        '<table class="gldm-table"><caption>The p-norms of v</caption>'
        f'<thead><tr><th scope="col">p</th><th scope="col">‖v‖ₚ</th></tr></thead>'
        f"<tbody>{rows}</tbody></table>"
    )
    return _figure(
        "unitballs",
        uid,
        title="Unit balls of the p-norms, and the p-norms of a point",
        caption=(
            "The plane, with the unit ball ‖w‖ₚ = 1 of each p drawn as a thin grey "
            "curve: a diamond for p = 1, a circle for p = 2, a square for p = ∞. The "
            "chosen p's ball is blue. The orange curve is the sphere of that p-norm "
            "through the point v, and the diamond marks v / ‖v‖ₚ on the unit ball."
        ),
        controls=_modes(uid, "Which p", modes, chosen),
        config={"view": extent, "v": point, "ps": names},
        help_text=_DRAG_HELP.format(home="to the origin"),
        extra=table,
    )


def write_hero(path: Path) -> Path:
    """Write the introduction's hero figure (``cliff_html`` with a fixed id) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(cliff_html(uid="gldm-cliff-hero")) + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- CSS + JS

_CSS = """
.gldm{color-scheme:light;background:#fff;color:#222;border:1px solid #ccc;border-radius:4px;
padding:.6em .8em;margin:.5em 0 1em;max-width:100%;box-sizing:border-box;font-size:.95rem;
line-height:1.4}
.gldm *{box-sizing:border-box}
.gldm p{margin:.3em 0}
.gldm .gldm-title{font-weight:600;margin-top:0}
.gldm .gldm-caption,.gldm .gldm-help{font-size:.85em;color:#444}
.gldm .gldm-controls{display:flex;flex-wrap:wrap;gap:.3em 1.5em;align-items:flex-start}
.gldm fieldset.gldm-modes{border:0;margin:0;padding:0;display:flex;flex-wrap:wrap;gap:.1em 1em;
min-width:0}
.gldm fieldset.gldm-modes legend{font-size:.85em;color:#444;padding:0;float:left;width:100%}
.gldm .gldm-mode{display:inline-flex;align-items:center;gap:.35em;cursor:pointer;
white-space:nowrap}
.gldm .gldm-mode input{margin:0;accent-color:#0072B2}
.gldm .gldm-sliders{display:flex;flex-direction:column;gap:.1em}
.gldm .gldm-slider{display:flex;align-items:center;gap:.5em;font-size:.9em;flex-wrap:wrap}
.gldm .gldm-slider-name{min-width:8.5em}
.gldm input[type=range]{width:12em;max-width:100%;accent-color:#0072B2}
.gldm .gldm-value{font-family:monospace;min-width:3.5em}
.gldm .gldm-stage{margin:.4em 0}
.gldm svg.gldm-svg{display:block;width:100%;height:auto;touch-action:none;user-select:none;
-webkit-user-select:none;background:#fff}
.gldm-normball svg.gldm-svg,.gldm-valuecube svg.gldm-svg,.gldm-unitballs svg.gldm-svg{
max-width:26em;margin:0 auto}
.gldm svg text{font-family:sans-serif;fill:#222}
.gldm .gldm-handle{cursor:grab;outline:none}
.gldm .gldm-handle:focus-visible .gldm-ring{stroke:#000;stroke-width:2.5;stroke-dasharray:3 2}
.gldm .gldm-ring{fill:none;stroke:none}
.gldm .gldm-readout{font-size:.92em;min-height:2.8em}
.gldm .gldm-compare{font-size:.85em;color:#333}
.gldm .gldm-compare span{display:inline-block;white-space:nowrap;margin-right:.9em}
.gldm table.gldm-table{border-collapse:collapse;font-size:.88em;margin:.3em auto}
.gldm table.gldm-table caption{caption-side:top;color:#444;font-size:.95em}
.gldm table.gldm-table th,.gldm table.gldm-table td{padding:.1em .8em;border-bottom:1px solid #ddd;
text-align:right;color:#222;background:#fff}
.gldm table.gldm-table tr.gldm-chosen th,.gldm table.gldm-table tr.gldm-chosen td{
background:#dbeaf5;font-weight:600}
@media (max-width:500px){.gldm .gldm-slider-name{min-width:0;width:100%}
.gldm input[type=range]{width:auto;flex:1 1 8em;min-width:0}.gldm .gldm-slider{width:100%}
.gldm .gldm-controls{display:block}}
""".strip().replace("\n", "")

# Shared by every figure: SVG elements, number formatting, a plot frame, dragging a
# point with the pointer or the keyboard, a polite live region. No globals but
# window.GradlabDirect; safe to load more than once.
_CORE_JS = r"""
(function () {
  'use strict';
  var GD = window.GradlabDirect = window.GradlabDirect || {};
  var NS = 'http://www.w3.org/2000/svg';
  GD.el = function (tag, attrs, parent) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) {
      if (attrs[k] !== undefined && attrs[k] !== null) { e.setAttribute(k, attrs[k]); }
    }
    if (parent) { parent.appendChild(e); }
    return e;
  };
  // A number for people: fixed digits, Unicode minus, no "-0".
  GD.num = function (x, digits) {
    if (x !== x) { return 'NaN'; }
    if (!isFinite(x)) { return x > 0 ? '∞' : '−∞'; }
    var a = Math.abs(x);
    var s = (a !== 0 && (a >= 1e5 || a < Math.pow(10, -digits))) ?
      x.toExponential(2) : x.toFixed(digits);
    if (/^-0(\.0+)?$/.test(s)) { s = s.slice(1); }
    return s.replace('-', '−');
  };
  GD.sig = function (x) {  // three significant digits
    if (x !== x || !isFinite(x)) { return GD.num(x, 2); }
    var a = Math.abs(x);
    if (a === 0) { return '0'; }
    if (a >= 1e5 || a < 1e-3) { return GD.num(x, 2); }
    return GD.num(x, Math.max(0, 2 - Math.floor(Math.log10(a))));
  };
  GD.pair = function (v, digits) {
    return '(' + GD.num(v[0], digits) + ', ' + GD.num(v[1], digits) + ')';
  };
  GD.config = function (root) {
    return JSON.parse(root.querySelector('script.gldm-config').textContent);
  };
  // A rectangle of the SVG (viewBox units) showing data coordinates view.
  GD.frame = function (svg, box, view) {
    var f = {box: box, view: view};
    f.sx = function (x) { return box.x + (x - view.x0) / (view.x1 - view.x0) * box.w; };
    f.sy = function (y) { return box.y + (view.y1 - y) / (view.y1 - view.y0) * box.h; };
    f.fromEvent = function (ev) {
      var pt = svg.createSVGPoint();
      pt.x = ev.clientX; pt.y = ev.clientY;
      var q = pt.matrixTransform(svg.getScreenCTM().inverse());
      return [view.x0 + (q.x - box.x) / box.w * (view.x1 - view.x0),
              view.y1 - (q.y - box.y) / box.h * (view.y1 - view.y0)];
    };
    f.inside = function (p) {
      return p[0] >= view.x0 && p[0] <= view.x1 && p[1] >= view.y0 && p[1] <= view.y1;
    };
    f.clamp = function (p) {
      return [Math.min(view.x1, Math.max(view.x0, p[0])),
              Math.min(view.y1, Math.max(view.y0, p[1]))];
    };
    return f;
  };
  GD.axes = function (svg, f, ticks, labels) {
    var g = GD.el('g', {'aria-hidden': 'true'}, svg), v = f.view, b = f.box;
    GD.el('rect', {x: b.x, y: b.y, width: b.w, height: b.h, fill: 'none', stroke: '#888',
                   'stroke-width': 1, 'class': 'gldm-plotarea'}, g);
    ticks.x.forEach(function (t) {
      GD.el('line', {x1: f.sx(t), x2: f.sx(t), y1: b.y + b.h, y2: b.y + b.h + 4,
                     stroke: '#555'}, g);
      GD.el('text', {x: f.sx(t), y: b.y + b.h + 16, 'text-anchor': 'middle',
                     'font-size': 11}, g).textContent = GD.num(t, 0);
    });
    ticks.y.forEach(function (t) {
      GD.el('line', {x1: b.x - 4, x2: b.x, y1: f.sy(t), y2: f.sy(t), stroke: '#555'}, g);
      GD.el('text', {x: b.x - 7, y: f.sy(t) + 4, 'text-anchor': 'end',
                     'font-size': 11}, g).textContent = GD.num(t, 0);
    });
    GD.el('text', {x: b.x + b.w - 5, y: b.y + b.h - 6, 'text-anchor': 'end',
                   'font-size': 13, 'font-style': 'italic'}, g).textContent = labels[0];
    GD.el('text', {x: b.x + 5, y: b.y + 15, 'text-anchor': 'start',
                   'font-size': 13, 'font-style': 'italic'}, g).textContent = labels[1];
    if (v.x0 < 0 && v.x1 > 0 && ticks.origin) {
      GD.el('line', {x1: f.sx(0), x2: f.sx(0), y1: b.y, y2: b.y + b.h, stroke: '#bbb'}, g);
    }
    if (v.y0 < 0 && v.y1 > 0 && ticks.origin) {
      GD.el('line', {x1: b.x, x2: b.x + b.w, y1: f.sy(0), y2: f.sy(0), stroke: '#bbb'}, g);
    }
    return g;
  };
  // The white draggable dot. Its accessible name is set by the figure (setLabel).
  GD.handle = function (svg, label) {
    // role=application: a screen reader passes the arrow keys through to the point.
    var g = GD.el('g', {'class': 'gldm-handle', tabindex: 0, role: 'application',
                        'aria-roledescription': 'draggable point', 'aria-label': label}, svg);
    GD.el('circle', {r: 13, 'class': 'gldm-ring'}, g);
    GD.el('circle', {r: 8, fill: '#fff', stroke: '#000', 'stroke-width': 2}, g);
    g.place = function (x, y) { g.setAttribute('transform', 'translate(' + x + ',' + y + ')'); };
    return g;
  };
  // Pointer drag anywhere in the frame, arrow keys on the focused handle.
  // opts: get() -> [x, y]; set([x, y], how) with how 'drag' | 'end' | 'key'; step; grid;
  // home, where the Home key puts the point.
  GD.drag = function (svg, f, handle, opts) {
    var inv = Math.round(1 / opts.grid), dragging = false;
    function snap(p) {
      p = f.clamp(p);
      return [Math.round(p[0] * inv) / inv, Math.round(p[1] * inv) / inv];
    }
    svg.addEventListener('pointerdown', function (ev) {
      if (ev.button !== 0) { return; }
      var p = f.fromEvent(ev);
      if (!f.inside(p)) { return; }
      ev.preventDefault();
      dragging = true;
      try { svg.setPointerCapture(ev.pointerId); } catch (e) { /* synthetic events */ }
      handle.focus({preventScroll: true, focusVisible: false});
      opts.set(snap(p), 'drag');
    });
    svg.addEventListener('pointermove', function (ev) {
      if (dragging) { opts.set(snap(f.fromEvent(ev)), 'drag'); }
    });
    function end() {
      if (dragging) { dragging = false; opts.set(opts.get(), 'end'); }
    }
    svg.addEventListener('pointerup', end);
    svg.addEventListener('pointercancel', end);
    svg.addEventListener('lostpointercapture', end);
    handle.addEventListener('keydown', function (ev) {
      if (ev.key === 'Home') {
        ev.preventDefault();
        opts.set(snap(opts.home.slice()), 'key');
        return;
      }
      var d = ev.shiftKey ? 10 * opts.step : opts.step;
      var move = {ArrowLeft: [-d, 0], ArrowRight: [d, 0], ArrowUp: [0, d],
                  ArrowDown: [0, -d]}[ev.key];
      if (!move) { return; }
      ev.preventDefault();
      var p = opts.get();
      opts.set(snap([p[0] + move[0], p[1] + move[1]]), 'key');
    });
  };
  // The live region: written at once after a key or the end of a drag, and at most
  // every 600 ms while dragging, so a screen reader is not flooded.
  GD.announcer = function (el) {
    var timer = null, pending = null;
    return function (text, how) {
      pending = text;
      if (how === 'drag') {
        if (timer === null) {
          timer = setTimeout(function () { timer = null; el.textContent = pending; }, 600);
        }
        return;
      }
      if (timer !== null) { clearTimeout(timer); timer = null; }
      el.textContent = text;
    };
  };
  // Range inputs with data-param, their <output>, and the radio buttons of the mode.
  GD.controls = function (root, onchange) {
    var sliders = {};
    root.querySelectorAll('input[type=range][data-param]').forEach(function (input) {
      var out = input.parentElement.querySelector('output');
      var digits = Number(input.getAttribute('data-digits'));
      sliders[input.getAttribute('data-param')] = input;
      input.addEventListener('input', function () {
        var text = Number(input.value).toFixed(digits);
        out.textContent = text;
        input.setAttribute('aria-valuetext', text);
        onchange('key');
      });
    });
    var radios = root.querySelectorAll('input[type=radio]');
    radios.forEach(function (r) {
      r.addEventListener('change', function () { onchange('key'); });
    });
    return {
      value: function (name) { return parseFloat(sliders[name].value); },
      mode: function () {
        for (var i = 0; i < radios.length; i++) {
          if (radios[i].checked) { return radios[i].value; }
        }
        return radios.length ? radios[0].value : null;
      }
    };
  };
  GD.setData = function (root, data) {
    for (var k in data) { root.setAttribute('data-' + k, typeof data[k] === 'string' ?
      data[k] : JSON.stringify(data[k])); }
  };
  GD.arrow = function (parent, f, from, to, colour, width, dash) {
    var x1 = f.sx(from[0]), y1 = f.sy(from[1]), x2 = f.sx(to[0]), y2 = f.sy(to[1]);
    var dx = x2 - x1, dy = y2 - y1, len = Math.sqrt(dx * dx + dy * dy);
    var g = GD.el('g', {}, parent);
    if (len < 1.5) {
      GD.el('circle', {cx: x1, cy: y1, r: width + 2.5, fill: colour}, g);
      return g;
    }
    var head = Math.min(12, 0.5 * len), ux = dx / len, uy = dy / len;
    GD.el('line', {x1: x1, y1: y1, x2: x2 - ux * head * 0.8, y2: y2 - uy * head * 0.8,
                   stroke: colour, 'stroke-width': width, 'stroke-dasharray': dash || 'none'}, g);
    var w = head * 0.45;
    GD.el('path', {d: 'M' + x2 + ',' + y2 + 'L' + (x2 - ux * head - uy * w) + ',' +
                   (y2 - uy * head + ux * w) + 'L' + (x2 - ux * head + uy * w) + ',' +
                   (y2 - uy * head - ux * w) + 'Z', fill: colour}, g);
    return g;
  };
})();
"""

_CLIFF_JS = r"""
(function () {
  'use strict';
  var GD = window.GradlabDirect;
  GD.cliff = function (root) {
    var cfg = GD.config(root), S = cfg.surface, EPS = cfg.eps, V = cfg.view;
    // The loss and its gradient, in closed form (see gradlab_book.direct.CLIFF_SURFACE).
    function lossGrad(x, y) {
      var u = x - S.x0, v = y - S.y0, z = S.k * (x - S.c - S.s * y);
      var sg = 1 / (1 + Math.exp(-z)), d = S.H * S.k * sg * (1 - sg);
      return [0.5 * S.a * u * u + 0.5 * S.b * v * v + S.H * sg, S.a * u + d, S.b * v - S.s * d];
    }
    // torch.optim.SGD (momentum mu, no dampening) after the chosen control.
    function run(start, mode, tau, lr, mu, n) {
      var x = start[0], y = start[1], bx = 0, by = 0, path = [[x, y]], dec = '';
      var counts = {kept: 0, clipped: 0, zeroed: 0, skipped: 0}, maxNorm = 0, lastMove = 0;
      for (var t = 0; t < n; t++) {
        var lg = lossGrad(x, y), gx = lg[1], gy = lg[2];
        var norm = Math.sqrt(gx * gx + gy * gy);
        var keep = tau / (norm + EPS) >= 1;  // gradlab: kept iff clipping would not rescale
        maxNorm = Math.max(maxNorm, norm);
        if (mode === 'skip' && !keep) {  // StepGuard(mode="skip"): nothing changes
          counts.skipped++; dec += 's'; path.push([x, y]); continue;
        }
        if (mode === 'clip') {  // clip_grad_norm_: g *= min(1, tau / (norm + eps))
          var coef = Math.min(1, tau / (norm + EPS));
          gx = gx * coef; gy = gy * coef;
          if (keep) { counts.kept++; dec += 'k'; } else { counts.clipped++; dec += 'c'; }
        } else if (mode === 'zero' && !keep) {  // grad_ignore_norm_: g = 0, step still taken
          gx = 0; gy = 0; counts.zeroed++; dec += 'z';
        } else { counts.kept++; dec += 'k'; }
        bx = mu * bx + gx; by = mu * by + gy;
        x = x - lr * bx; y = y - lr * by;
        path.push([x, y]);
        lastMove = t + 1;
      }
      return {path: path, dec: dec, counts: counts, loss: lossGrad(x, y)[0], final: [x, y],
              maxNorm: maxNorm, lastMove: lastMove};
    }

    var svg = root.querySelector('svg.gldm-svg');
    // A narrow page (a phone) gets fewer viewBox units, so the text stays readable.
    var W = root.clientWidth && root.clientWidth < 560 ? 420 : 640, H;
    var box = {x: 34, y: 14, w: W - 44, h: 0};
    box.h = box.w * (V.y1 - V.y0) / (V.x1 - V.x0);
    H = box.y + box.h + 24;
    svg.setAttribute('viewBox', '0 0 ' + W + ' ' + H);
    svg.setAttribute('role', 'group');
    svg.setAttribute('aria-label', 'Loss surface with a cliff and four trajectories');
    var f = GD.frame(svg, box, V);
    var clipId = root.id + '-clip';
    var defs = GD.el('defs', {}, svg);
    var cp = GD.el('clipPath', {id: clipId}, defs);
    GD.el('rect', {x: box.x, y: box.y, width: box.w, height: box.h}, cp);

    // The surface, drawn once: bands of log(1 + L), light to dark.
    var NX = 560, NY = Math.round(NX * box.h / box.w), canvas = document.createElement('canvas');
    canvas.width = NX; canvas.height = NY;
    var ctx = canvas.getContext('2d'), img = ctx.createImageData(NX, NY), top = Math.log1p(8);
    var lo = [250, 251, 252], hi = [120, 146, 168], bands = 12;
    for (var j = 0; j < NY; j++) {
      for (var i = 0; i < NX; i++) {
        var px = V.x0 + (i + 0.5) / NX * (V.x1 - V.x0), py = V.y1 - (j + 0.5) / NY * (V.y1 - V.y0);
        var level = Math.min(bands - 1, Math.floor(Math.log1p(lossGrad(px, py)[0]) / top * bands));
        var tt = level / (bands - 1), o = 4 * (j * NX + i);
        for (var c = 0; c < 3; c++) { img.data[o + c] = Math.round(lo[c] + tt * (hi[c] - lo[c])); }
        img.data[o + 3] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
    GD.el('image', {x: box.x, y: box.y, width: box.w, height: box.h, preserveAspectRatio: 'none',
                    href: canvas.toDataURL('image/png'), 'aria-hidden': 'true'}, svg);
    // The cliff's centre line, theta1 = c + s theta2.
    var deco = GD.el('g', {'clip-path': 'url(#' + clipId + ')', 'aria-hidden': 'true'}, svg);
    GD.el('line', {x1: f.sx(S.c + S.s * V.y0), y1: f.sy(V.y0), x2: f.sx(S.c + S.s * V.y1),
                   y2: f.sy(V.y1), stroke: '#000', 'stroke-width': 1.2,
                   'stroke-dasharray': '5 4'}, deco);
    var lab = GD.el('text', {x: f.sx(S.c + S.s * 1.55) + 6, y: f.sy(1.55), 'font-size': 13,
                             'font-weight': 600}, deco);
    lab.textContent = 'cliff';
    GD.el('text', {x: f.sx(2.3), y: f.sy(1.0), 'font-size': 13, 'text-anchor': 'middle'},
          deco).textContent = 'plateau';
    GD.axes(svg, f, {x: [-4, -3, -2, -1, 0, 1, 2, 3], y: [-2, -1, 0, 1, 2]}, ['θ1', 'θ2']);
    var paths = GD.el('g', {'clip-path': 'url(#' + clipId + ')', 'aria-hidden': 'true'}, svg);
    var handle = GD.handle(svg, 'start point');

    var start = cfg.start.slice(), modes = cfg.modes;
    var say = GD.announcer(root.querySelector('.gldm-readout'));
    var compare = root.querySelector('.gldm-compare');
    var ctl = GD.controls(root, function (how) { update(how); });

    function polyline(parent, pts, attrs) {
      attrs.points = pts.map(function (p) {
        return f.sx(p[0]).toFixed(2) + ',' + f.sy(p[1]).toFixed(2);
      }).join(' ');
      attrs.fill = 'none';
      attrs['stroke-linejoin'] = 'round';
      return GD.el('polyline', attrs, parent);
    }
    function marker(parent, mode, p, size, colour) {
      var x = f.sx(p[0]), y = f.sy(p[1]), s = size;
      var d = {none: 'M' + (x - s) + ',' + (y - s) + 'h' + 2 * s + 'v' + 2 * s + 'h' + -2 * s + 'Z',
               clip: null,
               zero: 'M' + x + ',' + (y - 1.3 * s) + 'L' + (x + 1.2 * s) + ',' + (y + s) + 'L' +
                     (x - 1.2 * s) + ',' + (y + s) + 'Z',
               skip: 'M' + x + ',' + (y - 1.4 * s) + 'L' + (x + 1.4 * s) + ',' + y + 'L' + x + ',' +
                     (y + 1.4 * s) + 'L' + (x - 1.4 * s) + ',' + y + 'Z'}[mode];
      var a = {fill: colour, stroke: '#000', 'stroke-width': 1.2};
      if (d) { a.d = d; return GD.el('path', a, parent); }
      a.cx = x; a.cy = y; a.r = 1.2 * s;
      return GD.el('circle', a, parent);
    }
    function sentence(mode, r, tau, mu, n) {
      var c = r.counts, out;
      if (mode === 'none') {
        out = 'No control: all ' + n + ' steps taken; the largest gradient had norm ' +
          GD.sig(r.maxNorm) + '.';
      } else if (mode === 'clip') {
        out = 'Clip by norm: ' + c.clipped + ' of ' + n + ' gradients clipped to norm τ.';
      } else if (mode === 'zero') {
        out = 'Zero: ' + c.zeroed + ' of ' + n + ' gradients zeroed; ' + (mu > 0 ?
          'each zeroed step still moved the point, on momentum alone.' :
          'with μ = 0 a zeroed step does not move the point: the same as a skip.');
      } else {
        out = 'Skip: ' + c.skipped + ' of ' + n +
          ' steps skipped, parameters and momentum untouched.';
        if (c.skipped && r.lastMove < n) {
          out += ' From step ' + (r.lastMove + 1) + ' on, the same gradient came back every ' +
            'time, so it never moved again.';
        }
      }
      var away = r.path.some(function (p) { return !f.inside(p); });
      if (away) { out += ' It was thrown off the map.'; }
      return out;
    }
    function update(how) {
      var tau = ctl.value('tau'), lr = ctl.value('lr'), mu = ctl.value('momentum');
      var mode = ctl.mode(), n = cfg.steps, runs = {};
      modes.forEach(function (m) { runs[m] = run(start, m, tau, lr, mu, n); });
      while (paths.firstChild) { paths.removeChild(paths.firstChild); }
      modes.forEach(function (m) {
        if (m === mode) { return; }
        polyline(paths, runs[m].path, {stroke: cfg.colour[m], 'stroke-width': 1.6,
          'stroke-dasharray': cfg.dash[m], opacity: 0.75});
        marker(paths, m, runs[m].final, 4, cfg.colour[m]).setAttribute('opacity', 0.75);
      });
      var r = runs[mode];
      polyline(paths, r.path, {stroke: '#fff', 'stroke-width': 6, opacity: 0.9});
      polyline(paths, r.path, {stroke: cfg.colour[mode], 'stroke-width': 3.2,
        'stroke-dasharray': cfg.dash[mode]});
      r.path.forEach(function (p, t) {
        if (t > 0) {
          GD.el('circle', {cx: f.sx(p[0]), cy: f.sy(p[1]), r: 2.3, fill: cfg.colour[mode],
                           stroke: '#000', 'stroke-width': 0.5}, paths);
        }
      });
      marker(paths, mode, r.final, 6.5, cfg.colour[mode]);
      handle.place(f.sx(start[0]), f.sy(start[1]));
      var where = 'start ' + GD.pair(start, 2);
      handle.setAttribute('aria-label', 'start point ' + GD.pair(start, 2) +
        ': drag it, or use the arrow keys');
      var summary = where + ', ' + cfg.labels[mode].toLowerCase() + ', τ = ' + GD.num(tau, 2) +
        ', η = ' + GD.num(lr, 2) + ', μ = ' + GD.num(mu, 2) + ': ' + sentence(mode, r, tau, mu, n) +
        ' Final point ' + GD.pair(r.final, 2) + ', final loss ' + GD.sig(r.loss) + '.';
      say(summary, how);
      compare.textContent = '';
      var head = document.createElement('span');
      head.textContent = 'Final loss after ' + n + ' steps:';
      compare.appendChild(head);
      modes.forEach(function (m) {
        var s = document.createElement('span');
        s.textContent = cfg.labels[m].toLowerCase() + ' ' + GD.sig(runs[m].loss);
        if (m === mode) { s.style.fontWeight = '600'; }
        compare.appendChild(s);
      });
      GD.setData(root, {
        mode: mode, tau: String(tau), lr: String(lr), momentum: String(mu), steps: String(n),
        'start-x': String(start[0]), 'start-y': String(start[1]),
        'final-x': String(r.final[0]), 'final-y': String(r.final[1]),
        'final-loss': String(r.loss), decisions: r.dec, counts: r.counts, path: r.path,
        'final-losses': modes.reduce(function (acc, m) { acc[m] = runs[m].loss; return acc; }, {})
      });
    }
    GD.drag(svg, f, handle, {
      get: function () { return start.slice(); },
      set: function (p, how) { start = p; update(how); },
      step: 0.1, grid: 0.01, home: cfg.start
    });
    update('key');
    root.setAttribute('data-ready', 'true');
  };
})();
"""

# Shared by the norm ball and the value cube: a draggable gradient tip in a square plane.
_PLANE_JS = r"""
(function () {
  'use strict';
  var GD = window.GradlabDirect;
  GD.plane = function (root, cfg, labels) {
    var svg = root.querySelector('svg.gldm-svg'), E = cfg.view, S = 400;
    var box = {x: 38, y: 12, w: S - 50, h: S - 50};
    svg.setAttribute('viewBox', '0 0 ' + S + ' ' + (S - 50 + 12 + 24));
    svg.setAttribute('role', 'group');
    svg.setAttribute('aria-label', labels.svg);
    var f = GD.frame(svg, box, {x0: -E, x1: E, y0: -E, y1: E});
    var step = E > 4 ? 1 : 0.5, ticks = [];
    for (var t = -Math.floor(E / step) * step; t <= E + 1e-9; t += 2 * step) { ticks.push(t); }
    var shapes = GD.el('g', {'aria-hidden': 'true'}, svg);
    GD.axes(svg, f, {x: ticks, y: ticks, origin: true}, labels.axes);
    var arrows = GD.el('g', {'aria-hidden': 'true'}, svg);
    return {svg: svg, f: f, shapes: shapes, arrows: arrows,
            handle: GD.handle(svg, 'tip of g'), step: E / 40};
  };
})();
"""

_NORMBALL_JS = r"""
(function () {
  'use strict';
  var GD = window.GradlabDirect;
  GD.normball = function (root) {
    var cfg = GD.config(root), EPS = cfg.eps, P = cfg.palette;
    var pl = GD.plane(root, cfg, {svg: 'The gradient g, the ball of radius τ and what is left of g',
                                  axes: ['g1', 'g2']});
    var f = pl.f, g = cfg.g.slice(), say = GD.announcer(root.querySelector('.gldm-readout'));
    var ctl = GD.controls(root, function (how) { update(how); });
    function update(how) {
      var tau = ctl.value('tau'), mode = ctl.mode();
      var norm = Math.sqrt(g[0] * g[0] + g[1] * g[1]);
      var coef = Math.min(1, tau / (norm + EPS));  // gradlab.clip_grad_norm_
      var keep = tau / (norm + EPS) >= 1;          // gradlab.grad_ignore_norm_
      var out, decision;
      if (mode === 'clip') {
        out = [g[0] * coef, g[1] * coef]; decision = coef < 1 ? 'clipped' : 'kept';
      } else {
        out = keep ? [g[0], g[1]] : [0, 0]; decision = keep ? 'kept' : 'zeroed';
      }
      var colour = decision === 'kept' ? P.keep : (decision === 'clipped' ? P.clip : P.ignore);
      var sh = pl.shapes, ar = pl.arrows;
      while (sh.firstChild) { sh.removeChild(sh.firstChild); }
      while (ar.firstChild) { ar.removeChild(ar.firstChild); }
      var r = f.sx(tau) - f.sx(0);
      GD.el('circle', {cx: f.sx(0), cy: f.sy(0), r: r, fill: '#e6e6e6', stroke: '#555',
                       'stroke-width': 1.2}, sh);
      GD.arrow(ar, f, [0, 0], g, P.threshold, 2);
      if (decision === 'clipped') {  // the radial projection, dotted from g to its image
        GD.el('line', {x1: f.sx(g[0]), y1: f.sy(g[1]), x2: f.sx(out[0]), y2: f.sy(out[1]),
                       stroke: '#555', 'stroke-dasharray': '2 3'}, ar);
      }
      GD.arrow(ar, f, [0, 0], out, colour, decision === 'kept' ? 2.2 : 3.4,
               mode === 'zero' ? '7 4' : null);
      pl.handle.place(f.sx(g[0]), f.sy(g[1]));
      pl.handle.setAttribute('aria-label', 'tip of g ' + GD.pair(g, 2) +
        ': drag it, or use the arrow keys');
      var outNorm = Math.sqrt(out[0] * out[0] + out[1] * out[1]);
      var text = 'g = ' + GD.pair(g, 2) + ', ‖g‖₂ = ' + GD.num(norm, 3) + ', τ = ' +
        GD.num(tau, 2) + '. γ = min(1, τ / (‖g‖₂ + 10⁻⁶)) = ' + GD.num(coef, 4) + '. ';
      if (mode === 'clip') {
        text += decision === 'clipped' ? 'Clipped to ' + GD.pair(out, 2) + ', norm ' +
          GD.num(outNorm, 3) + ': the same direction, on the sphere of radius τ.' :
          'Inside the ball: kept as it is.';
      } else {
        text += keep ? 'Inside the ball: kept as it is.' :
          'Outside the ball: every entry zeroed, (0, 0).';
      }
      say(text, how);
      GD.setData(root, {mode: mode, tau: String(tau), g1: String(g[0]), g2: String(g[1]),
        norm: String(norm), coef: String(coef), out1: String(out[0]), out2: String(out[1]),
        decision: decision});
    }
    GD.drag(pl.svg, f, pl.handle, {get: function () { return g.slice(); },
      set: function (p, how) { g = p; update(how); }, step: pl.step, grid: 0.01,
      home: [0, 0]});
    update('key');
    root.setAttribute('data-ready', 'true');
  };
})();
"""

_VALUECUBE_JS = r"""
(function () {
  'use strict';
  var GD = window.GradlabDirect;
  function angle(u, v) {  // degrees, NaN for a zero vector (as gradlab_book's angle_between)
    var nu = Math.sqrt(u[0] * u[0] + u[1] * u[1]), nv = Math.sqrt(v[0] * v[0] + v[1] * v[1]);
    if (nu === 0 || nv === 0) { return NaN; }
    var c = (u[0] * v[0] + u[1] * v[1]) / (nu * nv);
    return Math.acos(Math.min(1, Math.max(-1, c))) * 180 / Math.PI;
  }
  GD.valuecube = function (root) {
    var cfg = GD.config(root), EPS = cfg.eps, P = cfg.palette;
    var pl = GD.plane(root, cfg, {svg: 'The gradient g, the box of half-width c and what is ' +
                                  'left of g', axes: ['g1', 'g2']});
    var f = pl.f, g = cfg.g.slice(), say = GD.announcer(root.querySelector('.gldm-readout'));
    var ctl = GD.controls(root, function (how) { update(how); });
    function clamp(x, c) { return Math.min(Math.max(x, -c), c); }
    function update(how) {
      var c = ctl.value('tau'), mode = ctl.mode();
      var inf = Math.max(Math.abs(g[0]), Math.abs(g[1]));
      var keep = inf < c;  // gradlab.grad_ignore_value_: kept iff max |g_i| < c
      var clamped = [clamp(g[0], c), clamp(g[1], c)];  // gradlab.clip_grad_value_
      var norm = Math.sqrt(g[0] * g[0] + g[1] * g[1]), coef = Math.min(1, c / (norm + EPS));
      var byNorm = [g[0] * coef, g[1] * coef];
      var out, decision;
      if (mode === 'clip') {
        out = clamped;
        decision = (clamped[0] !== g[0] || clamped[1] !== g[1]) ? 'clipped' : 'kept';
      } else {
        out = keep ? [g[0], g[1]] : [0, 0]; decision = keep ? 'kept' : 'zeroed';
      }
      var turned = angle(g, out);
      var colour = decision === 'kept' ? P.keep : (decision === 'clipped' ? P.clip : P.ignore);
      var sh = pl.shapes, ar = pl.arrows;
      while (sh.firstChild) { sh.removeChild(sh.firstChild); }
      while (ar.firstChild) { ar.removeChild(ar.firstChild); }
      GD.el('rect', {x: f.sx(-c), y: f.sy(c), width: f.sx(c) - f.sx(-c),
                     height: f.sy(-c) - f.sy(c), fill: '#e6e6e6', stroke: '#555',
                     'stroke-width': 1.2}, sh);
      GD.el('circle', {cx: f.sx(0), cy: f.sy(0), r: f.sx(c) - f.sx(0), fill: 'none',
                       stroke: '#888', 'stroke-dasharray': '3 3'}, sh);
      GD.arrow(ar, f, [0, 0], byNorm, '#555', 1.3, '4 3');
      GD.arrow(ar, f, [0, 0], g, P.threshold, 2);
      if (decision === 'clipped') {
        GD.el('line', {x1: f.sx(g[0]), y1: f.sy(g[1]), x2: f.sx(out[0]), y2: f.sy(out[1]),
                       stroke: '#555', 'stroke-dasharray': '2 3'}, ar);
      }
      GD.arrow(ar, f, [0, 0], out, colour, decision === 'kept' ? 2.2 : 3.4,
               mode === 'zero' ? '7 4' : null);
      pl.handle.place(f.sx(g[0]), f.sy(g[1]));
      pl.handle.setAttribute('aria-label', 'tip of g ' + GD.pair(g, 2) +
        ': drag it, or use the arrow keys');
      var text = 'g = ' + GD.pair(g, 2) + ', ‖g‖∞ = ' + GD.num(inf, 3) + ', c = ' +
        GD.num(c, 2) + '. ';
      if (mode === 'clip') {
        text += decision === 'clipped' ? 'Clamped to ' + GD.pair(out, 2) + ', turned by ' +
          GD.num(turned, 1) + '°; clipping by norm would give ' + GD.pair(byNorm, 2) +
          ', not turned.' : 'Inside the box: kept as it is.';
      } else {
        text += keep ? 'Every entry below c: kept as it is.' :
          'An entry reaches c: every entry zeroed, (0, 0).';
      }
      say(text, how);
      GD.setData(root, {mode: mode, tau: String(c), g1: String(g[0]), g2: String(g[1]),
        inf: String(inf), out1: String(out[0]), out2: String(out[1]), decision: decision,
        'norm1': String(byNorm[0]), 'norm2': String(byNorm[1]), angle: String(turned)});
    }
    GD.drag(pl.svg, f, pl.handle, {get: function () { return g.slice(); },
      set: function (p, how) { g = p; update(how); }, step: pl.step, grid: 0.01,
      home: [0, 0]});
    update('key');
    root.setAttribute('data-ready', 'true');
  };
})();
"""

_UNITBALLS_JS = r"""
(function () {
  'use strict';
  var GD = window.GradlabDirect;
  function pnorm(v, p) {  // (|v1|^p + |v2|^p)^(1/p); max |v_i| for p = inf
    if (p === Infinity) { return Math.max(Math.abs(v[0]), Math.abs(v[1])); }
    if (p === 1) { return Math.abs(v[0]) + Math.abs(v[1]); }
    if (p === 2) { return Math.sqrt(v[0] * v[0] + v[1] * v[1]); }
    return Math.pow(Math.pow(Math.abs(v[0]), p) + Math.pow(Math.abs(v[1]), p), 1 / p);
  }
  function ring(p, radius) {  // each direction divided by its own p-norm
    var pts = [];
    for (var i = 0; i <= 360; i++) {
      var t = i * Math.PI / 180, d = [Math.cos(t), Math.sin(t)], n = pnorm(d, p);
      pts.push([radius * d[0] / n, radius * d[1] / n]);
    }
    return pts;
  }
  GD.unitballs = function (root) {
    var cfg = GD.config(root), P = cfg.palette;
    var ps = cfg.ps.map(function (s) { return s === 'inf' ? Infinity : parseFloat(s); });
    var pl = GD.plane(root, cfg, {svg: 'Unit balls of several p-norms and a point v',
                                  axes: ['v1', 'v2']});
    var f = pl.f, v = cfg.v.slice(), say = GD.announcer(root.querySelector('.gldm-readout'));
    var ctl = GD.controls(root, function (how) { update(how); });
    var rows = root.querySelectorAll('table.gldm-table tbody tr');
    function line(parent, pts, attrs) {
      attrs.d = pts.map(function (p, i) {
        return (i ? 'L' : 'M') + f.sx(p[0]).toFixed(2) + ',' + f.sy(p[1]).toFixed(2);
      }).join('') + 'Z';
      return GD.el('path', attrs, parent);
    }
    function update(how) {
      var chosen = ctl.mode(), p = chosen === 'inf' ? Infinity : parseFloat(chosen);
      var norms = {}, sh = pl.shapes, ar = pl.arrows;
      ps.forEach(function (q, i) { norms[cfg.ps[i]] = pnorm(v, q); });
      var size = norms[chosen];
      while (sh.firstChild) { sh.removeChild(sh.firstChild); }
      while (ar.firstChild) { ar.removeChild(ar.firstChild); }
      ps.forEach(function (q) {
        if (q !== p) { line(sh, ring(q, 1), {fill: 'none', stroke: '#999', 'stroke-width': 1}); }
      });
      line(sh, ring(p, 1), {fill: P.keep, 'fill-opacity': 0.15, stroke: P.keep,
                            'stroke-width': 2.4});
      if (size > 0 && isFinite(size)) {
        line(sh, ring(p, size), {fill: 'none', stroke: P.clip, 'stroke-width': 2});
        var u = [v[0] / size, v[1] / size], x = f.sx(u[0]), y = f.sy(u[1]);
        GD.arrow(ar, f, [0, 0], v, P.threshold, 1.8);
        GD.el('path', {d: 'M' + x + ',' + (y - 7) + 'L' + (x + 7) + ',' + y + 'L' + x + ',' +
                       (y + 7) + 'L' + (x - 7) + ',' + y + 'Z', fill: P.clip, stroke: '#000'}, ar);
      }
      pl.handle.place(f.sx(v[0]), f.sy(v[1]));
      pl.handle.setAttribute('aria-label', 'point v ' + GD.pair(v, 2) +
        ': drag it, or use the arrow keys');
      rows.forEach(function (row) {
        var key = row.getAttribute('data-p');
        row.querySelector('td').textContent = GD.num(norms[key], 4);
        row.classList.toggle('gldm-chosen', key === chosen);
      });
      var label = chosen === 'inf' ? '∞' : chosen;
      say('v = ' + GD.pair(v, 2) + ': ‖v‖' + label + ' = ' + GD.num(size, 4) +
          (p === Infinity ? ', the largest |vᵢ|.' : ' = (|v1|^' + label + ' + |v2|^' + label +
          ')^(1/' + label + ').') + ' The diamond, v / ‖v‖, lies on the unit ball.', how);
      GD.setData(root, {p: chosen, v1: String(v[0]), v2: String(v[1]), norm: String(size),
                        norms: norms});
    }
    GD.drag(pl.svg, f, pl.handle, {get: function () { return v.slice(); },
      set: function (q, how) { v = q; update(how); }, step: pl.step, grid: 0.01,
      home: [0, 0]});
    update('key');
    root.setAttribute('data-ready', 'true');
  };
})();
"""

_MODULES = {
    "cliff": _CLIFF_JS,
    "normball": _PLANE_JS + _NORMBALL_JS,
    "valuecube": _PLANE_JS + _VALUECUBE_JS,
    "unitballs": _PLANE_JS + _UNITBALLS_JS,
}
