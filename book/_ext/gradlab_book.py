"""Small Sphinx hooks for the book, loaded through ``local_extensions`` in _config.yml.

* The status page (book/appendix/status.md): at every build the versions of Python and
  of the packages that built the book are read from the running environment and handed
  to MyST as the substitution ``{{ build_versions }}`` (a Markdown table), so the page can
  never show a hand-typed version that has gone stale. The book is built from the
  committed outputs, which nbval re-executes and compares in the tests; the substitution
  ``{{ execution_times }}`` gives how long each notebook took when those outputs were
  made, read from the timestamps the kernel left in its cells. ``{{ recorded_platform }}``
  names the machine that recorded the experiments' data: the ``"platform"`` entry
  (``gradlab_book.stored.platform()``) each seeded experiment stores in its data file.
* Sphinx 7.4 writes an inline script twice when an extension adds it after the builder
  has started (sphinx-doc/sphinx#13402, fixed in Sphinx 8.2, which Jupyter Book 1 cannot
  use). sphinx-thebe adds ``const THEBE_JS_URL = ...`` that way, so every page threw
  "Identifier 'THEBE_JS_URL' has already been declared". The duplicates are dropped
  before each page is written.
* A first-time reader (nothing in localStorage) met "Got invalid theme mode: . Resetting
  to auto." on every page: pydata-sphinx-theme takes its fallback mode from the template
  variable ``default_mode`` (``html_context`` in _config.yml), which Jupyter Book leaves
  unset, so its head script set ``data-mode=""``. _config.yml now sets it to ``auto``; a
  small head script (``_THEME_JS``) also resolves ``auto`` to ``light``/``dark`` before
  the first paint, which the theme only does in a deferred script.
* Accessibility (axe-core, tests/browser): two theme components give buttons a name that
  leaves out their visible text (the search field's "Ctrl+K", the colour-mode icons'
  titles), and docutils marks bibliography entries ``role="doc-biblioentry"`` (deprecated)
  inside a ``role="list"`` that then has no list items. The components are patched as they
  are loaded (``_COMPONENT_PATCHES``) and the role is replaced in each page's body.
* A notebook's in-page links point at the notebook itself (``clip_norm.ipynb#label``,
  ``clip_norm.ipynb#cell-id=key`` for a citation: ``booktools/myst_compat.py`` writes them
  so for JupyterLab). ``_SelfLinks`` turns each back, as the page is read, into the
  anchor ``#label`` / ``#key`` that ``[text](#key)`` gives, before MyST resolves anchors:
  the page then links and cites exactly as with the plain anchor (sphinxcontrib-bibtex
  resolves a citation key), in HTML and in the PDF.
* Figures of notebook outputs come through MyST-NB with their file name as ``alt``. Each
  one drawn by a figure function of ``gradlab_book`` (the last expression of its cell)
  gets that function's docstring, which says what the figure shows.
"""

from __future__ import annotations

import ast
import json
import platform
import re
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from docutils import nodes
from docutils.transforms import Transform
from sphinx import addnodes

# (distribution name, what it does for the book)
TOOLS = (
    ("torch", "runs every gradient on the pages"),
    ("gradlab", "the clip/ignore functions"),
    ("gradlab-book", "the figures, demo models and exercise checks"),
    ("numpy", "arrays behind the figures"),
    ("matplotlib", "draws every figure"),
    ("ipywidgets", "live sliders in a running kernel"),
    ("jupyter-book", "builds the book"),
    ("myst-nb", "executes and renders the notebooks"),
    ("sphinx", "writes the HTML"),
    ("sphinx-book-theme", "page layout, launch buttons"),
    ("sphinx-exercise", "exercises and solutions"),
    ("nbval", "re-runs every notebook in the tests"),
)


# The committed data of the book, from the repository root (the build's source folder).
# A path, not an import: Sphinx loads this module under the name ``gradlab_book``.
DATA = Path("gradlab-book") / "gradlab_book" / "data"


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def versions_table() -> str:
    """The versions as a Markdown table, Python first."""
    rows = [
        "| Package | Version | Role |",
        "| --- | --- | --- |",
        f"| Python | {platform.python_version()} | runs everything |",
    ]
    rows += [f"| {dist} | {_version(dist)} | {role} |" for dist, role in TOOLS]
    return "\n".join(rows)


def _execution_seconds(notebook: Path) -> float | None:
    """Seconds from the first cell's start to the last cell's end, or None if unrecorded."""
    stamps = []
    for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]:
        execution = cell.get("metadata", {}).get("execution", {})
        start, end = execution.get("iopub.execute_input"), execution.get("iopub.status.idle")
        if start and end:
            stamps += [datetime.fromisoformat(start), datetime.fromisoformat(end)]
    return (max(stamps) - min(stamps)).total_seconds() if stamps else None


