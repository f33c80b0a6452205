"""The direct-manipulation figures (gradlab.book.direct), held the way a reader holds them.

Each figure is dragged with the mouse (``page.mouse``), moved with the arrow keys and
switched between its modes; after every move the numbers it shows (its ``data-``
attributes) are checked against :mod:`gradlab` run in Python on float64 tensors holding
the same values. The cliff's trajectory is re-run step by step with ``torch.optim.SGD``
and ``gradlab.clip_grad_norm_`` / ``grad_ignore_norm_`` / ``StepGuard(mode="skip")``.

The cliff is tested where readers meet it, the introduction of the built site. The norm
ball, the value cube and the unit balls are not on a page of the table of contents yet:
they are tested on a page written into ``tmp_path`` from the same Python functions that
a notebook cell calls, opened over ``file://``. Screenshots (1200 px and 390 px wide) go
to ``test-artifacts/screenshots/direct/``.
"""

# The figures print typeset maths: γ, τ and − (minus) are meant.
# ruff: noqa: RUF001

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
from booksite import NODE_MODULES, toc_docnames

import gradlab
from gradlab.clip import EPS
from gradlab_book import direct

INTRO = toc_docnames()[0]
REL = 1e-9


def close(a: float, b: float, rel: float = REL, abs_tol: float = 1e-12) -> bool:
    return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=abs_tol)


# ----------------------------------------------------------------------------- pages


@pytest.fixture(scope="module")
def demo_file(tmp_path_factory):
    """A page with every figure of gradlab.book.direct, two cliffs among them."""
    body = "".join(
        str(f)
        for f in (
            direct.norm_ball_html(),
            direct.value_cube_html(),
            direct.unit_balls_html(),
            direct.cliff_html(mode="zero", start=(-1.5, 1.0)),
            direct.cliff_html(),
        )
    )
    page = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>gradlab direct-manipulation figures</title></head>"
        '<body style="max-width:46em;margin:0 auto;padding:0 8px;font-family:sans-serif">'
        f"<main><h1>Direct-manipulation figures</h1>{body}</main></body></html>"
    )
    path = tmp_path_factory.mktemp("direct") / "direct.html"
    path.write_text(page, encoding="utf-8")
    return path


class Opened:
    def __init__(self, context, page, errors):
        self.context, self.page, self.errors = context, page, errors

    def close(self) -> None:
        self.context.close()


def _open_file(browser, path, width=1200, scale=1):
    context = browser.new_context(
        viewport={"width": width, "height": 900}, device_scale_factor=scale
    )
    errors: list[str] = []
    # Nothing but the file itself may be loaded.
    context.route(
        lambda url: not url.startswith(("file://", "data:")),
        lambda route: (errors.append(f"request: {route.request.url}"), route.abort()),
    )
    page = context.new_page()
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri(), wait_until="load")
    return Opened(context, page, errors)


@pytest.fixture
def demo(browser, demo_file):
    opened = _open_file(browser, demo_file)
    yield opened
    opened.close()


@pytest.fixture
def intro(open_page):
    visit = open_page(INTRO)
    yield visit
    visit.close()


# ----------------------------------------------------------------------------- helpers


def figure(page, kind: str, index: int = 0):
    root = page.locator(f'.gldm[data-figure="{kind}"]').nth(index)
    root.scroll_into_view_if_needed()
    assert root.get_attribute("data-ready") == "true", f"{kind} figure did not start"
    return root


def state(root) -> dict:
    data = root.evaluate("el => Object.assign({}, el.dataset)")
    for key in ("counts", "path", "finalLosses", "norms"):
        if key in data:
            data[key] = json.loads(data[key])
    return data


def config(root) -> dict:
    return json.loads(root.locator("script.gldm-config").text_content())


def view_of(root) -> tuple[float, float, float, float]:
    view = config(root)["view"]
    if isinstance(view, dict):
        return view["x0"], view["x1"], view["y0"], view["y1"]
    return -view, view, -view, view


