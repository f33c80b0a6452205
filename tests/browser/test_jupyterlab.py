"""The chapters as a learner meets them: opened and run in a real JupyterLab.

One ``jupyter lab`` for the session (127.0.0.1, a free port, no token, no browser, its
settings, workspaces and runtime files in a temporary folder, the repository as root,
no news or update checks, autosave off so the committed notebooks are never written).
For each chapter, Chromium opens the notebook, clears the committed outputs (Edit > Clear
Outputs of All Cells), runs every cell through the menu (Run > Run All Cells) in the
real kernel and waits for the kernel to go idle. Then:

* no cell has an error or stderr output (the committed outputs have none);
* no raw MyST is left in the rendered Markdown (``:::{``, ``{cite``, ``{doc}``, ...),
  and every math macro rendered (KaTeX reports the errors on the console);
* every solution is a folded dropdown that opens on a click: the ``{solution}``
  directives and the gated solutions, whose code cells are folded too;
* every live explorable is an ipywidgets panel, and moving each of its sliders, with
  the mouse and with the keyboard, makes the kernel redraw its figure;
* no console error, no uncaught exception, and no request to any other host.

Screenshots go to ``test-artifacts/screenshots/jupyterlab/``; the run time of every
chapter in JupyterLab is printed at the end of pytest's report.

By default three chapters run (``CI_CHAPTERS``); ``GRADLAB_JUPYTERLAB_ALL=1`` runs every
notebook of the table of contents, ``GRADLAB_JUPYTERLAB_CHAPTERS=a,b`` the ones named
(docnames such as ``book/algorithms/clip_norm``). ``GRADLAB_JUPYTERLAB_ROOT`` serves
another copy of the project (default: this repository).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from booksite import REPORT, ROOT, SCREENSHOTS, toc_docnames

JUPYTERLAB_ROOT = Path(os.environ.get("GRADLAB_JUPYTERLAB_ROOT", ROOT)).resolve()
SHOTS = SCREENSHOTS / "jupyterlab"

#: Run by default (CI). Together they hold every construct the book uses: citations
#: (one and several works), cross-references, exercises, plain and gated solutions, the
#: notation macros, and explorables with one and with several sliders; each runs in
#: about half a minute. The training chapters take minutes each and add nothing new.
CI_CHAPTERS = (
    "book/foundations/explode",
    "book/algorithms/clip_norm",
    "book/algorithms/clip_value",
)

RAW_MYST = re.compile(r":::\s*\{|`{3}\s*\{|\{cite[:}]|\{doc\}|\{ref\}|\{numref\}|\{eq\}")
RUN_TIMEOUT_S = 900  # one chapter's Run All Cells
MOVE_TIMEOUT_MS = 60_000  # the kernel's redraw after a slider move

TIMES: dict[str, float] = REPORT["jupyterlab_times"]

# JupyterLab's user settings for the test: its defaults (cell windowing included, as a
# learner has it: jupyterlab-myst then renders a cell before the ones far below it), with
# no autosave, no news and no update check.
SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "checkForUpdates": False,
        "fetchNews": "false",
    },
}


def _notebook_docs() -> list[str]:
    return [d for d in toc_docnames() if (ROOT / f"{d}.ipynb").is_file()]


def _chapters() -> list[str]:
    named = os.environ.get("GRADLAB_JUPYTERLAB_CHAPTERS")
    if named:
        return [d.strip().removesuffix(".ipynb") for d in named.split(",") if d.strip()]
    if os.environ.get("GRADLAB_JUPYTERLAB_ALL") == "1":
        return _notebook_docs()
    return [d for d in CI_CHAPTERS if d in _notebook_docs()]


# ----------------------------------------------------------------------------- server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


@pytest.fixture(scope="session")
def jupyterlab():
    """Base URL of a JupyterLab server over the repository, for the session."""
    try:
        import jupyterlab_myst  # noqa: F401
    except ImportError:
        pytest.fail(
            "jupyterlab-myst is not installed: pip install -r requirements.txt",
            pytrace=False,
        )
    with tempfile.TemporaryDirectory(prefix="gradlab-jupyterlab-") as tmp:
        home = Path(tmp)
        settings = home / "settings"
        for name, values in SETTINGS.items():
            path = settings / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ)
        env.update(
            JUPYTERLAB_SETTINGS_DIR=str(settings),
            JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
            JUPYTER_RUNTIME_DIR=str(home / "runtime"),
            JUPYTER_CONFIG_DIR=str(home / "config"),
            PYTHONUNBUFFERED="1",
        )
        port = _free_port()
        command = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            "--IdentityProvider.token=",
            "--ServerApp.password=",
            "--ServerApp.disable_check_xsrf=True",
            f"--ServerApp.root_dir={JUPYTERLAB_ROOT}",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-root")
        log = (home / "server.log").open("w")
        server = subprocess.Popen(
            command, cwd=JUPYTERLAB_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        base = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                pytest.fail(
                    "jupyter lab exited:\n" + (home / "server.log").read_text()[-3000:],
                    pytrace=False,
                )
            with contextlib.suppress(OSError):
                _get(base + "api/status")
                break
            if time.monotonic() > deadline:
                server.kill()
                pytest.fail("jupyter lab did not start within 120 s", pytrace=False)
            time.sleep(0.5)
        try:
            yield base
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            log.close()


def _shut_down_kernels(base: str) -> None:
    for session in json.loads(_get(base + "api/sessions")):
        request = urllib.request.Request(base + f"api/sessions/{session['id']}", method="DELETE")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(request, timeout=30).close()


@pytest.fixture(scope="session")
def lab_shots(screenshot_dir) -> Path:
    # After screenshot_dir, which empties test-artifacts/screenshots once per session.
    SHOTS.mkdir(parents=True, exist_ok=True)
    return SHOTS


# ----------------------------------------------------------------------------- page


class Lab:
    """A notebook open in JupyterLab, and what the browser reported meanwhile."""

    def __init__(self, browser, base: str, doc: str, slug: str = ""):
        self.doc = doc
        self.slug = slug or doc.removeprefix("book/").replace("/", "-")
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.console_errors: list[str] = []
        self.page_errors: list[str] = []
        self.external: list[str] = []
        self.context.route(
            lambda url: not url.startswith(base) and not url.startswith(("data:", "blob:")),
            self._block,
        )
        self.page = self.context.new_page()
        self.page.on(
            "console",
            lambda m: self.console_errors.append(m.text) if m.type == "error" else None,
        )
        self.page.on("pageerror", lambda e: self.page_errors.append(str(e)))
        self.page.goto(f"{base}lab/tree/{doc}.ipynb?reset", wait_until="load")
        self.page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=120_000)
        self.wait_idle(timeout_s=120)
        # jupyterlab-myst renders the Markdown once the notebook is there: wait for it.
        self.page.wait_for_selector(
            ".jp-MarkdownCell .myst .katex", state="attached", timeout=60_000
        )
        time.sleep(2)

    def notebook_top(self) -> None:
        """Back to the first cell."""
        self.page.locator(".jp-NotebookPanel .jp-Cell").first.scroll_into_view_if_needed()
        time.sleep(0.5)

    def _block(self, route) -> None:
        self.external.append(route.request.url)
        route.abort("blockedbyclient")

    @property
    def notebook(self):
        return self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").first

    def kernel_status(self) -> str:
        return self.page.evaluate(
            """() => {
              const el = document.querySelector(
                '.jp-NotebookPanel .jp-Notebook-ExecutionIndicator');
              if (el && el.dataset.status) { return el.dataset.status; }
              const bar = document.querySelector('#jp-main-statusbar');
              return bar ? bar.innerText : '';
            }"""
        )

    def wait_idle(self, timeout_s: float) -> None:
        """Until the kernel is idle and no cell waits to run ([*])."""
        deadline = time.monotonic() + timeout_s
        quiet_since = None
        while time.monotonic() < deadline:
            busy = self.page.evaluate(
                """() => Array.from(document.querySelectorAll(
                       '.jp-NotebookPanel .jp-CodeCell .jp-InputPrompt'))
                     .some(p => p.textContent.includes('*'))"""
            )
            status = self.kernel_status().lower()
            idle = not busy and "idle" in status and "busy" not in status
            if idle:
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > 1.5:
                    return
            else:
                quiet_since = None
            time.sleep(0.5)
        raise AssertionError(f"{self.doc}: the kernel is not idle after {timeout_s:.0f} s")

    def menu(self, menu: str, item: str) -> None:
        """Click a menu of JupyterLab's menu bar, then one of its items."""
        self.notebook.click(position={"x": 5, "y": 5})  # the notebook has the focus
        self.page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{menu}$")).click()
        self.page.locator(".lm-Menu-item:not(.lm-mod-disabled)", has_text=item).first.click()

    def run_all(self) -> float:
        """Run > Run All Cells, as a learner does; the seconds until the kernel is idle.

        The committed outputs and execution counts are cleared first (Edit > Clear
        Outputs of All Cells), so that every output and count seen afterwards comes from
        this kernel.
        """
        prompts = """() => Array.from(document.querySelectorAll(
                         '.jp-NotebookPanel .jp-CodeCell .jp-InputPrompt'))"""
        self.menu("Edit", "Clear Outputs of All Cells")
        self.page.wait_for_function(
            prompts + ".every(p => !/\\d/.test(p.textContent))", timeout=30_000
        )
        start = time.monotonic()
        self.menu("Run", "Run All Cells")
        self.page.wait_for_function(
            prompts + ".some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))", timeout=60_000
        )
        self.wait_idle(RUN_TIMEOUT_S)
        return time.monotonic() - start

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def lab(browser, jupyterlab, request):
    opened: list[Lab] = []

    def _open(doc: str, slug: str = "") -> Lab:
        opened.append(Lab(browser, jupyterlab, doc, slug))
        return opened[-1]

    yield _open
    for one in opened:
        one.close()
    _shut_down_kernels(jupyterlab)


