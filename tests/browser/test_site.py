"""The published book, checked the way a reader uses it: in a real browser.

Every page of the table of contents is opened in Chromium from the built site
(``scripts/build_book.sh``) and checked: it loads cleanly, its formulas are typeset, its
images load, its exercise solutions stay hidden until asked for, its explorable figures
answer their sliders (with the mouse's events and with the keyboard alone), its links
resolve, its figures stay readable in dark mode and have text alternatives, it is not too
heavy, and a notebook page offers Binder, Colab and a download of the notebook. Each page
is opened by three readers: a returning one in light mode and one in dark mode (colour
mode already in localStorage, 1200 px wide), and a first-time one on a phone (empty
storage, 390 px wide). Every one of them must get a clean page with no serious or critical
axe-core violation. The search page must find the right chapters.
"""

from __future__ import annotations

import io
import re
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlsplit

import pytest
from booksite import (
    AXE_JS,
    NODE_MODULES,
    PHONE,
    SITE,
    TOC,
    gzipped_size,
    html_path,
    local_file,
    toc_docnames,
)
from PIL import Image

PAGES = toc_docnames(TOC)
MAX_PAGE_BYTES = 5_000_000

# What counts as a figure: notebook image outputs, MyST figures, explorable frames.
FIGURE_IMAGES = (
    "article .cell_output img, article figure img, article img.gradlab-frame, article .output img"
)


# ----------------------------------------------------------------------------- helpers


def _cache(load):
    """get(doc): ``load(doc)`` once per page. A page that cannot be loaded fails every check
    that needs it at once, with the same error."""
    visits: dict = {}

    def get(doc: str):
        if doc not in visits:
            try:
                visits[doc] = load(doc)
            except Exception as error:  # remembered, so the other checks fail fast
                visits[doc] = error
        if isinstance(visits[doc], Exception):
            raise visits[doc]
        return visits[doc]

    return get


@pytest.fixture(scope="session")
def light_visits(open_page, screenshot_dir, report):
    """Each page loaded once in light mode by a returning reader, screenshotted and checked
    by axe-core; what the checks need is kept and the browser context closed."""

    def load(doc: str):
        visit = open_page(doc)
        try:
            shot = screenshot_dir / _shot_name(doc, "light")
            visit.page.screenshot(path=shot, full_page=True)
            report["screenshots"] += 1
            visit.facts = visit.page.evaluate(_FACTS_JS, FIGURE_IMAGES)
            visit.axe = _axe(visit.page, doc, "light", report)
        finally:
            visit.close()
        return visit

    return _cache(load)


@pytest.fixture(scope="session")
def dark_visits(open_page, screenshot_dir, report):
    """Each page loaded once in dark mode by a returning reader: screenshot, figure
    readability, axe-core."""

    def load(doc: str):
        visit = open_page(doc, dark=True)
        try:
            visit.theme = visit.page.evaluate("document.documentElement.dataset.theme")
            visit.unreadable, visit.background = _dark_figure_problems(
                visit.page, screenshot_dir / _shot_name(doc, "dark")
            )
            report["screenshots"] += 1
            visit.axe = _axe(visit.page, doc, "dark", report)
        finally:
            visit.close()
        return visit

    return _cache(load)


@pytest.fixture(scope="session")
def phone_visits(open_page, screenshot_dir, report):
    """Each page opened once by a first-time reader on a phone: empty storage, 390 px wide.
    Screenshot, colour mode, axe-core, sideways overflow, and every explorable figure
    moved by the keyboard."""

    def load(doc: str):
        visit = open_page(doc, first_visit=True, viewport=PHONE)
        try:
            page = visit.page
            visit.mode = page.evaluate(_MODE_JS)
            page.screenshot(path=screenshot_dir / _shot_name(doc, "phone"), full_page=True)
            report["screenshots"] += 1
            visit.overflow = page.evaluate(_OVERFLOW_JS)
            visit.explorables = page.locator(".gradlab-explorable").evaluate_all(_FIT_JS)
            visit.keyboard = _keyboard_problems(page)
            visit.axe = _axe(page, doc, "phone", report)
        finally:
            visit.close()
        return visit

    return _cache(load)


def _shot_name(doc: str, mode: str) -> str:
    return f"{doc.replace('/', '__')}-{mode}.png"


