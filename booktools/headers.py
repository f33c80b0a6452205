"""Give every notebook the two header cells it needs outside the built book.

1. *Notation*: the book defines its MathJax macros once, under ``mathjax3_config`` in
   ``_config.yml``. A notebook opened in JupyterLab or Colab never sees that file, so
   each notebook starts with a markdown cell generated from it: a YAML front matter
   ``math:`` block, which jupyterlab-myst (KaTeX) applies to every cell of the
   notebook, then the same macros as ``\\def`` lines for MathJax (plain JupyterLab,
   Colab), where they stay defined for the cells below. ``\\def`` and not
   ``\\newcommand``: KaTeX refuses to ``\\newcommand`` a macro it already has.
2. *Setup*: a code cell that makes ``gradlab`` and ``gradlab_book`` importable in a
   fresh kernel, so the launch buttons open notebooks that run. Where they are
   importable (a clone with the project installed, Binder, the installed wheels) it
   does nothing and prints nothing (nbval compares that empty output). In a clone
   where they are not installed it puts the clone's two source folders on
   ``sys.path``. Elsewhere (Colab) it pip-installs ``gradlab`` and ``gradlab-book``
   from the repository (``#subdirectory=gradlab-book``) with a constraint that pins
   torch to the kernel's own ``torch.__version__``, so pip never brings a second,
   CUDA build of torch. If that cannot be satisfied (Colab's torch outside the
   library's range, or no network) it prints one sentence saying what to do instead
   of pip's traceback.

Both cells have the ``remove-cell`` tag: the built book, which has the macros and the
package already, leaves them out. Run after changing a macro:
``.venv/bin/python -m booktools.headers``; the test suite fails if any notebook's
header is missing or stale (``--check``). Re-execute the notebooks you changed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import nbformat
import tomllib
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]  # booktools runs from the clone, never installed
MARKER = "<!-- notation: generated from _config.yml by booktools/headers.py -->"
HEADER_IDS = ("notation", "setup")


def _torch_range() -> str:
    """The library's torch requirement (``torch>=2.13,<2.14``), from its pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (torch,) = [d for d in project["dependencies"] if Requirement(d).name == "torch"]
    return torch


SETUP_SOURCE = """\
# A fresh kernel (Colab, a downloaded notebook): make gradlab and
# gradlab_book importable. Silent if they are.
import importlib.util
import pathlib
import subprocess
import sys
import tempfile

if importlib.util.find_spec("gradlab_book") is None:
    here = pathlib.Path.cwd().resolve()
    book_dir = pathlib.Path("gradlab-book", "gradlab_book")
    clone = [p for p in (here, *here.parents) if (p / book_dir).is_dir()]
    url = "git+https://github.com/gradlab/gradlab"
    if clone:  # a clone of the repository: use its code
        sys.path[:0] = [str(clone[0]), str(clone[0] / "gradlab-book")]
    elif importlib.util.find_spec("torch") is None:
        print("This kernel has no torch: install TORCH_RANGE,")
        print("then rerun this cell.")
    else:  # Colab: use the torch it has, never a second (CUDA) build
        import torch

        keep = pathlib.Path(tempfile.mkdtemp()) / "torch.txt"
        keep.write_text(f"torch=={torch.__version__}\\n")
        book = f"gradlab-book @ {url}#subdirectory=gradlab-book"
        pip = [sys.executable, "-m", "pip", "install", "-q"]
        pip += ["-c", str(keep), f"gradlab @ {url}", book]
        if subprocess.run(pip, capture_output=True).returncode:
            print(
                "Could not install gradlab and gradlab-book for this "
                f"kernel's torch {torch.__version__}: they need "
                "TORCH_RANGE and a network connection, so open the "
                "chapter on Binder, or install TORCH_RANGE and rerun "
                "this cell."
            )
        importlib.invalidate_caches()\
""".replace("TORCH_RANGE", _torch_range())


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
