"""Fixtures for the browser tests of the built book.

The built site (``_build/html``, written by ``scripts/build_book.sh``) is served on
127.0.0.1 and opened in Debian's Chromium, driven by Playwright. Nothing is fetched from
the internet: assets the pages load from CDNs (MathJax) are answered from local copies
installed with ``npm ci`` in this folder; any other external request is aborted and
counted as a failure of the page that made it.

Environment variables (all optional):

* ``GRADLAB_SITE``: the built HTML folder (default ``_build/html``);
* ``GRADLAB_TOC``: the table of contents the site was built from (default ``_toc.yml``);
* ``GRADLAB_CHROMIUM``: the browser executable (default ``/usr/bin/chromium``).
"""

from __future__ import annotations

import mimetypes
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from booksite import (
    CHROMIUM,
    CHROMIUM_ARGS,
    DESKTOP,
    HERE,
    NODE_MODULES,
    REPORT,
    SCREENSHOTS,
    SITE,
    cdn_file,
    html_path,
    local_file,
)

# ----------------------------------------------------------------------------- server


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


@pytest.fixture(scope="session")
def site() -> Path:
    """The built book; fails with instructions if it has not been built."""
    if not (SITE / "index.html").is_file():
        pytest.fail(
            f"No built book at {SITE}. Build it first with `bash scripts/build_book.sh` "
            "(or point GRADLAB_SITE at a built _build/html folder).",
            pytrace=False,
        )
    return SITE