# Everything the passive checks need, read from the page after MathJax has run.
_FACTS_JS = r"""
(figureSelector) => {
  const article = document.querySelector('article.bd-article') || document.body;
  const copy = article.cloneNode(true);
  copy.querySelectorAll('pre, code, script, style, textarea, mjx-container, .highlight')
      .forEach((el) => el.remove());
  const math = Array.from(article.querySelectorAll('.math'));
  return {
    text: copy.textContent,
    mathCount: math.length,
    untypeset: math.filter((el) => !el.querySelector('mjx-container'))
                   .map((el) => el.textContent.trim().slice(0, 80)),
    mjxCount: article.querySelectorAll('mjx-container').length,
    // TeX errors, and undefined macros (MathJax draws those as red text, not an error).
    mathErrors: Array.from(article.querySelectorAll('mjx-container')).filter((el) =>
        el.querySelector('mjx-merror') || Array.from(
          el.querySelectorAll('mjx-assistive-mml mtext[mathcolor="red"]'))
          .some((t) => t.textContent.startsWith('\\')))
      .map((el) => (el.querySelector('mjx-assistive-mml') || el).textContent.slice(0, 80)),
    images: Array.from(document.images).map((img) => ({
      src: img.currentSrc.slice(0, 120), complete: img.complete,
      width: img.naturalWidth, alt: img.alt })),
    links: Array.from(document.querySelectorAll('a[href]')).map((a) => a.href),
    solutions: document.querySelectorAll('div.solution').length,
    explorables: document.querySelectorAll('.gradlab-explorable').length,
    figures: Array.from(document.querySelectorAll(figureSelector)).map((img) => ({
      src: (img.getAttribute('src') || '').slice(0, 80), alt: img.getAttribute('alt') || '' })),
    // each explorable's alt, and "slider name = value" for each of its sliders
    explorableAlts: Array.from(document.querySelectorAll('.gradlab-explorable')).map((root) => ({
      alt: root.querySelector('img.gradlab-frame').alt,
      controls: Array.from(root.querySelectorAll('input[data-control]')).map((el) =>
        `${el.getAttribute('aria-label')} = ${JSON.parse(el.dataset.labels)[Number(el.value)]}`),
    })),
    theme: document.documentElement.dataset.theme,
  };
}
"""


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[dict[str, str]] = []

    def handle_starttag(self, tag, attrs) -> None:
        attrs = {k: v or "" for k, v in attrs}
        for key in ("id", "name"):
            if attrs.get(key):
                self.ids.add(attrs[key])
        if tag == "a" and "href" in attrs:
            self.links.append(attrs)


_fetched: dict[str, tuple[int, set[str]]] = {}


def _fetch(url: str) -> tuple[int, set[str]]:
    """(HTTP status, ids of the HTML document) of a same-origin URL, cached."""
    if url not in _fetched:
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                status, body = response.status, response.read()
                kind = response.headers.get_content_type()
        except urllib.error.HTTPError as error:
            status, body, kind = error.code, b"", ""
        parser = _Anchors()
        if kind == "text/html":
            parser.feed(body.decode("utf-8", "replace"))
        _fetched[url] = (status, parser.ids)
    return _fetched[url]


def _parsed(doc: str) -> _Anchors:
    parser = _Anchors()
    parser.feed((SITE / html_path(doc)).read_text(encoding="utf-8"))
    return parser


# ----------------------------------------------------------------------------- the site


def test_toc_is_not_empty():
    assert PAGES, f"no pages found in {TOC}"


def test_site_has_every_toc_page(site):
    missing = [doc for doc in PAGES if not (site / html_path(doc)).is_file()]
    assert not missing, (
        f"pages in {TOC.name} that the built site lacks (rebuild with "
        f"`bash scripts/build_book.sh`): {missing}"
    )


def test_navigation_lists_every_toc_page(site):
    """The sidebar of the built site is the table of contents, nothing more or less."""
    root = PAGES[0]
    nav: list[str] = []
    html = (site / html_path(root)).read_text(encoding="utf-8")
    match = re.search(r'<nav class="[^"]*\bbd-docs-nav\b[^"]*".*?</nav>', html, re.S)
    assert match, "no navigation sidebar found on the root page"
    for href in re.findall(r'href="([^"#]+)', match.group(0)):
        target = urljoin(f"http://site/{html_path(root)}", href)
        if target.startswith("http://site/"):
            nav.append(target.removeprefix("http://site/").removesuffix(".html"))
    assert set(nav) | {root} == set(PAGES), (
        f"navigation {sorted(set(nav))} does not match {TOC.name} {PAGES}: rebuild the book"
    )


def test_index_leads_to_the_first_page(browser, base_url):
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(base_url)
        page.wait_for_url(f"**/{html_path(PAGES[0])}", timeout=10_000)
    finally:
        context.close()


def test_no_html_file_is_too_heavy(site):
    """Every HTML file of the site with the local files it references stays under 5 MB.

    The download menu's source file (``_sources/``) is a link the reader may follow, not
    part of the page: it is left out, as test_page_weight's measure of what a visit loads
    leaves it out."""
    too_heavy = {}
    sources = (site / "_sources").resolve()
    for page in site.rglob("*.html"):
        total = page.stat().st_size
        text = page.read_text(encoding="utf-8", errors="replace")
        refs = set(re.findall(r'(?:src|href)="([^"#?:]+)', text))
        for ref in refs:
            target = (page.parent / unquote(ref)).resolve()
            if sources in target.parents:
                continue
            if target.is_file() and target.suffix != ".html":
                total += target.stat().st_size
        if total > MAX_PAGE_BYTES:
            too_heavy[str(page.relative_to(site))] = total
    assert not too_heavy, f"pages over {MAX_PAGE_BYTES / 1e6:.0f} MB: {too_heavy}"


