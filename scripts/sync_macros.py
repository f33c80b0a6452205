"""Give every notebook the book's MathJax macros, so its maths renders in JupyterLab too.

The book defines its notation once, under ``mathjax3_config`` in ``_config.yml``. A
notebook opened in JupyterLab or Colab never sees that file, so each notebook starts
with a markdown cell of ``\\newcommand`` definitions generated from it; the cell has the
``remove-cell`` tag, so the built book (which has the macros already) leaves it out.

Run after changing a macro: ``.venv/bin/python scripts/sync_macros.py``. The test suite
fails if any notebook's cell is missing or stale (``--check``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- notation: generated from _config.yml by scripts/sync_macros.py -->"


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


def is_macro_cell(cell) -> bool:
    return cell.cell_type == "markdown" and cell.source.startswith(MARKER)


def sync(path: Path, source: str) -> bool:
    """Insert or refresh the notation cell of one notebook; True if it changed."""
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0] if nb.cells else None
    if first is not None and is_macro_cell(first):
        if first.source == source:
            return False
        first.source = source
    else:
        cell = nbformat.v4.new_markdown_cell(source, metadata={"tags": ["remove-cell"]})
        cell.id = "notation"
        nb.cells.insert(0, cell)
    nbformat.write(nb, path)
    return True


def stale(source: str) -> list[Path]:
    """The notebooks whose first cell is not the current notation cell."""
    bad = []
    for path in notebooks():
        nb = nbformat.read(path, as_version=4)
        first = nb.cells[0] if nb.cells else None
        if (
            first is None
            or first.source != source
            or "remove-cell" not in first.metadata.get("tags", [])
        ):
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
            print(f"stale notation cell: {path.relative_to(ROOT)}")
        return 1 if bad else 0
    for path in notebooks():
        if sync(path, source):
            print(f"updated {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
