"""Where the built book is and what is in it: shared by conftest.py and the tests."""

from __future__ import annotations

import functools
import gzip
import json
import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SITE = Path(os.environ.get("GRADLAB_SITE", ROOT / "_build" / "html")).resolve()
TOC = Path(os.environ.get("GRADLAB_TOC", ROOT / "_toc.yml")).resolve()
CHROMIUM = os.environ.get("GRADLAB_CHROMIUM", "/usr/bin/chromium")
NODE_MODULES = HERE / "node_modules"
ARTIFACTS = ROOT / "test-artifacts"
SCREENSHOTS = ARTIFACTS / "screenshots"

CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-default-apps",
    "--disable-extensions",
    "--mute-audio",
]

# Browser windows: a desktop one, and a phone held upright (an iPhone 12-15's CSS width).
DESKTOP = {"width": 1200, "height": 900}
PHONE = {"width": 390, "height": 844}

# axe-core, served from node_modules like MathJax and injected into each page.
AXE_JS = NODE_MODULES / "axe-core" / "axe.min.js"

# Files the pages load from CDNs, answered from tests/browser/node_modules.
# https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js -> node_modules/mathjax/es5/...
_CDN = re.compile(
    r"^https://(?:cdn\.jsdelivr\.net/npm|unpkg\.com)/"
    r"(?P<pkg>(?:@[^/@]+/)?[^/@]+)@(?P<version>[^/]+)/(?P<path>[^?#]*)"
)

# Shared across the session; printed by pytest_terminal_summary.
REPORT: dict = {
    "weights": {},
    "gzipped": {},
    "heaviest_files": {},
    "blocked": {},
    "screenshots": 0,
    # (mode, rule, impact) -> [pages], every axe-core violation of every page
    "axe": {},
    # chapter -> seconds of Run All Cells in JupyterLab
    "jupyterlab_times": {},
}


# ----------------------------------------------------------------------------- pages


def toc_docnames(toc: Path = TOC) -> list[str]:
    """Every document of a jupyter-book ``_toc.yml``, in reading order, root first."""
    data = yaml.safe_load(toc.read_text())
    names: list[str] = []

    def walk(node) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for key in ("root", "file"):
                if key in node:
                    names.append(_docname(node[key]))
            for key in ("parts", "chapters", "sections", "subtrees", "entries"):
                if key in node:
                    walk(node[key])

    walk(data)
    return list(dict.fromkeys(names))


def _docname(path: str) -> str:
    path = str(path).strip("/")
    for suffix in (".ipynb", ".md", ".rst"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


@functools.cache
def gzipped_size(path: Path) -> int:
    """Bytes a web server that compresses (as GitHub Pages does) sends for ``path``."""
    return len(gzip.compress(path.read_bytes(), compresslevel=6))


def html_path(doc: str) -> str:
    return f"{doc}.html"


def local_file(url: str, base_url: str) -> Path | None:
    """The file of the site that a same-origin URL points to."""
    if not url.startswith(base_url):
        return None
    path = unquote(urlsplit(url).path).lstrip("/")
    target = SITE / path
    if path == "" or target.is_dir():
        target = target / "index.html"
    return target


def cdn_file(url: str, modules: Path) -> Path | None:
    """The local copy of a CDN URL, if package and major version match the lock."""
    match = _CDN.match(url)
    if not match:
        return None
    package_dir = modules / match["pkg"]
    manifest = package_dir / "package.json"
    if not manifest.is_file():
        return None
    installed = json.loads(manifest.read_text())["version"]
    wanted = match["version"]
    if not (installed == wanted or installed.startswith(wanted + ".")):
        return None
    target = (package_dir / unquote(match["path"])).resolve()
    if package_dir.resolve() not in target.parents or not target.is_file():
        return None
    return target