# ----------------------------------------------------------------------------- every page


def _load_problems(visit) -> dict[str, list[str]]:
    problems = {
        "console errors": visit.console_errors,
        "uncaught errors": visit.page_errors,
        "failed requests": visit.failed_requests,
        "HTTP errors": visit.bad_responses,
        "blocked external requests (add a local copy to package.json?)": visit.blocked,
    }
    return {k: v for k, v in problems.items() if v}


@pytest.mark.parametrize("doc", PAGES)
def test_page_loads_cleanly(doc, light_visits):
    """A returning reader in light mode."""
    visit = light_visits(doc)
    assert visit.status == 200, f"{visit.url} answered {visit.status}"
    assert not _load_problems(visit), f"{doc}: {_load_problems(visit)}"


@pytest.mark.parametrize("doc", PAGES)
def test_page_loads_cleanly_in_dark_mode(doc, dark_visits):
    """A returning reader in dark mode."""
    visit = dark_visits(doc)
    assert visit.status == 200, f"{visit.url} answered {visit.status}"
    assert not _load_problems(visit), f"{doc}: {_load_problems(visit)}"


@pytest.mark.parametrize("doc", PAGES)
def test_first_visit_is_clean(doc, phone_visits):
    """A first-time reader: empty localStorage (the theme once logged "Got invalid theme
    mode" here), on a phone. The theme falls back to the system's colour scheme."""
    visit = phone_visits(doc)
    assert visit.status == 200, f"{visit.url} answered {visit.status}"
    assert not _load_problems(visit), f"{doc}: {_load_problems(visit)}"
    mode = visit.mode
    assert mode["storedBefore"] == 0, f"storage was not empty: {mode}"
    assert mode["mode"] == "auto" and mode["theme"] == "light", f"colour mode: {mode}"


def test_first_visit_follows_a_dark_system(open_page, browser, base_url):
    """A first-time reader whose system is dark gets the dark theme, and from the first
    paint: the book's head script sets it, not only the theme's deferred script."""
    visit = open_page(PAGES[0], first_visit=True, dark=True)
    try:
        mode = visit.page.evaluate(_MODE_JS)
        problems = _load_problems(visit)
    finally:
        visit.close()
    assert not problems, f"{PAGES[0]}: {problems}"
    assert mode["mode"] == "auto" and mode["theme"] == "dark", f"colour mode: {mode}"
    context = browser.new_context(color_scheme="dark")
    try:
        page = context.new_page()
        # Without the theme's own script (deferred, run after the page is parsed).
        page.route("**/pydata-sphinx-theme.js*", lambda route: route.abort())
        page.route(lambda url: not url.startswith(base_url), lambda route: route.abort())
        page.goto(base_url + html_path(PAGES[0]), wait_until="domcontentloaded")
        theme = page.evaluate("document.documentElement.dataset.theme")
    finally:
        context.close()
    assert theme == "dark", f"before the theme's script runs the page is {theme!r}"


@pytest.mark.parametrize("doc", PAGES)
def test_math_is_typeset(doc, light_visits):
    facts = light_visits(doc).facts
    assert not facts["untypeset"], f"formulas MathJax did not typeset: {facts['untypeset']}"
    assert facts["mjxCount"] >= facts["mathCount"]
    assert not facts["mathErrors"], f"TeX errors (undefined macro?): {facts['mathErrors']}"
    for raw in ("\\(", "\\[", "$$"):
        at = facts["text"].find(raw)
        assert at < 0, f"raw math {raw!r} left in the text: ...{facts['text'][at : at + 80]}..."


@pytest.mark.parametrize("doc", PAGES)
def test_images_load(doc, light_visits):
    images = light_visits(doc).facts["images"]
    broken = [img for img in images if not (img["complete"] and img["width"] > 0)]
    assert not broken, f"images that did not load: {broken}"


@pytest.mark.parametrize("doc", PAGES)
def test_page_weight(doc, light_visits, report):
    """The HTML and everything it loads (scripts, styles, images, fonts) under 5 MB."""
    visit = light_visits(doc)
    files = {path.resolve() for path in visit.loaded.values() if path.is_file()}
    sizes = sorted(((path.stat().st_size, path) for path in files), reverse=True)
    total = sum(size for size, _ in sizes)
    report["weights"][doc] = total
    report["gzipped"][doc] = sum(gzipped_size(path) for _, path in sizes)
    report["heaviest_files"][doc] = [(size, _short(path)) for size, path in sizes[:3]]
    assert total <= MAX_PAGE_BYTES, (
        f"{doc} weighs {total / 1e6:.2f} MB (limit 5 MB); heaviest files: "
        f"{report['heaviest_files'][doc]}"
    )


