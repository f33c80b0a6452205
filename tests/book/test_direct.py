"""The direct-manipulation figures' HTML (gradlab_book.direct), without a browser.

The browser suite (tests/browser/test_direct_manipulation.py) drags them and checks their
numbers against gradlab; here: the HTML is well formed and self-contained, ids are unique
per figure and per call, the constants and formulas the JavaScript computes with are the
library's, bad arguments are refused, and the introduction's hero file is up to date.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from html.parser import HTMLParser

import pytest

import gradlab
from booktools import hero
from gradlab_book import direct, plots

VOID = {"input", "meta", "br", "img", "hr", "link", "source", "col", "wbr"}
# SVG children the Python side writes self-closed (<line .../>).
SELF_CLOSED = {"line", "circle", "path", "rect"}


class _Tree(HTMLParser):
    """Checks that every element is closed in order; collects ids, scripts and attributes."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.ids: list[str] = []
        self.errors: list[str] = []
        self.scripts: list[tuple[dict, str]] = []
        self.elements: list[tuple[str, dict]] = []
        self._script: dict | None = None

    def handle_starttag(self, tag, attrs) -> None:
        attrs = dict(attrs)
        self.elements.append((tag, attrs))
        if attrs.get("id"):
            self.ids.append(attrs["id"])
        if tag == "script":
            self._script = attrs
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs) -> None:
        attrs = dict(attrs)
        self.elements.append((tag, attrs))
        if attrs.get("id"):
            self.ids.append(attrs["id"])
        if tag not in VOID | SELF_CLOSED:
            self.errors.append(f"<{tag}/> self-closed")

    def handle_endtag(self, tag) -> None:
        if tag in VOID:
            self.errors.append(f"</{tag}> closes a void element")
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
            return
        self.stack.pop()

    def handle_data(self, data) -> None:
        if self._script is not None and self.stack and self.stack[-1] == "script":
            self.scripts.append((self._script, data))
            self._script = None


def parse(text: str) -> _Tree:
    tree = _Tree()
    tree.feed(text)
    tree.close()
    assert not tree.errors, tree.errors
    assert not tree.stack, f"unclosed elements: {tree.stack}"
    return tree


FIGURES = {
    "cliff": direct.cliff_html,
    "normball": direct.norm_ball_html,
    "valuecube": direct.value_cube_html,
    "unitballs": direct.unit_balls_html,
}


@pytest.mark.parametrize("kind", sorted(FIGURES))
def test_html_is_well_formed_and_self_contained(kind):
    text = FIGURES[kind]()
    assert isinstance(text, direct.DirectHTML) and isinstance(text, str)
    tree = parse(text)
    tag, attrs = tree.elements[0]
    assert tag == "div" and attrs["data-figure"] == kind and "gldm" in attrs["class"].split()
    # Nothing is loaded from anywhere: no src, no href, no @import.
    for tag, attrs in tree.elements:
        assert "src" not in attrs and "href" not in attrs, (tag, attrs)
    assert "@import" not in text and "url(http" not in text
    # One JSON configuration, one script that starts this very figure.
    configs = [body for attrs, body in tree.scripts if attrs.get("type") == "application/json"]
    assert len(configs) == 1
    config = json.loads(configs[0])
    code = [body for attrs, body in tree.scripts if "type" not in attrs]
    assert len(code) == 1
    uid = attrs_of(tree)["id"]
    start = f'window.GradlabDirect.{kind}(document.getElementById("{uid}")'
    assert code[0].rstrip().endswith(f"{start} || document.currentScript.parentElement);")
    assert "</script" not in code[0] and "</script" not in configs[0]
    assert config["eps"] == gradlab.clip.EPS == 1e-6


def attrs_of(tree: _Tree) -> dict:
    return tree.elements[0][1]


