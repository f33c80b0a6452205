"""Figures the reader can hold: live in a kernel, precomputed on the published page.

A figure function is a pure function from keyword parameters to a matplotlib
:class:`~matplotlib.figure.Figure`. :func:`explore` wraps one with a grid of values
for each control and displays as

* an ipywidgets panel in a running kernel (JupyterLab, Colab, Binder): each move of
  a slider calls the figure function again on real gradients; and
* a self-contained HTML figure with range sliders over the same grid, every frame
  rendered ahead of time, for the static book where no Python runs.

Both come from the same figure function, so the two cannot disagree.
"""

from __future__ import annotations

import base64
import html
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from matplotlib.figure import Figure

from gradlab_book.plots import png_bytes

__all__ = ["Control", "Explorable", "explore"]

FigureFunction = Callable[..., Figure]

# Keeps a page well under its 5 MB budget even with two explorable figures on it.
MAX_FRAMES = 60


@dataclass(frozen=True)
class Control:
    """One knob of an explorable figure.

    Args:
        name: the keyword argument of the figure function it sets.
        values: the grid of values the reader can pick from (at least one).
        label: what the slider is called on the page (defaults to ``name``).
        default: the value shown first; must be in ``values`` (defaults to the
            middle of the grid).
        fmt: a format string for showing a value, e.g. ``"{:.2f}"``.
    """

    name: str
    values: Sequence[Any]
    label: str = ""
    default: Any = None
    fmt: str = "{}"

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"name must be a Python identifier, got {self.name!r}")
        values = tuple(self.values)
        if not values:
            raise ValueError(f"values of control {self.name!r} must not be empty")
        object.__setattr__(self, "values", values)
        if self.default is not None and self.default not in values:
            raise ValueError(f"default {self.default!r} of control {self.name!r} not in values")

    @property
    def default_index(self) -> int:
        if self.default is None:
            return (len(self.values) - 1) // 2
        return self.values.index(self.default)

    @property
    def text(self) -> str:
        return self.label or self.name

    def show(self, value: Any) -> str:
        return self.fmt.format(value)