def _short(path: Path) -> str:
    for root in (SITE, NODE_MODULES):
        if root in path.parents:
            return str(path.relative_to(root))
    return str(path)


@pytest.mark.parametrize("doc", PAGES)
def test_internal_links_resolve(doc, light_visits, base_url):
    broken = []
    for href in sorted(set(light_visits(doc).facts["links"])):
        if not href.startswith(base_url):
            continue
        url, fragment = urldefrag(href)
        status, ids = _fetch(url)
        if status != 200:
            broken.append(f"{href}: HTTP {status}")
        elif fragment and url.endswith(".html") and unquote(fragment) not in ids:
            broken.append(f"{href}: no element with id {unquote(fragment)!r}")
    assert not broken, f"broken links on {doc}: {broken}"


@pytest.mark.parametrize("doc", PAGES)
def test_download_and_launch_buttons(doc, site):
    """Every page offers its source; a notebook page also opens on Binder and Colab."""
    links = [a["href"] for a in _parsed(doc).links]
    notebook = (site / "_sources" / f"{doc}.ipynb").is_file()
    source = f"_sources/{doc}.ipynb" if notebook else None
    downloads = [h for h in links if "/_sources/" in h or h.startswith("_sources/")]
    assert downloads, f"{doc}: no download button"
    for href in downloads:
        target = (site / Path(html_path(doc)).parent / href).resolve()
        assert target.is_file(), f"{doc}: download link {href} points to nothing"
    if not notebook:
        return
    assert any(urljoin(f"http://s/{html_path(doc)}", h) == f"http://s/{source}" for h in links), (
        f"{doc}: no download link to the notebook {source}"
    )
    binder = [h for h in links if h.startswith("https://mybinder.org/v2/gh/")]
    colab = [h for h in links if h.startswith("https://colab.research.google.com/github/")]
    assert any(h.endswith(f"{doc}.ipynb") for h in binder), f"{doc}: no Binder link, {binder}"
    assert any(h.endswith(f"{doc}.ipynb") for h in colab), f"{doc}: no Colab link, {colab}"


@pytest.mark.parametrize("doc", PAGES)
def test_solutions_hidden_until_asked(doc, light_visits, open_page):
    if not light_visits(doc).facts["solutions"]:
        return
    visit = open_page(doc)
    try:
        solutions = visit.page.locator("div.solution")
        for i in range(solutions.count()):
            solution = solutions.nth(i)
            name = solution.get_attribute("id")
            body = solution.locator(":scope > :not(.admonition-title)")
            assert body.count(), f"solution {name} has no content"
            for j in range(body.count()):
                assert not body.nth(j).is_visible(), f"solution {name} is shown before asked"
            button = solution.locator(".toggle-button")
            assert button.count() == 1, f"solution {name} has no toggle button"
            button.click()
            for j in range(body.count()):
                if (body.nth(j).text_content() or "").strip():
                    body.nth(j).wait_for(state="visible", timeout=5_000)
            assert solution.locator(".toggle-button").get_attribute("aria-expanded") == "true"
    finally:
        visit.close()


# Moves every control of one explorable to the other end of its range, the way the
# page's own script sees a reader's drag, and reports what the figure showed.
_MOVE_JS = """
async (root) => {
  const img = root.querySelector('img.gradlab-frame');
  const results = [];
  for (const input of root.querySelectorAll('input[data-control]')) {
    const output = input.parentElement.querySelector('output');
    const start = input.value;
    const before = {src: img.src, label: output.textContent};
    const target = Number(input.value) === Number(input.max) ? input.min : input.max;
    input.value = target;
    input.dispatchEvent(new Event('input', {bubbles: true}));
    await img.decode().catch(() => null);
    const labels = JSON.parse(input.getAttribute('data-labels'));
    results.push({
      control: input.dataset.control, min: input.min, max: input.max,
      srcChanged: img.src !== before.src, labelBefore: before.label,
      labelAfter: output.textContent, expected: labels[Number(target)],
      width: img.naturalWidth,
    });
    input.value = start;
    input.dispatchEvent(new Event('input', {bubbles: true}));
  }
  return results;
}
"""


@pytest.mark.parametrize("doc", PAGES)
def test_explorables_respond(doc, light_visits, open_page):
    if not light_visits(doc).facts["explorables"]:
        return
    visit = open_page(doc)
    try:
        figures = visit.page.locator(".gradlab-explorable")
        for i in range(figures.count()):
            figure = figures.nth(i)
            figure.scroll_into_view_if_needed()
            moves = figure.evaluate(_MOVE_JS)
            assert moves, f"explorable {i} has no controls"
            for move in moves:
                where = f"explorable {i}, control {move['control']!r}"
                assert move["max"] != move["min"], f"{where}: only one value to choose"
                assert move["srcChanged"], f"{where}: the figure did not change"
                assert move["labelAfter"] != move["labelBefore"], f"{where}: label did not change"
                assert move["labelAfter"] == move["expected"], f"{where}: wrong label"
                assert move["width"] > 0, f"{where}: the new frame is not an image"
        # And with the keyboard alone, as a reader without a mouse would.
        problems = _keyboard_problems(visit.page)
        assert not problems, f"explorables on {doc} with the keyboard: {problems}"
    finally:
        visit.close()


