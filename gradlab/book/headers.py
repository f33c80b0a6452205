"""Give every notebook the two header cells it needs outside the built book.

1. *Notation*: the book defines its MathJax macros once, under ``mathjax3_config`` in
   ``_config.yml``. A notebook opened in JupyterLab or Colab never sees that file, so
   each notebook starts with a markdown cell of ``\\newcommand`` definitions generated
   from it.
2. *Setup*: a code cell that installs ``gradlab`` when the kernel lacks it (Colab, or a
   Binder image), so the launch buttons open notebooks that run.

Both cells have the ``remove-cell`` tag: the built book, which has the macros and the
package already, leaves them out. Run after changing a macro:
``.venv/bin/python -m gradlab.book.headers``; the test suite fails if any notebook's
header is missing or stale (``--check``). Re-execute the notebooks you changed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- notation: generated from _config.yml by gradlab/book/headers.py -->"
HEADER_IDS = ("notation", "setup")
SETUP_SOURCE = """\
# Colab, Binder or any fresh kernel: install gradlab if it is missing.
import importlib.util

if importlib.util.find_spec("gradlab") is None:
    %pip install --quiet "gradlab[book] @ git+https://github.com/gradlab/gradlab"\
"""


def macro_cell_source(config_path: Path = ROOT / "_config.yml") -> str:
    """The markdown of the notation cell, from the book's MathJax macros."""
    config = yaml.safe_load(config_path.read_text())
    macros = config["sphinx"]["config"]["mathjax3_config"]["tex"]["macros"]
    lines = [MARKER]
    for name, body in macros.items():
        if isinstance(body, list):
            definition, arity = body
            lines.append(f"$\\newcommand{{\\{name}}}[{arity}]{{{definition}}}$")
        else:
            lines.append(f"$\\newcommand{{\\{name}}}{{{body}}}$")
    return "\n".join(lines)


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