def to_screen(root, x: float, y: float) -> tuple[float, float]:
    """Viewport pixel of the data point (x, y) of a figure's plot area."""
    box = root.locator("rect.gldm-plotarea").bounding_box()
    x0, x1, y0, y1 = view_of(root)
    return (
        box["x"] + (x - x0) / (x1 - x0) * box["width"],
        box["y"] + (y1 - y) / (y1 - y0) * box["height"],
    )


def drag_to(page, root, x: float, y: float) -> None:
    """Press on the handle, drag it in several moves to (x, y), release."""
    handle = root.locator(".gldm-handle").bounding_box()
    page.mouse.move(handle["x"] + handle["width"] / 2, handle["y"] + handle["height"] / 2)
    page.mouse.down()
    tx, ty = to_screen(root, x, y)
    page.mouse.move(tx, ty, steps=6)
    page.mouse.up()


def set_slider(root, param: str, value: float) -> None:
    root.locator(f'input[data-param="{param}"]').evaluate(
        "(el, v) => { el.value = String(v);"
        " el.dispatchEvent(new Event('input', {bubbles: true})); }",
        value,
    )


def choose(root, mode: str) -> None:
    root.locator(f'input[type=radio][value="{mode}"]').check()


def held(grad: tuple[float, float]) -> torch.Tensor:
    param = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    param.grad = torch.tensor(grad, dtype=torch.float64)
    return param


def snapped(v: float) -> float:
    return math.floor(v * 100 + 0.5) / 100


# ----------------------------------------------------------------------------- the cliff


def cliff_loss(theta: torch.Tensor, s: dict) -> torch.Tensor:
    """The loss of gradlab.book.direct.CLIFF_SURFACE, in torch (autograd differentiates)."""
    u, v = theta[0] - s["x0"], theta[1] - s["y0"]
    wall = torch.sigmoid(s["k"] * (theta[0] - s["c"] - s["s"] * theta[1]))
    return 0.5 * s["a"] * u**2 + 0.5 * s["b"] * v**2 + s["H"] * wall