# Corners of each figure image as drawn by the browser, read back through a canvas:
# an image with transparent corners shows the page colour through it.
_ALPHA_JS = """
(img) => {
  const w = img.naturalWidth, h = img.naturalHeight;
  if (!w || !h) { return null; }
  const canvas = document.createElement('canvas');
  canvas.width = w; canvas.height = h;
  const ctx = canvas.getContext('2d');
  ctx.drawImage(img, 0, 0);
  const corners = [[0, 0], [w - 1, 0], [0, h - 1], [w - 1, h - 1]];
  return corners.map(([x, y]) => ctx.getImageData(x, y, 1, 1).data[3]);
}
"""


# Where each element sits on the full page, in screenshot pixels (device scale 1).
_BOXES_JS = """
(elements) => elements.map((el) => {
  const r = el.getBoundingClientRect();
  return {x: Math.round(r.left + window.scrollX), y: Math.round(r.top + window.scrollY),
          w: Math.floor(r.width), h: Math.floor(r.height),
          what: (el.getAttribute('alt') || el.className || el.tagName).slice(0, 60)};
})
"""


def _rgb(css: str) -> tuple[int, int, int]:
    r, g, b = (int(float(v)) for v in re.findall(r"[\d.]+", css)[:3])
    return r, g, b


def _dark_figure_problems(page, shot_path: Path) -> tuple[list[str], tuple[int, int, int]]:
    """Figures of a dark page that would not stay readable, and the page's background."""
    background = _rgb(page.evaluate("getComputedStyle(document.body).backgroundColor"))
    unreadable = []
    images = page.locator(FIGURE_IMAGES)
    for i in range(images.count()):
        img = images.nth(i)
        name = (img.get_attribute("alt") or img.get_attribute("src") or "")[:60]
        alpha = img.evaluate(_ALPHA_JS)
        if alpha is None or min(alpha) < 255:
            unreadable.append(f"{name}: transparent corners (alpha {alpha})")
    # Each figure's corners as drawn on the full-page screenshot (no per-element shots:
    # one screenshot is much faster on a page with many figures). On a busy machine a
    # full-page capture can come before the images of a tall page are painted again at
    # the new size; what the first capture blames is checked on a second one.
    shown = _screenshot_problems(page, shot_path, background)
    if shown:
        page.evaluate(_REPAINT_JS)
        shown = _screenshot_problems(page, shot_path, background)
    return unreadable + shown, background


_REPAINT_JS = """
async () => {
  await Promise.all(Array.from(document.images).map((img) => img.decode().catch(() => null)));
  await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
}
"""


