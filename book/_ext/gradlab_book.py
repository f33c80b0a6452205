"""Two small Sphinx hooks for the book, loaded through ``local_extensions`` in _config.yml.

* The status page (book/appendix/status.md): at every build the versions of Python and
  of the packages that built the book are read from the running environment and handed
  to MyST as the substitution ``{{ build_versions }}`` (a Markdown table), so the page can
  never show a hand-typed version that has gone stale.
* Sphinx 7.4 writes an inline script twice when an extension adds it after the builder
  has started (sphinx-doc/sphinx#13402, fixed in Sphinx 8.2, which Jupyter Book 1 cannot
  use). sphinx-thebe adds ``const THEBE_JS_URL = ...`` that way, so every page threw
  "Identifier 'THEBE_JS_URL' has already been declared". The duplicates are dropped
  before each page is written.
"""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

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


def _add_substitutions(app, config) -> None:
    substitutions = dict(config.myst_substitutions or {})
    substitutions["build_versions"] = versions_table()
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
    app.connect("config-inited", _add_substitutions)
    # Late, after every other extension has added its page scripts.
    app.connect("html-page-context", _drop_duplicate_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
