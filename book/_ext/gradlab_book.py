"""Small Sphinx hooks for the book, loaded through ``local_extensions`` in _config.yml.

* The status page (book/appendix/status.md): at every build the versions of Python and
  of the packages that built the book are read from the running environment and handed
  to MyST as the substitution ``{{ build_versions }}`` (a Markdown table), so the page can
  never show a hand-typed version that has gone stale. The book is built from the
  committed outputs, which nbval re-executes and compares in the tests; the substitution
  ``{{ execution_times }}`` gives how long each notebook took when those outputs were
  made, read from the timestamps the kernel left in its cells.
* Sphinx 7.4 writes an inline script twice when an extension adds it after the builder
  has started (sphinx-doc/sphinx#13402, fixed in Sphinx 8.2, which Jupyter Book 1 cannot
  use). sphinx-thebe adds ``const THEBE_JS_URL = ...`` that way, so every page threw
  "Identifier 'THEBE_JS_URL' has already been declared". The duplicates are dropped
  before each page is written.
"""

from __future__ import annotations

import json
import platform
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# (distribution name, what it does for the book)
TOOLS = (
    ("torch", "runs every gradient on the pages"),
    ("gradlab", "the clip/ignore functions and figures"),
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


def _toc_docnames(app) -> list[str]:
    """The book's documents in reading order (sphinx-external-toc reads _toc.yml first)."""
    return list(app.config.external_site_map)


def _add_substitutions(app, config) -> None:
    substitutions = dict(config.myst_substitutions or {})
    substitutions["build_versions"] = versions_table()
    substitutions["execution_times"] = execution_table(Path(app.srcdir), _toc_docnames(app))
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


def setup(app):
    # After sphinx-external-toc has read _toc.yml into the config.
    app.connect("config-inited", _add_substitutions, priority=900)
    # Late, after every other extension has added its page scripts.
    app.connect("html-page-context", _drop_duplicate_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