def _screenshot_problems(page, shot_path: Path, background) -> list[str]:
    full = page.screenshot(path=shot_path, full_page=True)
    unreadable = []
    shot = Image.open(io.BytesIO(full)).convert("RGB")
    boxes = page.locator(f"{FIGURE_IMAGES}, article .gradlab-explorable").evaluate_all(_BOXES_JS)
    for i, box in enumerate(boxes):
        if box["w"] < 4 or box["h"] < 4:
            continue
        inset = min(6, box["w"] // 4, box["h"] // 4)
        left, top = box["x"] + inset, box["y"] + inset
        right, bottom = box["x"] + box["w"] - 1 - inset, box["y"] + box["h"] - 1 - inset
        for x, y in ((left, top), (right, top), (left, bottom), (right, bottom)):
            if not (0 <= x < shot.width and 0 <= y < shot.height):
                continue
            pixel = shot.getpixel((x, y))
            if sum(abs(a - b) for a, b in zip(pixel, background, strict=True)) < 60:
                what = f"{box['what']} #{i}"
                unreadable.append(f"{what}: corner {pixel} is the page's {background}")
                break
    return unreadable


@pytest.mark.parametrize("doc", PAGES)
def test_dark_mode_figures_readable(doc, dark_visits):
    """In dark mode every figure keeps an opaque, light background."""
    visit = dark_visits(doc)
    assert visit.theme == "dark"
    assert sum(visit.background) < 3 * 80, f"the page is not dark: background {visit.background}"
    assert not visit.unreadable, f"figures unreadable in dark mode on {doc}: {visit.unreadable}"


def test_local_file_mapping(base_url):
    """The weight check maps URLs to files of the site (index.html for a folder)."""
    assert local_file(base_url, base_url) == SITE / "index.html"
    assert local_file("https://example.org/x.js", base_url) is None
    assert urlsplit(base_url).hostname == "127.0.0.1"


# ----------------------------------------------------------------------------- first visit


_MODE_JS = """
() => ({
  storedBefore: window.__gradlabStoredBefore,
  mode: document.documentElement.dataset.mode,
  theme: document.documentElement.dataset.theme,
})
"""


# ----------------------------------------------------------------------------- axe-core

# axe-core's rules as it runs them by default (WCAG 2.x A and AA, and best practices).
# Each reader gets what its view adds, which keeps the suite fast: the light desktop page
# every rule, the dark one the contrast of its colours (the only rule the mode changes),
# the phone every rule but colour contrast (its colours are the light page's) for the
# controls only a narrow layout shows.
AXE_OPTIONS = {
    "light": {},
    "dark": {"runOnly": {"type": "rule", "values": ["color-contrast"]}},
    "phone": {"rules": {"color-contrast": {"enabled": False}}},
}
_AXE_RUN_JS = """
async (options) => {
  const result = await axe.run(document, {...options, resultTypes: ['violations']});
  return result.violations.map((v) => ({
    id: v.id, impact: v.impact, help: v.help,
    nodes: v.nodes.map((n) => `${n.target.join(' ')}: ${(n.failureSummary || '')
      .replace(/\\s+/g, ' ').slice(0, 160)}`),
  }));
}
"""
SERIOUS = ("serious", "critical")


def _axe(page, doc: str, mode: str, report: dict) -> list[dict]:
    """axe-core's violations on the page as it is now; every one is recorded for the
    summary, whatever its impact."""
    page.add_script_tag(path=str(AXE_JS))
    violations = page.evaluate(_AXE_RUN_JS, AXE_OPTIONS[mode])
    for v in violations:
        key = (mode, v["id"], v["impact"])
        report["axe"].setdefault(key, []).append(doc)
    return violations


@pytest.mark.parametrize("reader", ["light", "dark", "phone"])
@pytest.mark.parametrize("doc", PAGES)
def test_no_serious_accessibility_violations(doc, reader, light_visits, dark_visits, phone_visits):
    """axe-core finds no serious or critical violation, for each of the three readers."""
    visits = {"light": light_visits, "dark": dark_visits, "phone": phone_visits}
    violations = visits[reader](doc).axe
    serious = [
        f"{v['id']} ({v['impact']}: {v['help']}): {v['nodes'][:3]}"
        for v in violations
        if v["impact"] in SERIOUS
    ]
    assert not serious, f"{doc} ({reader}): {serious}"


# ----------------------------------------------------------------------------- figures


# A file name or a URL is what an image gets when nobody gave it a text alternative.
_NOT_A_DESCRIPTION = re.compile(r"(^(\.\./|/|_images/|data:|https?:)|\.(png|jpe?g|svg|gif)$)")


@pytest.mark.parametrize("doc", PAGES)
def test_figures_have_text_alternatives(doc, light_visits):
    """Every figure says what it shows: no missing alt, no file name as alt; an explorable
    figure's alt also says where each of its sliders stands."""
    facts = light_visits(doc).facts
    missing = [
        f"{fig['src']}: alt {fig['alt']!r}"
        for fig in facts["figures"]
        if len(fig["alt"].split()) < 4 or _NOT_A_DESCRIPTION.search(fig["alt"])
    ]
    assert not missing, f"figures on {doc} without a text alternative: {missing}"
    for i, explorable in enumerate(facts["explorableAlts"]):
        for control in explorable["controls"]:
            assert control in explorable["alt"], (
                f"explorable {i}: alt {explorable['alt']!r} does not say {control!r}"
            )


# Moves every slider of every explorable by one step with the arrow keys, as a reader
# without a mouse does, and reports what changed. Returns the slider states as seen
# through the page (value, label, alt, a hash of the frame).
_STATE_JS = """
(root) => {
  const img = root.querySelector('img.gradlab-frame');
  let hash = 0;
  for (let i = 0; i < img.src.length; i += 7) { hash = (hash * 31 + img.src.charCodeAt(i)) | 0; }
  return {
    frame: `${img.src.length}:${hash}`, alt: img.alt,
    sliders: Array.from(root.querySelectorAll('input[data-control]')).map((el) => ({
      value: Number(el.value), max: Number(el.max), name: el.getAttribute('aria-label'),
      label: el.parentElement.querySelector('output').textContent,
      expected: JSON.parse(el.getAttribute('data-labels'))[Number(el.value)],
      valuetext: el.getAttribute('aria-valuetext'), tabIndex: el.tabIndex,
      focused: document.activeElement === el,
      focusRing: getComputedStyle(el).outlineStyle !== 'none'
        || getComputedStyle(el).boxShadow !== 'none',
    })),
  };
}
"""


def _keyboard_problems(page) -> list[str]:
    """What goes wrong when each slider of each explorable is moved one step by an arrow
    key: the frame, the value label, the alt and aria-valuetext must all follow."""
    problems = []
    figures = page.locator(".gradlab-explorable")
    for i in range(figures.count()):
        figure = figures.nth(i)
        sliders = figure.locator("input[data-control]")
        for j in range(sliders.count()):
            before = figure.evaluate(_STATE_JS)
            where = f"explorable {i}, slider {before['sliders'][j]['name']!r}"
            if before["sliders"][j]["tabIndex"] < 0:
                problems.append(f"{where}: not reachable with Tab")
            at_end = before["sliders"][j]["value"] == before["sliders"][j]["max"]
            key, back = ("ArrowLeft", "ArrowRight") if at_end else ("ArrowRight", "ArrowLeft")
            sliders.nth(j).focus()
            page.keyboard.press(key)
            after = figure.evaluate(_STATE_JS)
            slider = after["sliders"][j]
            step = -1 if at_end else 1
            if slider["value"] != before["sliders"][j]["value"] + step:
                problems.append(
                    f"{where}: {key} moved it from {before['sliders'][j]['value']}"
                    f" to {slider['value']}"
                )
            if after["frame"] == before["frame"]:
                problems.append(f"{where}: {key} did not change the figure")
            if (
                slider["label"] != slider["expected"]
                or slider["label"] == before["sliders"][j]["label"]
            ):
                problems.append(
                    f"{where}: label {slider['label']!r} after {key}, "
                    f"expected {slider['expected']!r}"
                )
            if slider["valuetext"] != slider["expected"]:
                problems.append(f"{where}: aria-valuetext {slider['valuetext']!r}")
            if f"{slider['name']} = {slider['expected']}" not in after["alt"]:
                problems.append(f"{where}: alt {after['alt']!r} does not name the new value")
            if not (slider["focused"] and slider["focusRing"]):
                problems.append(f"{where}: no visible focus ({slider})")
            page.keyboard.press(back)
            if figure.evaluate(_STATE_JS)["frame"] != before["frame"]:
                problems.append(f"{where}: {back} did not bring the first figure back")
    return problems


# ----------------------------------------------------------------------------- phones

# Elements drawn outside the window, and whether a container that scrolls on its own
# (a code block, a wide table, a display formula) holds them. Content inside MathJax's
# assistive MathML is for screen readers, clipped to nothing on screen, and skipped.
_OVERFLOW_JS = """
() => {
  const vw = document.documentElement.clientWidth;
  const scrollers = 'pre, .highlight, table, .pst-scrollable-table-container, '
    + '.table-wrapper, mjx-container[display="true"], .cell_output .output';
  const name = (el) => el.tagName.toLowerCase()
    + (el.id ? '#' + el.id : '') + Array.from(el.classList).map((c) => '.' + c).join('');
  const loose = [];
  for (const el of document.querySelectorAll('body *')) {
    if (el.closest('mjx-assistive-mml')) { continue; }
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.height === 0 || (r.left >= -1 && r.right <= vw + 1)) { continue; }
    if (!el.checkVisibility({visibilityProperty: true, opacityProperty: true})) { continue; }
    let clip = el.parentElement;
    while (clip && clip !== document.body && getComputedStyle(clip).overflowX === 'visible') {
      clip = clip.parentElement;
    }
    const box = clip && clip.getBoundingClientRect();
    const scrolls = clip && ['auto', 'scroll'].includes(getComputedStyle(clip).overflowX);
    if (clip && clip !== document.body && clip.closest(scrollers) && scrolls
        && box.left >= -1 && box.right <= vw + 1) { continue; }
    // A clipping box inside a scrolling table or code block (an inline formula's span in
    // a table cell): the nearest scrolling container that fits the window holds it.
    let holder = el.parentElement && el.parentElement.closest(scrollers);
    while (holder && !['auto', 'scroll'].includes(getComputedStyle(holder).overflowX)) {
      holder = holder.parentElement && holder.parentElement.closest(scrollers);
    }
    const held = holder && holder.getBoundingClientRect();
    if (held && held.left >= -1 && held.right <= vw + 1) { continue; }
    loose.push(`${name(el)} spans x ${Math.round(r.left)}..${Math.round(r.right)}`
      + (clip ? ` in ${name(clip)}` : ''));
  }
  return {
    width: window.innerWidth, scrollWidth: document.scrollingElement.scrollWidth,
    loose: loose.slice(0, 10), looseCount: loose.length,
  };
}
"""

# Where each explorable and its parts sit in a narrow window.
_FIT_JS = """
(roots) => roots.map((root) => {
  const vw = document.documentElement.clientWidth;
  const inside = (el) => { const r = el.getBoundingClientRect();
                           return r.left >= -1 && r.right <= vw + 1; };
  const img = root.querySelector('img.gradlab-frame');
  return {
    fits: inside(root), imageFits: inside(img), imageWidth: img.getBoundingClientRect().width,
    controlsFit: Array.from(root.querySelectorAll('.gradlab-control, input, output'))
      .every(inside),
    sliderWidths: Array.from(root.querySelectorAll('input[data-control]'))
      .map((el) => el.getBoundingClientRect().width),
  };
})
"""


@pytest.mark.parametrize("doc", PAGES)
def test_phone_width_no_sideways_scroll(doc, phone_visits):
    """At 390 px the page itself never scrolls sideways; only code blocks, wide tables
    and display formulas may, each inside its own scrolling box."""
    overflow = phone_visits(doc).overflow
    assert overflow["scrollWidth"] <= overflow["width"], (
        f"{doc} scrolls sideways at {overflow['width']} px: {overflow['scrollWidth']} px wide; "
        f"{overflow['loose']}"
    )
    assert not overflow["looseCount"], (
        f"{overflow['looseCount']} elements of {doc} stick out of a {overflow['width']} px "
        f"window outside any scrolling code block, table or formula: {overflow['loose']}"
    )


@pytest.mark.parametrize("doc", PAGES)
def test_explorables_work_on_a_phone(doc, light_visits, phone_visits):
    if not light_visits(doc).facts["explorables"]:
        return
    visit = phone_visits(doc)
    assert len(visit.explorables) == light_visits(doc).facts["explorables"]
    for i, fit in enumerate(visit.explorables):
        where = f"explorable {i} at {PHONE['width']} px"
        assert fit["fits"] and fit["imageFits"], f"{where} does not fit: {fit}"
        assert fit["controlsFit"], f"{where}: its sliders stick out: {fit}"
        assert fit["imageWidth"] >= 0.7 * PHONE["width"], f"{where}: figure too small: {fit}"
        assert min(fit["sliderWidths"]) >= 120, f"{where}: slider too short to drag: {fit}"
    assert not visit.keyboard, f"explorables on {doc} with the keyboard: {visit.keyboard}"


# ----------------------------------------------------------------------------- search

# Which chapters each query must find, read off the book's pages (book/...): the search
# page must list each of them (it may list more: most words appear in several chapters).
SEARCHES = {
    # the threshold's name in torch and gradlab, defined in chapters 3 and 5
    "max_norm": {"book/algorithms/clip_norm", "book/algorithms/ignore_norm"},
    # non-finite gradients: what ignoring does with them, and how a step is skipped
    "NaN": {
        "book/algorithms/clip_norm",
        "book/algorithms/ignore_norm",
        "book/training/skip_step",
        "book/appendix/corrections",
    },
    # torch.amp.GradScaler: the skip chapter ("How GradScaler skips"), the mistake of
    # clipping before unscale_ in the corrections, the closing chapter's table, and the
    # mixed-precision chapter's recipe; accumulation with GradScaler (MicroBatchAccumulator's
    # scaler=), the trainers' own scalers, the library's API page; the notation page (the
    # loss scale) and the page for instructors (an exercise on it)
    "GradScaler": {
        "book/training/skip_step",
        "book/appendix/corrections",
        "book/training/which_control",
        "book/scale/mixed_precision",
        "book/scale/accumulation_distributed",
        "book/scale/trainers",
        "book/appendix/api",
        "book/notation",
        "book/instructors",
    },
    # skipping a step: chapter 8, and the training comparison of chapter 7
    "skip": {"book/training/skip_step", "book/training/clip_vs_ignore"},
}
# Queries whose results must be exactly the chapters above (a word used in one chapter).
EXACT_SEARCHES = {"GradScaler"}

_SEARCH_JS = """
async () => {
  const deadline = Date.now() + 20000;
  while (Date.now() < deadline) {
    const summary = document.querySelector('#search-results .search-summary');
    if (summary && /found|did not match/i.test(summary.textContent)) {
      return {
        summary: summary.textContent,
        hits: Array.from(document.querySelectorAll('#search-results ul.search > li > a'))
          .map((a) => a.getAttribute('href')),
      };
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  return {summary: 'search did not finish in 20 s', hits: []};
}
"""


@pytest.fixture(scope="session")
def search_results(open_page):
    """Each query of SEARCHES typed into the site's search page, once."""

    def load(query: str):
        visit = open_page("search", path=f"search.html?q={query}", first_visit=True)
        try:
            visit.results = visit.page.evaluate(_SEARCH_JS)
        finally:
            visit.close()
        return visit

    return _cache(load)


@pytest.mark.parametrize("query", sorted(SEARCHES))
def test_search_finds_the_right_chapters(query, search_results):
    visit = search_results(query)
    assert not _load_problems(visit), f"search page for {query!r}: {_load_problems(visit)}"
    results = visit.results
    found = {urlsplit(href).path.removesuffix(".html") for href in results["hits"]}
    assert found <= set(PAGES), f"{query!r} found pages outside the book: {found - set(PAGES)}"
    missing = SEARCHES[query] - found
    assert not missing, f"{query!r} did not find {sorted(missing)} ({results['summary']})"
    if query in EXACT_SEARCHES:
        assert found == SEARCHES[query], f"{query!r} found {sorted(found)}"