def execution_table(srcdir: Path, docnames: list[str]) -> str:
    """A Markdown table of each notebook's execution time, in reading order."""
    rows = ["| Notebook | Executed in |", "| --- | --- |"]
    for docname in docnames:
        notebook = srcdir / f"{docname}.ipynb"
        if notebook.is_file():
            seconds = _execution_seconds(notebook)
            shown = "not recorded" if seconds is None else f"{seconds:.1f} s"
            rows.append(f"| {{doc}}`/{docname}` | {shown} |")
    return "\n".join(rows)


# platform() entries, in the order of the status page, and their names there
PLATFORM_FIELDS = (
    ("cpu", "CPU"),
    ("capability", "ATen CPU capability (torch's kernels)"),
    ("torch", "torch"),
    ("torch_blas", "torch's BLAS"),
    ("numpy", "numpy"),
    ("numpy_blas", "numpy's BLAS"),
    ("aten_cpu_capability", "ATEN_CPU_CAPABILITY"),
    ("mkl_cbwr", "MKL_CBWR"),
    ("openblas_coretype", "OPENBLAS_CORETYPE"),
)


def recorded_platforms(data: Path) -> list[tuple[dict, list[str]]]:
    """Each platform the committed data files were recorded on, with those files.

    A data file is a JSON object; a seeded experiment stores ``stored.platform()`` under
    its top-level ``"platform"``. Files without one (benchmarks' timings, hand-made
    tables) are left out. Distinct platforms come in order of their first file.
    """
    found: list[tuple[dict, list[str]]] = []
    for path in sorted(data.glob("*.json")):
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        recorded = content.get("platform") if isinstance(content, dict) else None
        if not isinstance(recorded, dict):
            continue
        for known, files in found:
            if known == recorded:
                files.append(path.name)
                break
        else:
            found.append((recorded, [path.name]))
    return found


def platform_table(data: Path) -> str:
    """The recording platform(s) as a Markdown table, one column per platform."""
    found = recorded_platforms(data)
    if not found:
        return "No data file of this copy records its platform."
    head = "| | " + " | ".join(f"Platform {n + 1}" for n in range(len(found))) + " |"
    rows = [head, "| --- |" + " --- |" * len(found)]
    for key, name in PLATFORM_FIELDS:
        values = [str(p.get(key, "")) or "unset" for p, _ in found]
        rows.append(f"| {name} | " + " | ".join(values) + " |")
    rows.append(
        "| Data files | "
        + " | ".join(", ".join(f"`{f}`" for f in files) for _, files in found)
        + " |"
    )
    return "\n".join(rows)


def _toc_docnames(app) -> list[str]:
    """The book's documents in reading order (sphinx-external-toc reads _toc.yml first)."""
    return list(app.config.external_site_map)


def _add_substitutions(app, config) -> None:
    substitutions = dict(config.myst_substitutions or {})
    substitutions["build_versions"] = versions_table()
    substitutions["execution_times"] = execution_table(Path(app.srcdir), _toc_docnames(app))
    substitutions["recorded_platform"] = platform_table(Path(app.srcdir) / DATA)
    config.myst_substitutions = substitutions


def _drop_duplicate_scripts(app, pagename, templatename, context, doctree) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    seen = set()
    unique = []
    for script in scripts:
        attributes = getattr(script, "attributes", {})
        key = (
            getattr(script, "filename", script) or "",
            getattr(script, "priority", 500),
            tuple(sorted(attributes.items())),
        )
        if key not in seen:
            seen.add(key)
            unique.append(script)
    scripts[:] = unique


# ----------------------------------------------------------------------------- theme mode

# Runs in <head> right after the theme's own mode script: a mode the theme would reject is
# made "auto", and "auto" is resolved now, so the first paint already has the right colours.
_THEME_JS = """
(function () {
  var root = document.documentElement;
  var modes = ['auto', 'light', 'dark'];
  if (modes.indexOf(root.dataset.mode) < 0) { root.dataset.mode = 'auto'; }
  if (root.dataset.theme !== 'light' && root.dataset.theme !== 'dark') {
    var dark = window.matchMedia && window.matchMedia('(prefers-color-scheme: dark)').matches;
    root.dataset.theme = root.dataset.mode === 'auto' ? (dark ? 'dark' : 'light')
                                                      : root.dataset.mode;
  }
})();
""".strip()


# ----------------------------------------------------------------------------- accessibility

_COMPONENT_PATCHES = {
    # The colour-mode icons' titles ("Light", "Dark", ...) become the visible text of a
    # button named "Color mode"; make the icons decorative (Font Awesome then hides them).
    "theme-switcher.html": (
        r'(<i class="theme-switch [^>]*?)\s+title="[^"]*"',
        r'\1 aria-hidden="true"',
    ),
    # The search field reads "Search Ctrl+K" but is named "Search": let its text name it.
    "search-button-field.html": (
        r'(<button class="btn search-button-field[^>]*?)\s+aria-label="[^"]*"',
        r"\1",
    ),
}