def gradlab_trajectory(start, mode, tau, lr, mu, steps, surface):
    """The cliff's run with torch.optim.SGD and gradlab's controls: path and decisions."""
    theta = torch.tensor(start, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([theta], lr=lr, momentum=mu)
    guard = None
    if mode == "skip":
        guard = gradlab.StepGuard(opt, mode="skip", threshold=tau, max_consecutive_skips=None)
    path, decisions = [tuple(start)], ""
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        cliff_loss(theta, surface).backward()
        before = theta.grad.clone()
        if mode == "skip":
            record = guard.step()
            decisions += "s" if record.decision == "skipped" else "k"
        else:
            if mode == "clip":
                gradlab.clip_grad_norm_([theta], tau)
                decisions += "k" if torch.equal(theta.grad, before) else "c"
            elif mode == "zero":
                gradlab.grad_ignore_norm_([theta], tau)
                decisions += "k" if torch.equal(theta.grad, before) else "z"
            else:
                decisions += "k"
            opt.step()
        path.append((float(theta.detach()[0]), float(theta.detach()[1])))
    with torch.no_grad():
        loss = float(cliff_loss(theta, surface))
    return path, decisions, loss


def check_cliff(root) -> dict:
    """The figure's shown trajectory is gradlab's, step by step; returns its state."""
    s = state(root)
    surface = config(root)["surface"]
    assert surface == direct.CLIFF_SURFACE
    start = (float(s["startX"]), float(s["startY"]))
    tau, lr, mu, steps = float(s["tau"]), float(s["lr"]), float(s["momentum"]), int(s["steps"])
    path, decisions, loss = gradlab_trajectory(start, s["mode"], tau, lr, mu, steps, surface)
    where = f"cliff {s['mode']} from {start}, tau={tau}, lr={lr}, mu={mu}"
    assert s["decisions"] == decisions, f"{where}: decisions differ"
    assert len(s["path"]) == len(path) == steps + 1
    for t, (shown, ref) in enumerate(zip(s["path"], path, strict=True)):
        assert close(shown[0], ref[0], abs_tol=1e-9) and close(shown[1], ref[1], abs_tol=1e-9), (
            f"{where}: step {t} at {shown}, gradlab says {ref}"
        )
    assert close(s["finalX"], path[-1][0], abs_tol=1e-9)
    assert close(s["finalY"], path[-1][1], abs_tol=1e-9)
    assert close(s["finalLoss"], loss, abs_tol=1e-9), f"{where}: loss {s['finalLoss']} vs {loss}"
    counts = s["counts"]
    assert counts["clipped"] == decisions.count("c")
    assert counts["zeroed"] == decisions.count("z")
    assert counts["skipped"] == decisions.count("s")
    assert counts["kept"] == decisions.count("k")
    return s


def test_hero_is_on_the_intro_and_matches_gradlab(intro):
    assert not intro.console_errors and not intro.page_errors
    page = intro.page
    assert page.locator(".gldm").count() == 1
    root = figure(page, "cliff")
    s = check_cliff(root)
    assert s["mode"] == "clip" and s["startX"] == "-0.8" and s["startY"] == "1.3"
    # The default tells the book's story: clipping settles, the others do not.
    losses = s["finalLosses"]
    assert losses["clip"] < 0.05
    assert min(losses["none"], losses["zero"], losses["skip"]) > 10 * losses["clip"]
    readout = root.locator(".gldm-readout")
    assert readout.get_attribute("aria-live") == "polite"
    text = readout.text_content()
    assert "start (−0.80, 1.30)" in text and "clip by norm" in text and "τ = 1.50" in text
    assert "final loss" in text


def test_hero_every_mode_matches_gradlab(intro):
    root = figure(intro.page, "cliff")
    for mode in ("none", "clip", "zero", "skip"):
        choose(root, mode)
        s = check_cliff(root)
        assert s["mode"] == mode
        label = root.locator(f'input[value="{mode}"]').evaluate(
            "el => el.parentElement.textContent"
        )
        assert label.strip().lower() in root.locator(".gldm-readout").text_content()
    # Under momentum zeroing coasts on, skipping stays put: they differ ...
    s = state(root)
    assert s["finalLosses"]["zero"] != s["finalLosses"]["skip"]
    # ... and without momentum a zeroed step does not move: the two are the same.
    set_slider(root, "momentum", 0.0)
    choose(root, "zero")
    zero = check_cliff(root)
    assert "with μ = 0 a zeroed step does not move" in root.locator(".gldm-readout").text_content()
    choose(root, "skip")
    skip = check_cliff(root)
    assert zero["path"] == skip["path"]


@pytest.mark.parametrize(
    ("tau", "lr", "mu"), [(0.5, 0.05, 0.9), (2.0, 0.2, 0.5), (5.0, 0.1, 0.95), (1.0, 0.01, 0.0)]
)
def test_hero_sliders_match_gradlab(intro, tau, lr, mu):
    root = figure(intro.page, "cliff")
    set_slider(root, "tau", tau)
    set_slider(root, "lr", lr)
    set_slider(root, "momentum", mu)
    for mode in ("none", "clip", "zero", "skip"):
        choose(root, mode)
        s = check_cliff(root)
        assert (float(s["tau"]), float(s["lr"]), float(s["momentum"])) == (tau, lr, mu)
    out = root.locator('input[data-param="tau"]').evaluate("el => el.nextElementSibling.value")
    assert out == f"{tau:.2f}"


def test_hero_drag_and_keys_move_the_start(intro):
    page = intro.page
    root = figure(page, "cliff")
    targets = [(-2.0, -1.0), (0.2, 1.5), (1.5, 0.5), (-3.5, 0.0)]
    for x, y in targets:
        drag_to(page, root, x, y)
        s = check_cliff(root)
        sx, sy = float(s["startX"]), float(s["startY"])
        assert abs(sx - x) < 0.03 and abs(sy - y) < 0.03, f"dragged to {(x, y)}, got {(sx, sy)}"
        assert (sx, sy) == (snapped(sx), snapped(sy)), "the start is snapped to 0.01"
        assert (
            root.locator(".gldm-readout")
            .text_content()
            .startswith(f"start ({sx:.2f}, {sy:.2f})".replace("-", "−"))
        )
    # A click on the map puts the start there.
    page.mouse.click(*to_screen(root, -1.0, -1.5))
    s = state(root)
    assert abs(float(s["startX"]) + 1.0) < 0.03 and abs(float(s["startY"]) + 1.5) < 0.03
    # The keyboard: the handle is focusable; arrows step 0.1, Shift+arrow 1.0.
    handle = root.locator(".gldm-handle")
    assert handle.get_attribute("tabindex") == "0"
    handle.focus()
    x0, y0 = float(state(root)["startX"]), float(state(root)["startY"])
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    page.keyboard.press("Shift+ArrowUp")
    s = check_cliff(root)
    assert close(float(s["startX"]), snapped(snapped(x0 + 0.1) + 0.1))
    assert close(float(s["startY"]), snapped(y0 + 1.0))
    assert "start point (" in handle.get_attribute("aria-label")
    page.keyboard.press("Home")
    s = check_cliff(root)
    assert (s["startX"], s["startY"]) == ("-0.8", "1.3"), "Home goes back to the first start"
    # Keys stop at the edge of the map.
    for _ in range(8):
        page.keyboard.press("Shift+ArrowLeft")
    assert float(check_cliff(root)["startX"]) == config(root)["view"]["x0"]


def test_hero_slider_keyboard(intro):
    page = intro.page
    root = figure(page, "cliff")
    slider = root.locator('input[data-param="tau"]')
    slider.focus()
    page.keyboard.press("ArrowRight")
    s = check_cliff(root)
    assert float(s["tau"]) == 1.75
    page.keyboard.press("End")
    assert float(check_cliff(root)["tau"]) == 5.0


def test_two_cliffs_on_one_page_are_independent(demo):
    assert not demo.errors
    first, second = figure(demo.page, "cliff", 0), figure(demo.page, "cliff", 1)
    assert first.get_attribute("id") != second.get_attribute("id")
    assert state(first)["mode"] == "zero" and state(second)["mode"] == "clip"
    choose(second, "skip")
    assert state(first)["mode"] == "zero" and state(second)["mode"] == "skip"
    check_cliff(first)
    check_cliff(second)
    ids = demo.page.evaluate("Array.from(document.querySelectorAll('[id]')).map(e => e.id)")
    assert len(ids) == len(set(ids)), "duplicate ids on a page with five figures"


# ----------------------------------------------------------------------------- norm ball


def check_norm_ball(root) -> dict:
    s = state(root)
    g, tau = (float(s["g1"]), float(s["g2"])), float(s["tau"])
    clipped = held(g)
    norm = gradlab.clip_grad_norm_([clipped], tau)
    ignored = held(g)
    gradlab.grad_ignore_norm_([ignored], tau)
    assert close(s["norm"], norm)
    assert close(s["norm"], gradlab.get_total_norm([torch.tensor(g, dtype=torch.float64)]))
    assert close(s["coef"], min(1.0, tau / (float(norm) + EPS)))
    out = clipped.grad if s["mode"] == "clip" else ignored.grad
    assert close(s["out1"], out[0]) and close(s["out2"], out[1]), (s, out)
    if s["mode"] == "clip":
        assert s["decision"] == ("clipped" if float(s["coef"]) < 1 else "kept")
    else:  # the rule grad_ignore_norm_ documents; its output was checked above
        assert s["decision"] == ("kept" if tau / (float(norm) + EPS) >= 1 else "zeroed")
    return s


#: The figure's starting gradient: norm_ball_html's default (the chapter's, rounded).
START = tuple(inspect.signature(direct.norm_ball_html).parameters["gradient"].default)
SAMPLES = [(-6.0, 2.0), (1.0, 1.5), (2.5, -2.5), (0.0, 0.0), (7.5, 7.5), (-0.5, -7.0)]


@pytest.mark.parametrize("mode", ["clip", "zero"])
def test_norm_ball_matches_gradlab(demo, mode):
    assert not demo.errors
    root = figure(demo.page, "normball")
    choose(root, mode)
    s = check_norm_ball(root)
    assert (float(s["g1"]), float(s["g2"])) == START
    seen = set()
    for tau in (3.0, 0.5, 8.0, 0.0):
        set_slider(root, "tau", tau)
        for x, y in SAMPLES:
            drag_to(demo.page, root, x, y)
            s = check_norm_ball(root)
            assert abs(float(s["g1"]) - x) < 0.05 and abs(float(s["g2"]) - y) < 0.05
            seen.add(s["decision"])
    assert seen == ({"clipped", "kept"} if mode == "clip" else {"zeroed", "kept"})
    text = root.locator(".gldm-readout").text_content()
    assert "γ = min(1, τ / (‖g‖₂ + 10⁻⁶))" in text


def test_norm_ball_keyboard(demo):
    page = demo.page
    root = figure(page, "normball")
    root.locator(".gldm-handle").focus()
    g1 = float(state(root)["g1"])
    page.keyboard.press("ArrowRight")
    page.keyboard.press("Shift+ArrowDown")
    s = check_norm_ball(root)
    assert close(float(s["g1"]), snapped(g1 + 0.2))
    assert close(float(s["g2"]), snapped(START[1] - 2.0))
    # Home: the zero gradient, which clipping keeps (τ / (0 + ε) ≥ 1).
    page.keyboard.press("Home")
    s = check_norm_ball(root)
    assert (s["g1"], s["g2"], s["coef"], s["decision"]) == ("0", "0", "1", "kept")


# ----------------------------------------------------------------------------- value cube


def check_value_cube(root) -> dict:
    s = state(root)
    g, c = (float(s["g1"]), float(s["g2"])), float(s["tau"])
    clamped = held(g)
    assert gradlab.clip_grad_value_([clamped], c) is None
    ignored = held(g)
    largest = gradlab.grad_ignore_value_([ignored], c)
    by_norm = held(g)
    gradlab.clip_grad_norm_([by_norm], c)
    assert close(s["inf"], largest)
    assert close(s["inf"], gradlab.get_total_norm([torch.tensor(g, dtype=torch.float64)], "inf"))
    out = clamped.grad if s["mode"] == "clip" else ignored.grad
    assert close(s["out1"], out[0]) and close(s["out2"], out[1]), (s, out)
    assert close(s["norm1"], by_norm.grad[0]) and close(s["norm2"], by_norm.grad[1])
    unchanged = torch.equal(out, held(g).grad)
    if s["mode"] == "clip":
        assert s["decision"] == ("kept" if unchanged else "clipped")
    else:
        assert s["decision"] == ("kept" if unchanged and max(map(abs, g)) < c else "zeroed")
    a, b = torch.tensor(g, dtype=torch.float64), out
    if a.norm() > 0 and b.norm() > 0:
        cosine = float(a @ b / (a.norm() * b.norm()))
        angle = math.degrees(math.acos(max(-1.0, min(1.0, cosine))))
        assert close(s["angle"], angle, rel=1e-7, abs_tol=1e-6)
    else:
        assert s["angle"] == "NaN"
    return s


@pytest.mark.parametrize("mode", ["clip", "zero"])
def test_value_cube_matches_gradlab(demo, mode):
    assert not demo.errors
    root = figure(demo.page, "valuecube")
    choose(root, mode)
    check_value_cube(root)
    seen = set()
    for c in (3.0, 1.0, 8.0):
        set_slider(root, "tau", c)
        for x, y in SAMPLES:
            drag_to(demo.page, root, x, y)
            seen.add(check_value_cube(root)["decision"])
    assert seen == ({"clipped", "kept"} if mode == "clip" else {"zeroed", "kept"})
    # The entry exactly at c: clamping leaves it, ignoring by value zeroes it.
    # The mouse lands on whole pixels, not on (2, 1): go there with the keys, from
    # Home (the origin) in steps of extent / 40 = 0.2.
    set_slider(root, "tau", 2.0)
    root.locator(".gldm-handle").focus()
    for key in ["Home"] + ["ArrowRight"] * 10 + ["ArrowUp"] * 5:
        demo.page.keyboard.press(key)
    s = check_value_cube(root)
    assert (float(s["g1"]), float(s["g2"])) == (2.0, 1.0)
    assert s["decision"] == ("kept" if mode == "clip" else "zeroed")


# ----------------------------------------------------------------------------- unit balls


def check_unit_balls(root) -> dict:
    s = state(root)
    v = torch.tensor((float(s["v1"]), float(s["v2"])), dtype=torch.float64)
    for name, shown in s["norms"].items():
        p = math.inf if name == "inf" else float(name)
        ref = gradlab.get_total_norm([v], p)
        assert close(shown, ref), f"p = {name}: figure {shown}, gradlab {float(ref)}"
        assert close(shown, torch.linalg.vector_norm(v, p))
    assert close(s["norm"], s["norms"][s["p"]])
    rows = root.locator("table.gldm-table tbody tr")
    for i in range(rows.count()):
        row = rows.nth(i)
        shown = float(row.locator("td").text_content().replace("−", "-"))
        assert abs(shown - s["norms"][row.get_attribute("data-p")]) <= 0.5e-4 + 1e-12
    chosen = root.locator("tr.gldm-chosen").get_attribute("data-p")
    assert chosen == s["p"]
    return s


def test_unit_balls_match_gradlab(demo):
    assert not demo.errors
    page = demo.page
    root = figure(page, "unitballs")
    s = check_unit_balls(root)
    assert s["p"] == "2" and set(s["norms"]) == {"1", "1.5", "2", "3", "4", "8", "inf"}
    x0, x1, _, _ = view_of(root)
    for p in ("1", "1.5", "3", "8", "inf", "2"):
        choose(root, p)
        for x, y in [(0.7, -0.4), (-1.2, 1.9), (2.5, 0.0), (-0.05, -2.8)]:
            if not x0 <= x <= x1:
                continue
            drag_to(page, root, x, y)
            s = check_unit_balls(root)
            assert s["p"] == p
    root.locator(".gldm-handle").focus()
    v1 = float(state(root)["v1"])
    page.keyboard.press("ArrowLeft")
    assert close(float(check_unit_balls(root)["v1"]), snapped(v1 - config(root)["view"] / 40))


# ----------------------------------------------------------------------------- layout


FIT_JS = """
(root) => {
  const r = root.getBoundingClientRect();
  const svg = root.querySelector('svg.gldm-svg').getBoundingClientRect();
  return {left: r.left, right: r.right, scroll: root.scrollWidth, client: root.clientWidth,
          svgRight: svg.right, width: window.innerWidth};
}
"""


def test_figures_fit_a_phone_and_screenshots(browser, demo_file, open_page, screenshot_dir):
    """At 390 px every figure fits without sideways scrolling; screenshots at both widths."""
    out = screenshot_dir / "direct"
    out.mkdir(parents=True, exist_ok=True)
    (out / "direct.html").write_text(demo_file.read_text(encoding="utf-8"), encoding="utf-8")
    for width, scale in ((1200, 1), (390, 2)):
        opened = _open_file(browser, demo_file, width=width, scale=scale)
        try:
            page = opened.page
            assert not opened.errors
            for kind in ("normball", "valuecube", "unitballs", "cliff"):
                root = figure(page, kind)
                fit = root.evaluate(FIT_JS)
                assert fit["left"] >= 0 and fit["right"] <= fit["width"] + 0.5, (kind, fit)
                assert fit["scroll"] <= fit["client"] + 1, f"{kind} scrolls sideways: {fit}"
                root.screenshot(path=out / f"{kind}-{width}.png")
            page.screenshot(path=out / f"demo-page-{width}.png", full_page=True)
        finally:
            opened.close()
    # The hero where it lives, in the book's own page, both widths.
    for width in (1200, 390):
        visit = open_page(INTRO)
        try:
            page = visit.page
            page.set_viewport_size({"width": width, "height": 900})
            page.reload(wait_until="load")
            root = figure(page, "cliff")
            fit = root.evaluate(FIT_JS)
            assert fit["right"] <= fit["width"] + 0.5 and fit["scroll"] <= fit["client"] + 1, fit
            check_cliff(root)
            root.screenshot(path=out / f"intro-hero-{width}.png")
        finally:
            visit.close()


def test_figures_are_labelled(demo):
    """Every control has a name; the live region and the caption are wired to the figure."""
    page = demo.page
    for kind in ("normball", "valuecube", "unitballs", "cliff"):
        root = figure(page, kind)
        uid = root.get_attribute("id")
        assert root.get_attribute("aria-labelledby") == f"{uid}-title"
        assert page.locator(f"#{uid}-caption").text_content().strip()
        assert root.locator(".gldm-readout").get_attribute("aria-live") == "polite"
        handle = root.locator(".gldm-handle")
        assert handle.get_attribute("role") == "application" and handle.get_attribute("aria-label")
        radios = root.locator("input[type=radio]")
        assert radios.count() >= 2
        names = {radios.nth(i).get_attribute("name") for i in range(radios.count())}
        assert names == {f"{uid}-mode"}
        for i in range(radios.count()):
            assert radios.nth(i).evaluate("el => el.closest('label') !== null")
        sliders = root.locator("input[type=range]")
        for i in range(sliders.count()):
            assert sliders.nth(i).evaluate("el => el.labels.length === 1")


# How JupyterLab shows a trusted text/html output: the HTML set as innerHTML of an
# output node (scripts inserted that way never run), then each script replaced by a
# fresh copy, which runs.
_AS_JUPYTERLAB_JS = """
(html) => {
  const host = document.createElement('div');
  host.className = 'jp-OutputArea-output';
  document.body.appendChild(host);
  host.innerHTML = html;
  host.querySelectorAll('script').forEach((old) => {
    const fresh = document.createElement('script');
    for (const a of old.attributes) { fresh.setAttribute(a.name, a.value); }
    fresh.textContent = old.textContent;
    old.replaceWith(fresh);
  });
  return Array.from(host.querySelectorAll('.gldm')).map((el) => el.dataset.ready || 'no');
}
"""


def test_figures_start_as_a_jupyterlab_output(browser):
    context = browser.new_context()
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_content('<!doctype html><html lang="en"><body><main></main></body></html>')
        for make in (direct.cliff_html, direct.norm_ball_html, direct.value_cube_html):
            assert page.evaluate(_AS_JUPYTERLAB_JS, str(make())) == ["true"]
        # Re-running a cell adds a second copy with new ids; both work.
        assert page.evaluate(_AS_JUPYTERLAB_JS, str(direct.unit_balls_html())) == ["true"]
        assert page.evaluate(_AS_JUPYTERLAB_JS, str(direct.unit_balls_html())) == ["true"]
        assert not errors
        assert page.locator('.gldm[data-ready="true"]').count() == 5
        root = page.locator('.gldm[data-figure="unitballs"]').nth(1)
        choose(root, "inf")
        check_unit_balls(root)
    finally:
        context.close()


AXE_JS = """
async () => {
  const result = await axe.run(Array.from(document.querySelectorAll('.gldm')),
    {runOnly: {type: 'tag', values: ['wcag2a', 'wcag2aa', 'wcag21a', 'wcag21aa',
                                     'best-practice']}});
  return result.violations.map((v) => ({id: v.id, help: v.help,
    nodes: v.nodes.slice(0, 3).map((n) => n.target.join(' ') + ': ' + n.failureSummary)}));
}
"""


def test_figures_pass_axe(demo):
    """axe-core finds nothing in any figure (where the suite has its local copy of axe)."""
    axe = NODE_MODULES / "axe-core" / "axe.min.js"
    if not axe.is_file():
        pytest.skip("axe-core is not in tests/browser/node_modules (npm ci)")
    demo.page.add_script_tag(path=str(axe))
    violations = demo.page.evaluate(AXE_JS)
    assert not violations, violations