@pytest.fixture(scope="session")
def base_url(site: Path):
    """The site served over HTTP on a free port of 127.0.0.1."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


# ----------------------------------------------------------------------------- CDN assets


@pytest.fixture(scope="session")
def node_modules() -> Path:
    """Local copies of the CDN assets (npm ci from package-lock.json when missing)."""
    lock = HERE / "package-lock.json"
    stamp = NODE_MODULES / ".package-lock.json"
    if not stamp.is_file() or stamp.stat().st_mtime < lock.stat().st_mtime:
        npm = shutil.which("npm")
        if npm is None:
            pytest.fail(
                "npm is needed to install the local copies of MathJax "
                "(apt-get install npm), or run `npm ci` in tests/browser.",
                pytrace=False,
            )
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=HERE, check=True
        )
    return NODE_MODULES


# ----------------------------------------------------------------------------- browser


@pytest.fixture(scope="session")
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.fail(
            f"No Chromium at {CHROMIUM}: install Debian's (apt-get install chromium) "
            "or set GRADLAB_CHROMIUM. The tests never download a browser.",
            pytrace=False,
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@dataclass
class Visit:
    """One page opened in a fresh browser context, and what happened while it loaded."""

    doc: str
    url: str
    page: object
    context: object
    status: int | None = None
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    bad_responses: list[str] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)
    loaded: dict[str, Path] = field(default_factory=dict)

    def close(self) -> None:
        self.context.close()


# Waits until MathJax (when the page loads it) has typeset the page, and makes lazy
# images load now, so that what we check is what a reader who scrolls sees.
_SETTLE_JS = """
async () => {
  for (const img of document.images) { img.loading = 'eager'; }
  await Promise.all(Array.from(document.images).map(
    (img) => img.complete ? null : new Promise((r) => { img.onload = img.onerror = r; })));
  if (document.querySelector('script[src*="mathjax"]')) {
    const deadline = Date.now() + 30000;
    while (!(window.MathJax && MathJax.startup && MathJax.startup.promise)) {
      if (Date.now() > deadline) { return 'MathJax never started'; }
      await new Promise((r) => setTimeout(r, 50));
    }
    await MathJax.startup.promise;
  }
  return 'ok';
}
"""


@pytest.fixture(scope="session")
def open_page(browser, base_url, node_modules):
    """open_page(doc, dark=False, first_visit=False, viewport=None) -> Visit: the page
    loaded, typeset and settled.

    By default the reader is a returning one whose colour mode (light, or dark with
    ``dark=True``) is already in localStorage, as the theme's switch leaves it. With
    ``first_visit=True`` the context starts with empty storage, as a first-time reader's
    browser does (the system colour scheme is then light, or dark with ``dark=True``).
    """

    def _open(
        doc: str,
        *,
        dark: bool = False,
        path: str | None = None,
        first_visit: bool = False,
        viewport: dict | None = None,
    ) -> Visit:
        context = browser.new_context(
            viewport=viewport or DESKTOP,
            color_scheme="dark" if dark else "light",
            service_workers="block",
        )
        mode = "dark" if dark else "light"
        if first_visit:  # what the page found in storage before any of its scripts ran
            context.add_init_script(
                "try { window.__gradlabStoredBefore = localStorage.length; }"
                " catch (e) { window.__gradlabStoredBefore = -1; }"
            )
        else:
            context.add_init_script(
                f"try {{ localStorage.setItem('mode', '{mode}');"
                f" localStorage.setItem('theme', '{mode}'); }} catch (e) {{}}"
            )
        page = context.new_page()
        url = base_url + (path if path is not None else html_path(doc))
        visit = Visit(doc=doc, url=url, page=page, context=context)

        def route(route) -> None:
            request_url = route.request.url
            copy = cdn_file(request_url, node_modules)
            if copy is None:
                visit.blocked.append(request_url)
                REPORT["blocked"][request_url] = REPORT["blocked"].get(request_url, 0) + 1
                route.abort("blockedbyclient")
                return
            visit.loaded[request_url] = copy
            content_type = mimetypes.guess_type(copy.name)[0] or "application/octet-stream"
            route.fulfill(
                path=str(copy),
                content_type=content_type,
                headers={"Access-Control-Allow-Origin": "*"},
            )

        context.route(lambda u: not u.startswith(base_url) and not u.startswith("data:"), route)
        page.on(
            "console",
            lambda m: (
                visit.console_errors.append(f"{m.text} ({m.location.get('url', '')})")
                if m.type == "error"
                else None
            ),
        )
        page.on("pageerror", lambda e: visit.page_errors.append(str(e)))
        page.on(
            "requestfailed",
            lambda r: (
                visit.failed_requests.append(f"{r.url}: {r.failure}")
                if r.url not in visit.blocked
                else None
            ),
        )

        def finished(request) -> None:
            target = local_file(request.url, base_url)
            if target is not None:
                visit.loaded[request.url] = target

        page.on("requestfinished", finished)
        page.on(
            "response",
            lambda r: (
                visit.bad_responses.append(f"{r.status} {r.url}") if r.status >= 400 else None
            ),
        )
        response = page.goto(url, wait_until="load")
        visit.status = response.status if response is not None else None
        settled = page.evaluate(_SETTLE_JS)
        if settled != "ok":
            visit.page_errors.append(settled)
        page.wait_for_load_state("networkidle")
        return visit

    return _open


@pytest.fixture(scope="session")
def report() -> dict:
    return REPORT


@pytest.fixture(scope="session")
def screenshot_dir() -> Path:
    if SCREENSHOTS.exists():
        shutil.rmtree(SCREENSHOTS)
    SCREENSHOTS.mkdir(parents=True)
    return SCREENSHOTS


def pytest_terminal_summary(terminalreporter) -> None:
    weights = REPORT["weights"]
    times = REPORT["jupyterlab_times"]
    if not (weights or times or REPORT["screenshots"] or REPORT["blocked"] or REPORT["axe"]):
        return
    write = terminalreporter.write_line
    terminalreporter.section("gradlab browser tests")
    if weights:
        doc, size = max(weights.items(), key=lambda item: item[1])
        write(
            f"heaviest page: {doc}: {size / 1e6:.2f} MB of HTML and everything it loads "
            f"(about {REPORT['gzipped'].get(doc, 0) / 1e6:.2f} MB sent gzip-compressed)"
        )
        for file_size, name in REPORT["heaviest_files"].get(doc, []):
            write(f"    {file_size / 1e6:6.2f} MB  {name}")
        write("every page, MB loaded (MB sent gzip-compressed):")
        for doc, size in sorted(weights.items(), key=lambda item: -item[1]):
            gz = REPORT["gzipped"].get(doc, 0)
            write(f"    {size / 1e6:5.2f} ({gz / 1e6:4.2f})  {doc}")
    if REPORT["screenshots"]:
        write(f"screenshots ({REPORT['screenshots']} files, light, dark and phone): {SCREENSHOTS}")
    if REPORT["axe"]:
        write("axe-core violations (any impact; serious and critical ones fail their page):")
        for (mode, rule, impact), docs in sorted(REPORT["axe"].items()):
            write(f"    {mode:5} {impact:8} {rule}: {len(docs)} page(s), e.g. {docs[0]}")
    for url, count in sorted(REPORT["blocked"].items()):
        write(f"blocked external request ({count}x): {url}")
    if times:
        write("chapters in JupyterLab (Run All Cells, until the kernel is idle):")
        for doc, seconds in times.items():
            write(f"    {seconds:7.1f} s  {doc}")
        total = sum(times.values())
        write(f"    {total:7.1f} s  in all; screenshots: {SCREENSHOTS / 'jupyterlab'}")