# ----------------------------------------------------------------------------- checks


def _expected(doc: str) -> dict:
    """What the notebook's source says the page must show."""
    nb = nbformat.read(JUPYTERLAB_ROOT / f"{doc}.ipynb", as_version=4)
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    # An explorable's committed output: the live widget's view, or (executed without a
    # widget-capable kernel) only its precomputed HTML figure.
    widgets = sum(
        "application/vnd.jupyter.widget-view+json" in o.get("data", {})
        or "gradlab-explorable" in str(o.get("data", {}).get("text/html", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )
    return {
        "solutions": len(re.findall(r"^[ \t]*(?::{3,}|`{3,})\{solution\}", markdown, re.M)),
        "gated": len(re.findall(r"^[ \t]*(?::{3,}|`{3,})\{solution-start\}", markdown, re.M)),
        "folded_code": sum(
            c.cell_type == "code" and c.metadata.get("jupyter", {}).get("source_hidden") is True
            for c in nb.cells
        ),
        "widgets": widgets,
        "code_cells": sum(c.cell_type == "code" for c in nb.cells),
    }


_OUTPUT_PROBLEMS_JS = """() => {
  const out = [];
  for (const el of document.querySelectorAll('.jp-NotebookPanel .jp-OutputArea-output')) {
    const mime = el.dataset.mimeType || '';
    if (mime.includes('stderr') || el.classList.contains('jp-mod-error')) {
      out.push(mime + ': ' + el.innerText.slice(0, 600));
    }
  }
  return out;
}"""

# A rendered Markdown cell's text without code blocks (which may show MyST syntax on
# purpose) and without formulas (whose TeX source, e.g. \text{ref}, KaTeX keeps).
_CELL_TEXT_JS = """(cell) => {
  const copy = cell.cloneNode(true);
  copy.querySelectorAll('pre, .katex, .jp-InputArea-editor').forEach((el) => el.remove());
  return copy.textContent;
}"""


# Rendered: jupyterlab-myst's output is there and the editor is not shown. (The class
# jp-mod-rendered is not a test: under windowing a cell rendered on arrival lacks it.)
_RENDERED_JS = """(c) => {
  const editor = c.querySelector('.jp-InputArea-editor');
  const shown = editor && editor.offsetParent !== null && editor.offsetHeight > 0;
  return c.querySelector('.myst') !== null && !shown;
}"""


def _markdown_cells(lab: Lab):
    """Each Markdown cell in turn, scrolled into view and rendered there.

    With JupyterLab's default windowing a cell is rendered when it comes into view, and
    one far out of view may not be: so the cells are checked one at a time, as a reader
    scrolling down meets them.
    """
    cells = lab.page.locator(".jp-NotebookPanel .jp-MarkdownCell")
    for index in range(cells.count()):
        cell = cells.nth(index)
        cell.scroll_into_view_if_needed()
        try:
            lab.page.wait_for_function(
                _RENDERED_JS,
                arg=cell.element_handle(),
                timeout=20_000,
            )
        except Exception as err:  # playwright's TimeoutError
            text = cell.inner_text()[:80]
            raise AssertionError(
                f"{lab.doc}: markdown cell {index + 1} not rendered: {text!r}"
            ) from err
        yield index, cell


def _shot(lab: Lab, locator, name: str) -> None:
    locator.scroll_into_view_if_needed()
    locator.screenshot(path=str(SHOTS / f"{lab.slug}-{name}.png"))


def _check_markdown(lab: Lab, expected: dict) -> None:
    raw: list[str] = []
    formulas = errors = 0
    for _, cell in _markdown_cells(lab):
        raw += [m.group(0) for m in RAW_MYST.finditer(cell.evaluate(_CELL_TEXT_JS))]
        formulas += cell.locator(".katex").count()
        errors += cell.locator(".katex-error").count()
    assert not raw, f"{lab.doc}: raw MyST in the rendered notebook: {sorted(set(raw))}"
    assert errors == 0, f"{lab.doc}: {errors} formulas KaTeX could not render"
    assert formulas > 0, lab.doc
    lab.notebook_top()


def _check_citation(lab: Lab) -> None:
    """A citation shows its author-year text; a click brings its work's cell into view.

    ``booktools.myst_compat`` links a citation to ``this.ipynb#cell-id=<key>``, the cell
    of the cited work at the end of the notebook (JupyterLab finds a cell by its id
    whether windowing has rendered it or not).
    """
    nb = nbformat.read(JUPYTERLAB_ROOT / f"{lab.doc}.ipynb", as_version=4)
    works = {c.id: c.source for c in nb.cells if c.cell_type == "markdown"}
    links = lab.page.locator(".jp-NotebookPanel .jp-MarkdownCell a[href*='#cell-id=']")
    if links.count() == 0:
        sources = "\n".join(works.values())
        assert "#cell-id=" not in sources, f"{lab.doc}: no citation link rendered"
        return
    link = links.first
    key = link.get_attribute("href").split("#cell-id=", 1)[1]
    assert key in works, f"{lab.doc}: a citation of {key!r}, which has no cell"
    assert re.search(r"\(?\d{4}\)?", link.inner_text()), f"{lab.doc}: {link.inner_text()!r}"
    # jupyterlab-myst redraws a cell's Markdown as other cells render: try again then
    for attempt in range(5):
        try:
            links.first.click(timeout=10_000)
            break
        except Exception:  # playwright's Error: "not attached to the DOM"
            if attempt == 4:
                raise
            time.sleep(1)
    # the rendered text only (a cell's hidden editor holds its source, the link's title)
    work = lab.page.locator(".jp-NotebookPanel .jp-MarkdownCell .myst").filter(
        has_text=works[key][:60]
    )
    try:
        work.first.wait_for(state="visible", timeout=30_000)
        lab.page.wait_for_function(
            # JupyterLab scrolls the cell to the centre; cells above it that windowing
            # renders meanwhile may shift it a little (the chapter's text is pages above)
            """(el) => { const r = el.getBoundingClientRect(), h = window.innerHeight;
                 return r.bottom > -h / 2 && r.top < 1.5 * h; }""",
            arg=work.first.element_handle(),
            timeout=30_000,
        )
    except Exception as err:  # playwright's TimeoutError
        lab.page.screenshot(path=str(SHOTS / f"{lab.slug}-citation-click.png"))
        top = work.first.evaluate("el => el.getBoundingClientRect().top") if work.count() else None
        raise AssertionError(
            f"{lab.doc}: a click on a citation of {key} did not bring its cell into view "
            f"(page {lab.page.url}, the cell's top at {top})"
        ) from err
    _shot(lab, work.first, "citation-target")
    lab.notebook_top()


def _check_solutions(lab: Lab, expected: dict) -> None:
    page = lab.page
    wanted = expected["solutions"] + expected["gated"]
    found = 0
    for _, cell in _markdown_cells(lab):
        dropdowns = cell.locator("details").filter(
            has=page.locator("summary", has_text="Solution to")
        )
        for d in range(dropdowns.count()):
            i = found
            found += 1
            box = dropdowns.nth(d)
            assert box.evaluate("d => !d.open"), f"{lab.doc}: solution {i + 1} is open on arrival"
            body = box.locator(":scope > :not(summary)")
            has_body = body.count() > 0 and bool(body.first.text_content().strip())
            if has_body:
                assert not body.first.is_visible(), f"{lab.doc}: solution {i + 1} shows its text"
            if i == 0:
                _shot(lab, box, "solution-folded")
            box.locator("summary").first.click()
            assert box.evaluate("d => d.open"), f"{lab.doc}: solution {i + 1} does not open"
            if has_body:
                assert body.first.is_visible(), f"{lab.doc}: solution {i + 1} opened empty"
            if i == 0:
                _shot(lab, box, "solution-open")
    assert found == wanted, (
        f"{lab.doc}: {found} solution dropdowns, {wanted} solutions in the source"
    )
    # The code of a gated solution: folded into JupyterLab's placeholder bar, opened by
    # a click, like the rest of that solution.
    placeholders = page.locator(".jp-NotebookPanel .jp-CodeCell .jp-InputPlaceholder")
    assert placeholders.count() == expected["folded_code"], (
        f"{lab.doc}: {placeholders.count()} folded code cells, "
        f"{expected['folded_code']} gated solution cells"
    )
    if expected["gated"]:
        assert expected["folded_code"] >= expected["gated"], lab.doc
    folded = page.evaluate(
        """() => Array.from(document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell'))
             .map((c, i) => (c.querySelector('.jp-InputPlaceholder') ? i : -1))
             .filter(i => i >= 0)"""
    )
    for n, index in enumerate(folded):
        cell = page.locator(".jp-NotebookPanel .jp-CodeCell").nth(index)
        editor = cell.locator(".jp-InputArea-editor")
        assert editor.count() == 0 or not editor.first.is_visible(), lab.doc
        if n == 0:
            _shot(lab, cell, "gated-code-folded")
        cell.locator(".jp-InputPlaceholder").click()
        cell.locator(".jp-InputArea-editor").wait_for(state="visible", timeout=10_000)
        prompt = cell.locator(".jp-InputPrompt").first.text_content()
        assert re.search(r"\[\d+\]", prompt), f"{lab.doc}: a gated solution cell did not run"
        if n == 0:
            _shot(lab, cell, "gated-code-open")


def _image_src(panel) -> str:
    return panel.locator("img.widget-image, .widget-image img, img").first.get_attribute("src")


def _slider_text(slider) -> str:
    return slider.locator(".widget-readout").first.inner_text()


def _check_widgets(lab: Lab, expected: dict) -> None:
    page = lab.page
    broken = page.locator(".jp-NotebookPanel .jp-OutputArea-output", has_text="Error displaying")
    assert broken.count() == 0, f"{lab.doc}: a widget failed to display"
    panels = page.locator(".jp-NotebookPanel .jp-OutputArea-output .widget-vbox").filter(
        has=page.locator(".widget-image")
    )
    assert panels.count() == expected["widgets"], (
        f"{lab.doc}: {panels.count()} live widget panels, {expected['widgets']} in the source"
    )
    for p in range(panels.count()):
        panel = panels.nth(p)
        sliders = panel.locator(".widget-slider")
        assert sliders.count() >= 1, f"{lab.doc}: widget {p + 1} has no slider"
        panel.scroll_into_view_if_needed()
        _shot(lab, panel, f"widget{p + 1}")
        for s in range(sliders.count()):
            slider = sliders.nth(s)
            handle = slider.locator(".noUi-handle").first
            where = f"{lab.doc}: widget {p + 1}, slider {s + 1}"
            now = float(handle.get_attribute("aria-valuenow"))
            low = float(handle.get_attribute("aria-valuemin"))
            high = float(handle.get_attribute("aria-valuemax"))
            assert high > low, f"{where}: a slider with one value"
            # By mouse: drag the handle to the far end of the track.
            to_high = now - low < high - now
            before, label = _image_src(panel), _slider_text(slider)
            track = slider.locator(".noUi-base").first.bounding_box()
            grip = handle.bounding_box()
            page.mouse.move(grip["x"] + grip["width"] / 2, grip["y"] + grip["height"] / 2)
            page.mouse.down()
            x = track["x"] + (track["width"] + 20 if to_high else -20)
            page.mouse.move(x, grip["y"] + grip["height"] / 2, steps=8)
            page.mouse.up()
            _wait_redraw(panel, before, f"{where}: mouse drag")
            assert _slider_text(slider) != label, f"{where}: the value label did not change"
            # By keyboard: the other end, from the focused handle.
            before, label = _image_src(panel), _slider_text(slider)
            handle.focus()
            page.keyboard.press("Home" if to_high else "End")
            _wait_redraw(panel, before, f"{where}: keyboard")
            assert _slider_text(slider) != label, f"{where}: the value label did not change"
        _shot(lab, panel, f"widget{p + 1}-moved")


def _wait_redraw(panel, before: str, what: str) -> None:
    deadline = time.monotonic() + MOVE_TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        if _image_src(panel) != before:
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} did not change the figure (no redraw from the kernel)")


# ----------------------------------------------------------------------------- test


@pytest.mark.parametrize("doc", _chapters())
def test_chapter_runs_and_reads_well_in_jupyterlab(doc, lab, lab_shots):
    before = (JUPYTERLAB_ROOT / f"{doc}.ipynb").read_bytes()
    expected = _expected(doc)
    opened = lab(doc)
    page = opened.page
    _check_markdown(opened, expected)  # rendered on opening, before anything runs
    page.screenshot(path=str(SHOTS / f"{opened.slug}-top.png"))
    _check_citation(opened)

    TIMES[doc] = opened.run_all()

    problems = page.evaluate(_OUTPUT_PROBLEMS_JS)
    assert not problems, f"{doc}: error output:\n" + "\n".join(problems)
    # The prompt of every code cell shows its execution count (a folded cell's prompt
    # is checked once _check_solutions has unfolded it).
    prompts = page.evaluate(
        """() => Array.from(document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell'))
             .filter(c => !c.querySelector('.jp-InputPlaceholder'))
             .map(c => c.querySelector('.jp-InputPrompt').textContent)"""
    )
    not_run = [p for p in prompts if not re.search(r"\[\d+\]", p)]
    assert len(prompts) == expected["code_cells"] - expected["folded_code"] and not not_run, (
        f"{doc}: {len(not_run)} of {len(prompts)} code cells did not run"
    )
    _check_markdown(opened, expected)
    _check_solutions(opened, expected)
    _check_widgets(opened, expected)

    assert not opened.page_errors, f"{doc}: uncaught errors: {opened.page_errors}"
    assert not opened.console_errors, f"{doc}: console errors: {opened.console_errors[:10]}"
    assert not opened.external, f"{doc}: requests to other hosts: {opened.external}"
    after = (JUPYTERLAB_ROOT / f"{doc}.ipynb").read_bytes()
    assert after == before, f"{doc}: JupyterLab wrote the notebook"


#: The student edition's notebook opened (not run: its stubs raise NotImplementedError).
STUDENT_CHAPTER = "book/algorithms/clip_norm"


def test_student_edition_reads_the_same_with_its_stubs(lab, lab_shots):
    from booktools import student_edition

    out = JUPYTERLAB_ROOT / "test-artifacts" / "jupyterlab-student"  # under the lab's root
    student_edition.build_student_edition(out, root=JUPYTERLAB_ROOT, html=False, quiet=True)
    rel = STUDENT_CHAPTER.removeprefix("book/")
    doc = (out / "notebooks" / rel).relative_to(JUPYTERLAB_ROOT).as_posix()
    nb = nbformat.read(JUPYTERLAB_ROOT / f"{doc}.ipynb", as_version=4)
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    exercises = len(re.findall(r"^[ \t]*:{3,}\{exercise\}", markdown, re.M))
    stubs = sum(c.cell_type == "code" and "raise NotImplementedError" in c.source for c in nb.cells)
    assert exercises and stubs, f"{doc}: no exercise or no stub to look at"

    opened = lab(doc, slug="student-" + rel.replace("/", "-"))
    page = opened.page
    _check_markdown(opened, {})
    boxes = page.locator(".jp-NotebookPanel .jp-MarkdownCell aside.myst-exercise")
    assert boxes.count() == exercises, (
        f"{doc}: {boxes.count()} exercise boxes, {exercises} exercises"
    )
    solutions = page.locator(".jp-NotebookPanel .jp-MarkdownCell details", has_text="Solution")
    assert solutions.count() == 0, f"{doc}: a solution is left in the student edition"
    assert page.locator(".jp-NotebookPanel .jp-InputPlaceholder").count() == 0, (
        f"{doc}: a folded code cell in the student edition"
    )
    shown = page.locator(".jp-NotebookPanel .jp-CodeCell .jp-InputArea-editor").filter(
        has_text="raise NotImplementedError"
    )
    assert shown.count() == stubs, f"{doc}: {shown.count()} of {stubs} stubs shown"
    _shot(opened, boxes.last, "exercise")
    _shot(opened, shown.first, "stub")
    assert not opened.page_errors, f"{doc}: uncaught errors: {opened.page_errors}"
    assert not opened.console_errors, f"{doc}: console errors: {opened.console_errors[:10]}"
    assert not opened.external, f"{doc}: requests to other hosts: {opened.external}"