@pytest.mark.parametrize("kind", sorted(FIGURES))
def test_ids_are_unique_within_and_across_calls(kind):
    a, b = parse(FIGURES[kind]()), parse(FIGURES[kind]())
    assert len(a.ids) == len(set(a.ids)), a.ids
    assert not set(a.ids) & set(b.ids), "two calls share ids"
    root = attrs_of(a)["id"]
    assert all(i == root or i.startswith(root + "-") for i in a.ids)
    # Every reference to an id points into the same figure.
    for _, attrs in a.elements:
        for key in ("aria-labelledby", "aria-describedby", "for"):
            if key in attrs:
                assert attrs[key] in a.ids, (key, attrs[key])
    # Radio buttons of one figure share a name no other figure has.
    names = {attrs["name"] for tag, attrs in a.elements if attrs.get("type") == "radio"}
    assert names == {f"{root}-mode"}


def test_explicit_uid_and_bad_uid():
    tree = parse(direct.norm_ball_html(uid="my-ball"))
    assert attrs_of(tree)["id"] == "my-ball"
    for bad in ("1abc", "a b", 'x"y', ""):
        with pytest.raises((ValueError, IndexError)):
            direct.norm_ball_html(uid=bad)


def test_the_javascript_uses_the_librarys_formulas():
    core = direct._CORE_JS
    cliff = direct._CLIFF_JS
    # clip_grad_norm_: coefficient min(1, tau / (norm + eps)); grad_ignore_norm_: keep iff >= 1.
    assert "Math.min(1, tau / (norm + EPS))" in cliff
    assert "tau / (norm + EPS) >= 1" in cliff
    assert "Math.min(1, tau / (norm + EPS))" in direct._NORMBALL_JS
    assert "tau / (norm + EPS) >= 1" in direct._NORMBALL_JS
    # clip_grad_value_ clamps; grad_ignore_value_ keeps iff max |g_i| < c.
    assert "Math.min(Math.max(x, -c), c)" in direct._VALUECUBE_JS
    assert "var keep = inf < c;" in direct._VALUECUBE_JS
    # p-norms: (sum |x_i|^p)^(1/p), max |x_i| for p = inf.
    unit = direct._UNITBALLS_JS
    assert "Math.pow(Math.pow(Math.abs(v[0]), p) + Math.pow(Math.abs(v[1]), p), 1 / p)" in unit
    assert "Math.max(Math.abs(v[0]), Math.abs(v[1]))" in unit
    # SGD with momentum as torch.optim.SGD: b = mu b + g, theta -= lr b; skip leaves b alone.
    assert "bx = mu * bx + gx; by = mu * by + gy;" in cliff
    assert "x = x - lr * bx; y = y - lr * by;" in cliff
    assert cliff.index("if (mode === 'skip' && !keep)") < cliff.index("bx = mu * bx + gx")
    # The loss: a valley plus H * sigmoid(k (x - c - s y)), and its gradient.
    assert "S.k * (x - S.c - S.s * y)" in cliff and "S.H * S.k * sg * (1 - sg)" in cliff
    assert "GradlabDirect" in core and "setPointerCapture" in core and "keydown" in core


def test_constants_reach_the_page():
    config = json.loads(
        re.search(
            r'<script type="application/json" class="gldm-config">(.*?)</script>',
            direct.cliff_html(start=(1.0, -0.5), steps=40),
        ).group(1)
    )
    assert config["surface"] == direct.CLIFF_SURFACE
    assert config["start"] == [1.0, -0.5] and config["steps"] == 40
    assert config["eps"] == 1e-6
    # The wall is about ten times the default threshold: H k / 4 = 16.
    s = direct.CLIFF_SURFACE
    assert s["H"] * s["k"] / 4 == 16.0


def test_palette_is_the_books():
    assert direct.PALETTE == {
        "keep": plots.KEEP,
        "clip": plots.CLIP,
        "ignore": plots.IGNORE,
        "skip": plots.SKIP,
        "none": plots.NONE,
        "threshold": plots.THRESHOLD,
    }
    text = direct.cliff_html()
    for colour in ("#7F7F7F", "#E69F00", "#D55E00", "#CC79A7"):
        assert colour in text


def _default(function, name):
    return inspect.signature(function).parameters[name].default