class _PatchedComponents:
    """A template loader that serves the theme's own components, patched."""

    def __init__(self, loaders: list) -> None:
        self.loaders = loaders  # the builder's loaders, searched after this one

    def get_source(self, environment, template):
        from jinja2 import TemplateNotFound

        patch = _COMPONENT_PATCHES.get(template)
        if patch is None:
            raise TemplateNotFound(template)
        for loader in self.loaders:
            if loader is self:
                continue
            try:
                source, filename, uptodate = loader.get_source(environment, template)
            except TemplateNotFound:
                continue
            return re.sub(patch[0], patch[1], source), filename, uptodate
        raise TemplateNotFound(template)


def _patch_components(app) -> None:
    templates = getattr(app.builder, "templates", None)
    loaders = getattr(templates, "loaders", None)
    if not isinstance(loaders, list):
        return
    loaders.insert(0, _PatchedComponents(loaders))
    templates.templatepathlen = getattr(templates, "templatepathlen", 0) + 1


def _fix_bibliography_roles(app, pagename, templatename, context, doctree) -> None:
    body = context.get("body")
    if body and 'role="doc-biblioentry"' in body:
        context["body"] = body.replace('role="doc-biblioentry"', 'role="listitem"')


# ----------------------------------------------------------------------------- self links


class _SelfLinks(Transform):
    """``[text](this.ipynb#frag)`` in this notebook -> ``[text](#frag)``."""

    # before myst-parser's ResolveAnchorIds (879), which resolves ``#frag`` links
    default_priority = 870

    def apply(self, **kwargs) -> None:
        env = getattr(self.document.settings, "env", None)
        if env is None:
            return
        for xref in list(self.document.findall(addnodes.pending_xref)):
            fragment = xref.get("reftargetid")
            if not (
                xref.get("reftype") == "myst"
                and xref.get("refdomain") == "doc"
                and xref.get("reftarget") == env.docname
                and fragment
            ):
                continue
            anchor = nodes.reference(
                "", "", id_link=True, refuri="#" + fragment.removeprefix("cell-id=")
            )
            for attribute in ("classes", "ids", "source", "line"):
                if xref.get(attribute):
                    anchor[attribute] = xref[attribute]
            if xref.get("title"):
                anchor["reftitle"] = xref["title"]
            if xref.get("refexplicit"):
                anchor += xref[0].children  # the inline that wraps the link's text
            xref.replace_self(anchor)


# ----------------------------------------------------------------------------- figure alt

_FIGURE_DOCS: dict[str, str] | None = None


def _figure_docs() -> dict[str, str]:
    """First paragraph of the docstring of every function of gradlab_book, by name."""
    global _FIGURE_DOCS
    if _FIGURE_DOCS is None:
        _FIGURE_DOCS = {}
        # The package's folder in this clone, by path: Sphinx loads this module under the
        # package's own name, so find_spec("gradlab_book") answered this file, no package
        # folder, and no figure got its docstring.
        for root in [Path(__file__).resolve().parents[2] / "gradlab-book" / "gradlab_book"]:
            for module in sorted(root.rglob("*.py")):
                try:
                    tree = ast.parse(module.read_text(encoding="utf-8"))
                except (OSError, SyntaxError, ValueError):
                    continue
                for node in tree.body:
                    if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                        doc = ast.get_docstring(node)
                        if doc:
                            first = doc.split("\n\n")[0]
                            _FIGURE_DOCS.setdefault(node.name, " ".join(first.split()))
    return _FIGURE_DOCS


def _called_function(source: str) -> str | None:
    """The name of the function the last expression of a code cell calls, if any."""
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return None
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return None
    call = tree.body[-1].value
    if not isinstance(call, ast.Call):
        return None
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _figure_alts(app, doctree, docname) -> None:
    for image in list(doctree.findall(nodes.image)):
        if image.get("alt"):
            continue
        cell = image.parent
        while cell is not None and cell.get("nb_element") != "cell_code":
            cell = cell.parent
        if cell is None:
            continue
        # Anywhere in the cell: a hide-input cell nests its source in a folding container.
        sources = [
            block.astext()
            for part in cell.findall(
                lambda n: isinstance(n, nodes.Element) and n.get("nb_element") == "cell_code_source"
            )
            for block in part.findall(nodes.literal_block)
        ]
        name = _called_function(sources[0]) if sources else None
        doc = _figure_docs().get(name) if name else None
        if doc:
            image["alt"] = f"Figure: {doc}"


def setup(app):
    # After sphinx-external-toc has read _toc.yml into the config.
    app.connect("config-inited", _add_substitutions, priority=900)
    # Late, after every other extension has added its page scripts.
    app.connect("html-page-context", _drop_duplicate_scripts, priority=900)
    app.connect("html-page-context", _fix_bibliography_roles)
    app.connect("builder-inited", _patch_components)
    app.connect("doctree-resolved", _figure_alts)
    app.add_transform(_SelfLinks)
    # In <head>, before the page is drawn (added here, before the builder starts, so
    # Sphinx 7.4 writes it once).
    app.add_js_file(None, body=_THEME_JS, priority=100)
    # env_version: a new version makes Sphinx re-read every page, so no page keeps a cached
    # doctree or HTML from before a change here.
    return {"parallel_read_safe": True, "parallel_write_safe": True, "env_version": 3}
