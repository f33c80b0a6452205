"""Give every notebook the two header cells it needs outside the built book.

1. *Notation*: the book defines its MathJax macros once, under ``mathjax3_config`` in
   ``_config.yml``. A notebook opened in JupyterLab or Colab never sees that file, so
   each notebook starts with a markdown cell generated from it: a YAML front matter
   ``math:`` block, which jupyterlab-myst (KaTeX) applies to every cell of the
   notebook, then the same macros as ``\\def`` lines for MathJax (plain JupyterLab,
   Colab), where they stay defined for the cells below. ``\\def`` and not
   ``\\newcommand``: KaTeX refuses to ``\\newcommand`` a macro it already has.
2. *Setup*: a code cell that makes ``gradlab`` importable in a fresh kernel, so the
   launch buttons open notebooks that run. Where gradlab is importable (a local clone
   with the project installed) it does nothing and prints nothing (nbval compares
   that empty output). In a clone where it is not installed (Binder, whose image has
   the requirements) it puts the clone on ``sys.path``; elsewhere (Colab) it
   pip-installs ``gradlab[book]`` from the repository, and if that fails (offline, say)
   it prints one sentence saying what to do instead of pip's traceback.

Both cells have the ``remove-cell`` tag: the built book, which has the macros and the
package already, leaves them out. Run after changing a macro:
``.venv/bin/python -m gradlab.book.headers``; the test suite fails if any notebook's
header is missing or stale (``--check``). Re-execute the notebooks you changed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- notation: generated from _config.yml by gradlab/book/headers.py -->"
HEADER_IDS = ("notation", "setup")
SETUP_SOURCE = """\
# A fresh kernel (Colab, Binder): make gradlab importable. Silent if it is.
import importlib.util
import pathlib
import subprocess
import sys

if importlib.util.find_spec("gradlab") is None:
    here = pathlib.Path.cwd().resolve()
    roots = (here, *here.parents)
    clone = [p for p in roots if (p / "gradlab" / "__init__.py").is_file()]
    url = "git+https://github.com/gradlab/gradlab"
    pip = [sys.executable, "-m", "pip", "install", "-q", f"gradlab[book]@{url}"]
    if clone:  # a clone of the repository (Binder): use its code
        sys.path.insert(0, str(clone[0]))
    elif subprocess.run(pip, capture_output=True).returncode == 0:  # Colab
        importlib.invalidate_caches()
    else:
        print(
            f"Could not install gradlab from {url} (offline?): clone that "
            "repository and run pip install -e '.[book]' in it."
        )\
"""


def macro_cell_source(config_path: Path = ROOT / "_config.yml") -> str:
    """The markdown of the notation cell, from the book's MathJax macros."""
    config = yaml.safe_load(config_path.read_text())
    macros = config["sphinx"]["config"]["mathjax3_config"]["tex"]["macros"]
    front = ["---", "math:"]
    lines = [MARKER]
    for name, body in macros.items():
        definition, arity = body if isinstance(body, list) else (body, 0)
        front.append(f"  '\\{name}': {json.dumps(definition)}")
        params = "".join(f"#{k}" for k in range(1, arity + 1))
        lines.append(f"$\\def\\{name}{params}{{{definition}}}$")
    # The blank line before the closing "---" makes it a rule, not a setext heading
    # of the YAML, in a renderer without front matter (Colab, plain JupyterLab).
    return "\n".join([*front, "", "---", *lines])


def notebooks(root: Path = ROOT) -> list[Path]:
    return sorted(
        p for p in (root / "book").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts
    )


def header_cells(notation: str) -> list:
    """The two cells every notebook starts with."""
    cells = [
        nbformat.v4.new_markdown_cell(notation, metadata={"tags": ["remove-cell"]}),
        nbformat.v4.new_code_cell(SETUP_SOURCE, metadata={"tags": ["remove-cell"]}),
    ]
    for cell, cell_id in zip(cells, HEADER_IDS, strict=True):
        cell.id = cell_id
    return cells


def _is_header(cell) -> bool:
    return cell.get("id") in HEADER_IDS and "remove-cell" in cell.metadata.get("tags", [])


def sync(path: Path, notation: str) -> bool:
    """Insert or refresh the header cells of one notebook; True if they changed."""
    nb = nbformat.read(path, as_version=4)
    wanted = header_cells(notation)
    present = [c for c in nb.cells[: len(HEADER_IDS)] if _is_header(c)]
    if [c.source for c in present] == [c.source for c in wanted]:
        return False
    for new, old in zip(wanted, present, strict=False):
        if new.cell_type == "code" and old.cell_type == "code":
            # Where gradlab is installed the setup cell prints nothing, so a refreshed
            # cell keeps its place in the executed order without a re-run.
            new.execution_count = old.execution_count
            new.outputs = old.outputs
    nb.cells = wanted + nb.cells[len(present) :]
    nbformat.write(nb, path)
    return True


def stale(notation: str) -> list[Path]:
    """The notebooks whose header cells are missing or out of date."""
    wanted = [c.source for c in header_cells(notation)]
    bad = []
    for path in notebooks():
        head = nbformat.read(path, as_version=4).cells[: len(wanted)]
        if [c.source for c in head] != wanted or not all(_is_header(c) for c in head):
            bad.append(path)
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale notebooks")
    args = parser.parse_args()
    source = macro_cell_source()
    if args.check:
        bad = stale(source)
        for path in bad:
            print(f"stale header cells: {path.relative_to(ROOT)}")
        return 1 if bad else 0
    for path in notebooks():
        if sync(path, source):
            print(f"updated {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
