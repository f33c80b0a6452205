"""The explorable-figure machinery: grids, frames, static HTML and the live panel."""

import base64
import io
import json
import re

import matplotlib.image
import numpy as np
import pytest

from gradlab_book.interactive import MAX_FRAMES, Control, explore
from gradlab_book.plots import new_figure, png_bytes, use_book_style


def line_figure(slope, offset=0.0):
    fig = new_figure(3, 2)
    ax = fig.add_subplot()
    ax.plot([0, 1], [offset, offset + slope])
    ax.set_ylim(-5, 5)
    return fig


def decode_png(data: bytes) -> np.ndarray:
    return matplotlib.image.imread(io.BytesIO(data), format="png")


def test_control_validates_its_arguments():
    with pytest.raises(ValueError, match="name"):
        Control("not an identifier", [1])
    with pytest.raises(ValueError, match="values"):
        Control("slope", [])
    with pytest.raises(ValueError, match="default"):
        Control("slope", [1, 2], default=3)


def test_control_default_is_the_middle_unless_given():
    assert Control("slope", [1, 2, 3]).default_index == 1
    assert Control("slope", [1, 2, 3, 4]).default_index == 1
    assert Control("slope", [1, 2, 3], default=3).default_index == 2


def test_explore_rejects_bad_grids():
    with pytest.raises(ValueError, match="distinct"):
        explore(line_figure, Control("slope", [1]), Control("slope", [2]))
    with pytest.raises(ValueError, match="fixed and controlled"):
        explore(line_figure, Control("slope", [1]), slope=2)
    too_many = list(range(MAX_FRAMES + 1))
    with pytest.raises(ValueError, match="frames"):
        explore(line_figure, Control("slope", too_many))


def test_frames_follow_the_grid_and_the_fixed_parameters():
    fig = explore(line_figure, Control("slope", [-2, 0, 2]), offset=1.0)
    assert fig.frame_count == 3
    assert fig.params_at((2,)) == {"offset": 1.0, "slope": 2}
    frames = [fig.frame((i,)) for i in range(3)]
    assert len(set(frames)) == 3, "different slopes must draw different pictures"
    assert frames[1] == png_bytes(line_figure(0, offset=1.0)), "frames are the function's output"


def test_frames_are_opaque_reproducible_pngs():
    fig = explore(line_figure, Control("slope", [1.0]))
    first = fig.frame((0,))
    assert first.startswith(b"\x89PNG")
    assert png_bytes(line_figure(1.0)) == first, "rendering twice gives the same bytes"
    assert b"Software" not in first, "no version metadata in the frames"
    pixels = decode_png(first)
    if pixels.shape[-1] == 4:
        assert np.all(pixels[..., 3] == 1.0), "every pixel opaque (dark mode)"


def test_static_html_holds_every_frame_and_starts_on_the_default():
    fig = explore(
        line_figure,
        Control("slope", [-1, 0, 1], label="slope a", fmt="{:+d}"),
        Control("offset", [0.0, 2.0], default=2.0),
    )
    page = fig.to_html()
    table = json.loads(re.search(r'class="gradlab-frames">(.*?)</script>', page).group(1))
    assert sorted(table) == ["0-0", "0-1", "1-0", "1-1", "2-0", "2-1"]
    assert base64.b64decode(table["2-1"]) == fig.frame((2, 1))
    shown = re.search(r'<img class="gradlab-frame"[^>]*src="data:image/png;base64,([^"]+)"', page)
    assert shown.group(1) == table["1-1"], "the middle slope and the given offset show first"
    assert page.count('type="range"') == 2
    assert "slope a" in page
    assert "+1" in page, "values are shown with the control's format"


def test_outside_a_kernel_the_bundle_is_static():
    bundle = explore(line_figure, Control("slope", [1, 2]))._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert bundle["text/plain"] == "<explorable line_figure: slope in 2 values>"


def test_live_panel_redraws_from_the_same_frames():
    fig = explore(line_figure, Control("slope", [-1, 0, 1]))
    panel = fig.widget()
    slider, image = panel.children
    assert image.value == fig.frame((1,))
    slider.value = 2
    assert image.value == fig.frame((2,))
    slider.value = 0
    assert image.value == fig.frame((0,))


def test_book_style_makes_figures_opaque():
    use_book_style()
    fig = new_figure()
    assert fig.get_facecolor()[3] == 1.0
    pixels = decode_png(png_bytes(fig))
    if pixels.shape[-1] == 4:
        assert np.all(pixels[..., 3] == 1.0)


def test_static_html_describes_the_figure_at_its_values():
    """The frame's alt says what the figure shows and where each slider stands; each
    slider announces its value label, not its index (aria-valuetext)."""
    fig = explore(
        line_figure,
        Control("slope", [-1, 0, 1], label="slope a", fmt="{:+d}"),
        Control("offset", [0.0, 2.0], default=2.0),
        alt="A straight line.",
    )
    page = fig.to_html()
    img = re.search(r'<img class="gradlab-frame"[^>]*>', page).group(0)
    assert 'alt="A straight line (slope a = +0, offset = 2.0)."' in img
    assert 'data-alt="A straight line."' in img, "the page's script rebuilds alt from this"
    assert fig.alt_at((2, 0)) == "A straight line (slope a = +1, offset = 0.0)."
    assert re.findall(r'aria-valuetext="([^"]*)"', page) == ["+0", "2.0"]
    assert 'role="group" aria-label="A straight line."' in page
    unnamed = explore(line_figure, Control("slope", [1, 2]))
    assert unnamed.alt_at((0,)) == "line figure (slope = 1)."
