"""The published book, checked the way a reader uses it: in a real browser.

Every page of the table of contents is opened in Chromium from the built site
(``scripts/build_book.sh``) and checked: it loads cleanly, its formulas are typeset, its
images load, its exercise solutions stay hidden until asked for, its explorable figures
answer their sliders, its links resolve, its figures stay readable in dark mode, it is
not too heavy, and a notebook page offers Binder, Colab and a download of the notebook.
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
from booksite import NODE_MODULES, SITE, TOC, gzipped_size, html_path, local_file, toc_docnames
from PIL import Image

PAGES = toc_docnames(TOC)
MAX_PAGE_BYTES = 5_000_000

# What counts as a figure: notebook image outputs, MyST figures, explorable frames.
FIGURE_IMAGES = (
    "article .cell_output img, article figure img, article img.gradlab-frame, article .output img"
)


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="session")
def light_visits(open_page, screenshot_dir, report):
    """Each page loaded once in light mode and screenshotted; what the checks need is kept
    and the browser context closed. A page that cannot be loaded fails every check at once.
    """
    visits: dict = {}

    def get(doc: str):
        if doc not in visits:
            try:
                visit = open_page(doc)
                try:
                    shot = screenshot_dir / _shot_name(doc, "light")
                    visit.page.screenshot(path=shot, full_page=True)
                    report["screenshots"] += 1
                    visit.facts = visit.page.evaluate(_FACTS_JS)
                finally:
                    visit.close()
                visits[doc] = visit
            except Exception as error:  # remembered, so the other checks fail fast
                visits[doc] = error
        if isinstance(visits[doc], Exception):
            raise visits[doc]
        return visits[doc]

    return get


def _shot_name(doc: str, mode: str) -> str:
    return f"{doc.replace('/', '__')}-{mode}.png"


# Everything the passive checks need, read from the page after MathJax has run.
_FACTS_JS = r"""
() => {
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
    """Every HTML file of the site with the local files it references stays under 5 MB."""
    too_heavy = {}
    for page in site.rglob("*.html"):
        total = page.stat().st_size
        text = page.read_text(encoding="utf-8", errors="replace")
        refs = set(re.findall(r'(?:src|href)="([^"#?:]+)', text))
        for ref in refs:
            target = (page.parent / unquote(ref)).resolve()
            if target.is_file() and target.suffix != ".html":
                total += target.stat().st_size
        if total > MAX_PAGE_BYTES:
            too_heavy[str(page.relative_to(site))] = total
    assert not too_heavy, f"pages over {MAX_PAGE_BYTES / 1e6:.0f} MB: {too_heavy}"


# ----------------------------------------------------------------------------- every page


@pytest.mark.parametrize("doc", PAGES)
def test_page_loads_cleanly(doc, light_visits):
    visit = light_visits(doc)
    assert visit.status == 200, f"{visit.url} answered {visit.status}"
    problems = {
        "console errors": visit.console_errors,
        "uncaught errors": visit.page_errors,
        "failed requests": visit.failed_requests,
        "HTTP errors": visit.bad_responses,
        "blocked external requests (add a local copy to package.json?)": visit.blocked,
    }
    problems = {k: v for k, v in problems.items() if v}
    assert not problems, f"{doc}: {problems}"


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
            # And with the keyboard, as a reader without a mouse would.
            slider = figure.locator("input[data-control]").first
            image = figure.locator("img.gradlab-frame")
            before = image.get_attribute("src")
            at_end = slider.input_value() == slider.get_attribute("max")
            slider.focus()
            visit.page.keyboard.press("Home" if at_end else "End")
            assert image.get_attribute("src") != before, f"explorable {i}: keyboard did nothing"
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


@pytest.mark.parametrize("doc", PAGES)
def test_dark_mode_figures_readable(doc, light_visits, open_page, screenshot_dir, report):
    """In dark mode every figure keeps an opaque, light background."""
    light_visits(doc)  # the light screenshot
    visit = open_page(doc, dark=True)
    try:
        page = visit.page
        assert page.evaluate("document.documentElement.dataset.theme") == "dark"
        full = page.screenshot(path=screenshot_dir / _shot_name(doc, "dark"), full_page=True)
        report["screenshots"] += 1
        background = _rgb(page.evaluate("getComputedStyle(document.body).backgroundColor"))
        assert sum(background) < 3 * 80, f"the page is not dark: background {background}"
        unreadable = []
        images = page.locator(FIGURE_IMAGES)
        for i in range(images.count()):
            img = images.nth(i)
            name = (img.get_attribute("alt") or img.get_attribute("src") or "")[:60]
            alpha = img.evaluate(_ALPHA_JS)
            if alpha is None or min(alpha) < 255:
                unreadable.append(f"{name}: transparent corners (alpha {alpha})")
        # Each figure's corners as drawn on the full-page screenshot (no per-element shots:
        # one screenshot is much faster on a page with many figures).
        shot = Image.open(io.BytesIO(full)).convert("RGB")
        boxes = page.locator(f"{FIGURE_IMAGES}, article .gradlab-explorable").evaluate_all(
            _BOXES_JS
        )
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
        assert not unreadable, f"figures unreadable in dark mode on {doc}: {unreadable}"
    finally:
        visit.close()


def test_local_file_mapping(base_url):
    """The weight check maps URLs to files of the site (index.html for a folder)."""
    assert local_file(base_url, base_url) == SITE / "index.html"
    assert local_file("https://example.org/x.js", base_url) is None
    assert urlsplit(base_url).hostname == "127.0.0.1"