# The defaults are the chapters' gradients rounded to four decimals: a float32 gradient's
# last bits depend on the CPU's kernels (issue 20), a rounding error is at most 5e-5.
ROUNDED = 5e-5 * (1 + 1e-9)


@pytest.mark.parametrize(
    ("function", "name", "gradient"),
    [
        (direct.norm_ball_html, "gradient", "clipping.example_gradient_2d"),
        (direct.value_cube_html, "gradient", "clipping.example_gradient_2d"),
        (direct.unit_balls_html, "point", "norms.real_gradient_2d"),
    ],
)
def test_defaults_are_the_chapters_gradients(function, name, gradient):
    from gradlab_book.figures import clipping, norms

    module, attribute = gradient.split(".")
    live = getattr({"clipping": clipping, "norms": norms}[module], attribute)
    default = _default(function, name)
    assert default == pytest.approx(list(live()), abs=ROUNDED)
    # the tolerance is one that a real change exceeds: the gradient of another seed
    assert default != pytest.approx(list(live(seed=1)), abs=ROUNDED)
    # and the figure starts at the default
    assert json.dumps([float(v) for v in default]) in function()


def test_sliders_start_where_asked():
    text = direct.cliff_html(max_norm=2.5, lr=0.05, momentum=0.5)
    tree = parse(text)
    values = {
        attrs["data-param"]: float(attrs["value"])
        for tag, attrs in tree.elements
        if tag == "input" and attrs.get("type") == "range"
    }
    assert values == {"tau": 2.5, "lr": 0.05, "momentum": 0.5}
    checked = [a["value"] for t, a in tree.elements if a.get("type") == "radio" and "checked" in a]
    assert checked == ["clip"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: direct.cliff_html(mode="ignore"), "mode"),
        (lambda: direct.cliff_html(max_norm=9.0), "outside"),
        (lambda: direct.cliff_html(start=(math.nan, 0.0)), "start"),
        (lambda: direct.cliff_html(start=(1.0,)), "start"),
        (lambda: direct.cliff_html(steps=0), "steps"),
        (lambda: direct.norm_ball_html(extent=-1.0), "extent"),
        (lambda: direct.value_cube_html(gradient=(1.0, math.inf)), "gradient"),
        (lambda: direct.unit_balls_html(p=5.0), "not one of"),
        (lambda: direct.unit_balls_html(ps=(0.0, 1.0), p=1.0), "ps"),
    ],
)
def test_bad_arguments_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_displays_as_html_in_a_notebook():
    fig = direct.value_cube_html()
    bundle = fig._repr_mimebundle_()
    assert bundle["text/html"] == str(fig)
    assert bundle["text/plain"] == "<gradlab direct figure: valuecube>"
    assert fig._repr_html_() == str(fig)
    assert repr(fig) == "<gradlab direct figure: valuecube>"


def test_unit_balls_offer_every_p():
    tree = parse(direct.unit_balls_html(p=math.inf))
    radios = [a for t, a in tree.elements if a.get("type") == "radio"]
    assert [a["value"] for a in radios] == ["1", "1.5", "2", "3", "4", "8", "inf"]
    assert [a["value"] for a in radios if "checked" in a] == ["inf"]
    rows = [a["data-p"] for t, a in tree.elements if t == "tr" and "data-p" in a]
    assert rows == ["1", "1.5", "2", "3", "4", "8", "inf"]


def test_hero_file_is_up_to_date():
    """book/intro.md includes this file; regenerate with `python -m booktools.hero`."""
    assert hero.HERO_PATH.is_file()
    expected = str(direct.cliff_html(uid="gldm-cliff-hero")) + "\n"
    assert hero.HERO_PATH.read_text(encoding="utf-8") == expected, (
        "book/_static/explorables/cliff.html is stale: run `python -m booktools.hero`"
    )
    intro = (hero.HERO_PATH.parents[2] / "intro.md").read_text(encoding="utf-8")
    assert ":file: _static/explorables/cliff.html" in intro


def test_write_hero(tmp_path):
    path = direct.write_hero(tmp_path / "x" / "cliff.html")
    assert path.read_text(encoding="utf-8").startswith('<div class="gldm gldm-cliff"')