@dataclass
class Explorable:
    """A figure function with a grid of values for each of its controls."""

    figure_fn: FigureFunction
    controls: tuple[Control, ...]
    fixed: dict[str, Any] = field(default_factory=dict)
    alt: str = ""
    dpi: int = 96
    _frames: dict[tuple[int, ...], bytes] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        names = [c.name for c in self.controls]
        if len(set(names)) != len(names):
            raise ValueError(f"controls must have distinct names, got {names}")
        if overlap := set(names) & set(self.fixed):
            raise ValueError(f"parameters {sorted(overlap)} are both fixed and controlled")
        if self.frame_count > MAX_FRAMES:
            raise ValueError(
                f"{self.frame_count} frames is more than {MAX_FRAMES}; use coarser grids"
            )

    @property
    def frame_count(self) -> int:
        count = 1
        for control in self.controls:
            count *= len(control.values)
        return count

    def params_at(self, index: Sequence[int]) -> dict[str, Any]:
        """The keyword arguments of the figure at grid position ``index``."""
        params = dict(self.fixed)
        for control, i in zip(self.controls, index, strict=True):
            params[control.name] = control.values[i]
        return params

    def figure_at(self, index: Sequence[int]) -> Figure:
        return self.figure_fn(**self.params_at(index))

    def frame(self, index: Sequence[int]) -> bytes:
        """The PNG of the figure at grid position ``index`` (rendered once, then cached)."""
        key = tuple(index)
        if key not in self._frames:
            self._frames[key] = png_bytes(self.figure_at(key), dpi=self.dpi)
        return self._frames[key]

    def indices(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*(range(len(c.values)) for c in self.controls)))

    @property
    def default_index(self) -> tuple[int, ...]:
        return tuple(c.default_index for c in self.controls)

    @property
    def base_alt(self) -> str:
        """What the figure shows, without the values of its controls."""
        return self.alt or self.figure_fn.__name__.replace("_", " ")

    def alt_at(self, index: Sequence[int]) -> str:
        """The text alternative of the frame at ``index``: what the figure shows and where
        each control stands, e.g. ``"Loss curves (max_norm = 1.0, seed = 3)."``. The page's
        script writes the same text when a slider moves."""
        where = ", ".join(
            f"{c.text} = {c.show(c.values[i])}" for c, i in zip(self.controls, index, strict=True)
        )
        return f"{self.base_alt.rstrip('.')} ({where})." if where else self.base_alt

    # ------------------------------------------------------------------ static page

    def to_html(self) -> str:
        """A self-contained HTML figure: range sliders over precomputed frames."""
        frames = {
            "-".join(map(str, index)): base64.b64encode(self.frame(index)).decode("ascii")
            for index in self.indices()
        }
        first = "-".join(map(str, self.default_index))
        rows = []
        for control in self.controls:
            labels = json.dumps([control.show(v) for v in control.values])
            shown = html.escape(control.show(control.values[control.default_index]))
            rows.append(
                '<label class="gradlab-control">'
                f'<span class="gradlab-control-name">{html.escape(control.text)}</span> '
                f'<input type="range" min="0" max="{len(control.values) - 1}" step="1" '
                f'value="{control.default_index}" data-control="{control.name}" '
                f"data-labels='{html.escape(labels, quote=True)}' "
                f'aria-label="{html.escape(control.text)}" aria-valuetext="{shown}"> '
                f'<output class="gradlab-control-value">{shown}</output>'
                "</label>"
            )
        alt = html.escape(self.base_alt)
        return (
            '<div class="gradlab-explorable" role="group" '
            f'aria-label="{alt}" style="background:#fff;color:#222;'
            'padding:0.5em;border-radius:4px;max-width:100%">'
            f'<div class="gradlab-controls">{"".join(rows)}</div>'
            f'<img class="gradlab-frame" alt="{html.escape(self.alt_at(self.default_index))}" '
            f'data-alt="{alt}" style="max-width:100%" '
            f'src="data:image/png;base64,{frames[first]}">'
            f'<script type="application/json" class="gradlab-frames">{json.dumps(frames)}'
            "</script>"
            f"<script>{_PLAYER_JS}</script>"
            "</div>"
        )

    # ------------------------------------------------------------------- live kernel

    def widget(self):
        """An ipywidgets panel that recomputes the figure on every move.

        The figure is an ``ipywidgets.Image`` whose bytes are replaced, so nothing is
        printed into the cell: the panel behaves the same in every frontend.
        """
        import ipywidgets as widgets

        sliders = {
            c.name: widgets.SelectionSlider(
                options=[(c.show(v), i) for i, v in enumerate(c.values)],
                value=c.default_index,
                description=c.text,
                continuous_update=False,
                style={"description_width": "initial"},
                layout=widgets.Layout(width="28em"),
            )
            for c in self.controls
        }
        image = widgets.Image(value=self.frame(self.default_index), format="png")

        def redraw(_change) -> None:
            image.value = self.frame(tuple(sliders[c.name].value for c in self.controls))

        for slider in sliders.values():
            slider.observe(redraw, names="value")
        return widgets.VBox([*sliders.values(), image])

    def __repr__(self) -> str:
        knobs = ", ".join(f"{c.name} in {len(c.values)} values" for c in self.controls)
        return f"<explorable {self.figure_fn.__name__}: {knobs}>"

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, Any]:
        bundle: dict[str, Any] = {"text/plain": repr(self), "text/html": self.to_html()}
        if _in_kernel():
            live = self.widget()._repr_mimebundle_(include=include, exclude=exclude)
            bundle.update({k: v for k, v in live.items() if k != "text/plain"})
        return bundle


def explore(
    figure_fn: FigureFunction,
    *controls: Control,
    alt: str = "",
    dpi: int = 96,
    **fixed: Any,
) -> Explorable:
    """Make ``figure_fn`` explorable over the grids of ``controls``.

    Args:
        figure_fn: a pure function from keyword parameters to a Figure.
        *controls: one :class:`Control` per parameter the reader can move.
        alt: text alternative for the figure (screen readers, broken images).
        dpi: resolution of the precomputed frames.
        **fixed: further keyword arguments passed to every call of ``figure_fn``.

    Returns:
        An :class:`Explorable`; display it (make it a cell's last expression).
    """
    return Explorable(figure_fn, tuple(controls), fixed=fixed, alt=alt, dpi=dpi)


def _in_kernel() -> bool:
    """True inside a running IPython kernel that can host widgets."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


# Wires the sliders of the enclosing .gradlab-explorable to its frames. Written
# without globals or ids, so several figures can share a page.
_PLAYER_JS = r"""
(function () {
  var root = document.currentScript.parentElement;
  var frames = JSON.parse(root.querySelector('script.gradlab-frames').textContent);
  var img = root.querySelector('img.gradlab-frame');
  var inputs = Array.prototype.slice.call(root.querySelectorAll('input[data-control]'));
  var alt = img.getAttribute('data-alt') || img.alt;
  function update() {
    var key = inputs.map(function (el) { return el.value; }).join('-');
    img.src = 'data:image/png;base64,' + frames[key];
    var where = inputs.map(function (el) {
      var text = JSON.parse(el.getAttribute('data-labels'))[Number(el.value)];
      el.parentElement.querySelector('output').textContent = text;
      el.setAttribute('aria-valuetext', text);
      return el.getAttribute('aria-label') + ' = ' + text;
    });
    img.alt = where.length ? alt.replace(/\.$/, '') + ' (' + where.join(', ') + ').' : alt;
  }
  inputs.forEach(function (el) { el.addEventListener('input', update); });
})();
""".strip()
