"""Build the student edition of the book: notebooks and HTML with every solution removed.

Usage (from the repository root)::

    .venv/bin/python -m booktools.student_edition OUTDIR            # notebooks and HTML
    .venv/bin/python -m booktools.student_edition OUTDIR --no-html  # notebooks only (fast)
    .venv/bin/python -m booktools.student_edition OUTDIR --keep-marked-code  # for nbgrader/otter
    .venv/bin/python -m booktools.student_edition OUTDIR --no-html --pdf  # + OUTDIR/pdf/

It writes

* ``OUTDIR/notebooks/``: every chapter notebook under ``book/`` (same sub-folders), with

  - the code between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` (markers
    included) replaced by ``raise NotImplementedError`` at the markers' indentation,
    so the function signature above the markers stays (the nbgrader convention);
  - a code cell inside a gated solution (between ``{solution-start}`` and
    ``{solution-end}``) that has no markers replaced by that stub entirely;
  - the gated ``{solution-start}`` / ``{solution-end}`` markdown cells, any markdown in
    between, and every ``{solution}`` directive block removed;
  - the outputs of the stubbed cells and of the check cells (cells that call one of
    the ``check_*`` functions of the ``gradlab_book.exercises*`` modules, and the first
    code cell after a gated solution) cleared;
    every other cell keeps its outputs (figures included);

* ``OUTDIR/html/``: the HTML book built by Jupyter Book from a temporary copy of the
  project whose notebooks and Markdown pages were stripped the same way, with the
  stored outputs (no execution), ``hide_solutions: true`` for sphinx-exercise, no
  repository, issue or launch buttons and no repository URL (they point at the
  instructor repository, which holds the solutions), and
  without the instructors' page. The solutions are absent from the pages, from the
  page sources Sphinx copies (``_sources``) and from the search index, not hidden.

``--keep-marked-code`` writes notebooks only, with the Markdown solutions removed and
the outputs cleared as above but the marked solution code left in place, as input for
nbgrader or otter-grader (see book/instructors.md). The project's own ``_build`` is
never touched. The instructor notebooks stay the
single source: rebuild the student edition after every change.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import yaml

import gradlab_book

ROOT = Path(__file__).resolve().parents[1]  # booktools runs from the clone, never installed

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
STUB = "raise NotImplementedError"

#: The page for instructors is left out of the student edition.
INSTRUCTOR_PAGES = ("book/instructors",)

#: Not copied into the temporary build project.
_IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "venv",
    "_build",
    ".jupyter_cache",
    "node_modules",
    "__pycache__",
    ".ipynb_checkpoints",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    "*.egg-info",
)

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|:{3,})[ \t]*(?P<info>[^\n]*?)[ \t]*$")


def exercise_checks() -> tuple[str, ...]:
    """The ``check_*`` functions that ``gradlab_book.exercises*`` modules export."""
    names = []
    for info in pkgutil.iter_modules(gradlab_book.__path__):
        if info.name.startswith("exercises"):
            module = importlib.import_module(f"gradlab_book.{info.name}")
            names += [n for n in module.__all__ if n.startswith("check_")]
    return tuple(sorted(names))


#: The self-checks of the chapters; a code cell that calls one is a check cell.
CHECKS = exercise_checks()
_CHECK_CALL = re.compile(r"\b(?:" + "|".join(CHECKS) + r")\s*\(")


class StudentEditionError(Exception):
    """A notebook or page that cannot be stripped safely (e.g. unbalanced markers)."""


# ------------------------------------------------------------------ code cells


def stub_solution_regions(source: str, where: str = "") -> tuple[str, bool]:
    """Replace each ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` region by the stub.

    Returns (new source, whether any region was replaced). A marker is a line whose
    stripped text is exactly the marker. Raises StudentEditionError on an unbalanced
    or nested marker.
    """
    out: list[str] = []
    inside = False
    replaced = False
    for line in source.split("\n"):
        text = line.strip()
        if text == BEGIN:
            if inside:
                raise StudentEditionError(f"{where}: nested {BEGIN}")
            inside = True
            replaced = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(indent + STUB)
        elif text == END:
            if not inside:
                raise StudentEditionError(f"{where}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise StudentEditionError(f"{where}: {BEGIN} without {END}")
    return "\n".join(out), replaced


# -------------------------------------------------------------------- markdown


def _directive_name(info: str) -> str | None:
    """``{solution} label`` -> ``solution``; None for a plain code fence."""
    match = re.match(r"\{([\w:-]+)\}", info)
    return match.group(1) if match else None


def _closing(lines: list[str], start: int, fence: str) -> int:
    """Index of the line closing the fence opened at ``start`` (len(lines) if none)."""
    char, width = fence[0], len(fence)
    for k in range(start + 1, len(lines)):
        text = lines[k].strip()
        if len(text) >= width and set(text) == {char}:
            return k
    return len(lines)


@dataclass
class _MarkdownState:
    """Carried from cell to cell: are we inside a gated solution?"""

    in_gated: bool = False
    removed: list[str] = field(default_factory=list)  # what was taken out, for reports


def strip_markdown(text: str, state: _MarkdownState, where: str = "") -> str:
    """Remove solution directives (plain and gated) from MyST Markdown.

    ``{solution}`` blocks go entirely; a ``{solution-start}`` block starts a gated
    solution that runs, across cells if need be, up to and including the next
    ``{solution-end}`` block. Fenced code that is not a directive is copied verbatim
    (so documentation that *shows* the syntax survives); other directives are
    processed recursively; ``{code-cell}`` blocks get their solution regions stubbed.
    """
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        name = _directive_name(match.group("info")) if match else None
        if state.in_gated:
            if name == "solution-end":
                state.in_gated = False
                i = _closing(lines, i, match.group("fence")) + 1
            else:
                state.removed.append(lines[i])
                i += 1
            continue
        if not match:
            out.append(lines[i])
            i += 1
            continue
        j = _closing(lines, i, match.group("fence"))
        if name == "solution":
            state.removed.extend(lines[i : j + 1])
        elif name == "solution-start":
            state.removed.extend(lines[i : j + 1])
            state.in_gated = True
        elif name == "solution-end":
            raise StudentEditionError(f"{where}: {{solution-end}} without {{solution-start}}")
        elif name is None:
            out.extend(lines[i : j + 1])  # a plain code fence: verbatim
        else:
            inner = "\n".join(lines[i + 1 : j])
            if name == "code-cell":
                inner, _ = stub_solution_regions(inner, where)
            else:
                inner = strip_markdown(inner, state, where)
                if state.in_gated:
                    raise StudentEditionError(
                        f"{where}: a gated solution starts inside a {{{name}}} directive"
                    )
            out.append(lines[i])
            if inner:
                out.append(inner)
            if j < len(lines):
                out.append(lines[j])
        i = j + 1
    return "\n".join(out)


# -------------------------------------------------------------------- notebooks


@dataclass
class StripReport:
    """What happened to one notebook."""

    stubbed_cells: list[str] = field(default_factory=list)  # cell ids
    cleared_check_cells: list[str] = field(default_factory=list)
    removed_markdown_cells: int = 0


def _clear(cell) -> None:
    cell.outputs = []
    cell.execution_count = None


def strip_notebook(nb, where: str = "", *, stub_code: bool = True) -> tuple[object, StripReport]:
    """Return a student copy of notebook ``nb`` (not modified) and what was done.

    With ``stub_code=False`` the marked solution code is kept (outputs cleared), for
    a grading tool such as nbgrader that replaces it itself; the Markdown solutions,
    which those tools do not know about, are removed either way.
    """
    nb = copy.deepcopy(nb)
    state = _MarkdownState()
    report = StripReport()
    cells = []
    after_gated = False  # the next code cell after a gated solution is its check
    for index, cell in enumerate(nb.cells):
        here = f"{where} cell {index}"
        if cell.cell_type == "markdown":
            was_gated = state.in_gated
            source = strip_markdown(cell.source, state, here)
            if was_gated and not state.in_gated:
                after_gated = True
            if source.strip():
                cell.source = source
                cells.append(cell)
            else:
                report.removed_markdown_cells += 1
            continue
        if cell.cell_type != "code":
            if not state.in_gated:
                cells.append(cell)
            continue
        cell_id = cell.get("id", str(index))
        source, replaced = stub_solution_regions(cell.source, here)
        if state.in_gated and not replaced:
            source, replaced = STUB, True
        if replaced:
            if stub_code:
                cell.source = source
            _clear(cell)
            # The instructor notebook folds a gated solution's code in JupyterLab
            # (booktools.myst_compat); the student's stub is there to be filled in.
            cell.metadata.get("jupyter", {}).pop("source_hidden", None)
            if cell.metadata.get("jupyter") == {}:
                del cell.metadata["jupyter"]
            report.stubbed_cells.append(cell_id)
        elif after_gated or _CHECK_CALL.search(cell.source):
            _clear(cell)
            report.cleared_check_cells.append(cell_id)
        if not state.in_gated:
            after_gated = False
        cells.append(cell)
    if state.in_gated:
        raise StudentEditionError(f"{where}: {{solution-start}} without {{solution-end}}")
    nb.cells = cells
    return nb, report


def strip_markdown_file(text: str, where: str = "") -> str:
    state = _MarkdownState()
    out = strip_markdown(text, state, where)
    if state.in_gated:
        raise StudentEditionError(f"{where}: {{solution-start}} without {{solution-end}}")
    return out


def book_notebooks(book_dir: Path) -> list[Path]:
    """Every chapter notebook under ``book_dir`` (build folders and checkpoints excluded)."""
    skip = {"_build", ".ipynb_checkpoints", ".jupyter_cache"}
    return sorted(
        p for p in book_dir.rglob("*.ipynb") if not skip.intersection(p.relative_to(book_dir).parts)
    )


def strip_tree(
    book_dir: Path, out_dir: Path | None = None, *, stub_code: bool = True
) -> dict[Path, StripReport]:
    """Strip every notebook and Markdown page under ``book_dir``.

    With ``out_dir`` the student notebooks are written there (same relative paths)
    and the tree is left alone; without it the files are rewritten in place (used on
    the temporary build copy only).
    """
    reports: dict[Path, StripReport] = {}
    for path in book_notebooks(book_dir):
        rel = path.relative_to(book_dir)
        nb = nbformat.read(path, as_version=4)
        student, report = strip_notebook(nb, str(rel), stub_code=stub_code)
        target = path if out_dir is None else out_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(student, target)
        reports[rel] = report
    if out_dir is None:
        for path in sorted(book_dir.rglob("*.md")):
            if "_build" in path.parts:
                continue
            text = path.read_text(encoding="utf-8")
            stripped = strip_markdown_file(text, str(path.relative_to(book_dir)))
            if stripped != text:
                path.write_text(stripped, encoding="utf-8")
    return reports


# ------------------------------------------------------------------------- HTML


def _drop_pages(entries: list, pages: tuple[str, ...]) -> list:
    kept = []
    for entry in entries:
        if isinstance(entry, dict):
            if str(entry.get("file", "")).removesuffix(".md").removesuffix(".ipynb") in pages:
                continue
            entry = dict(entry)
            for key in ("parts", "chapters", "sections"):
                if key in entry:
                    entry[key] = _drop_pages(entry[key], pages)
        kept.append(entry)
    return kept


def prepare_build_copy(root: Path, workdir: Path) -> Path:
    """Copy the project to ``workdir/book`` and turn the copy into the student edition."""
    project = workdir / "project"
    shutil.copytree(root, project, ignore=_IGNORE, symlinks=False)
    for page in INSTRUCTOR_PAGES:
        for suffix in (".md", ".ipynb"):
            (project / (page + suffix)).unlink(missing_ok=True)
    strip_tree(project / "book")

    config_path = project / "_config.yml"
    config = yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}
    config["title"] = f"{config.get('title', 'Book')} (student edition)"
    config.setdefault("execute", {})["execute_notebooks"] = "off"
    html = config.setdefault("html", {})
    for key in ("use_repository_button", "use_issues_button", "use_edit_page_button"):
        html[key] = False
    config.pop("repository", None)  # the instructor repository holds the solutions
    config["launch_buttons"] = {"binderhub_url": "", "colab_url": "", "thebe": False}
    sphinx = config.setdefault("sphinx", {})
    sphinx.setdefault("config", {})["hide_solutions"] = True
    config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")

    toc_path = project / "_toc.yml"
    toc = yaml.safe_load(toc_path.read_text(encoding="utf-8"))
    for key in ("parts", "chapters", "sections"):
        if key in toc:
            toc[key] = _drop_pages(toc[key], INSTRUCTOR_PAGES)
    toc_path.write_text(yaml.safe_dump(toc, sort_keys=False), encoding="utf-8")
    return project


def _jupyter_book() -> list[str]:
    exe = Path(sys.executable).parent / "jupyter-book"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("jupyter-book")
    if not found:
        raise StudentEditionError("jupyter-book is not installed in this environment")
    return [found]


def build_html(root: Path, html_out: Path, *, quiet: bool = False) -> None:
    """Build the student HTML from a temporary stripped copy of ``root``."""
    with tempfile.TemporaryDirectory(prefix="gradlab-student-") as tmp:
        project = prepare_build_copy(root, Path(tmp))
        command = [*_jupyter_book(), "build", str(project), "--keep-going"]
        result = subprocess.run(command, capture_output=True, text=True, cwd=project)
        if not quiet or result.returncode:
            sys.stdout.write(result.stdout[-4000:])
            sys.stderr.write(result.stderr[-4000:])
        built = project / "_build" / "html"
        if result.returncode or not (built / "index.html").exists():
            raise StudentEditionError(f"jupyter-book build failed (exit {result.returncode})")
        if html_out.exists():
            shutil.rmtree(html_out)
        shutil.copytree(built, html_out)


# -------------------------------------------------------------------------- PDF

#: Where ``--pdf`` writes the student PDF and the XeLaTeX log (tests/pdf reads both).
PDF_NAME = "gradlab-student.pdf"


def build_pdf(root: Path, pdf_out: Path, *, quiet: bool = False) -> Path:
    """Build the student PDF (XeLaTeX) from a temporary stripped copy of ``root``.

    Same copy as :func:`build_html` (solutions removed, ``hide_solutions: true``), built
    with ``--builder pdflatex``; writes ``pdf_out/gradlab-student.pdf`` and its ``.log``.
    Needs texlive (see ``scripts/build_pdf.sh``).
    """
    with tempfile.TemporaryDirectory(prefix="gradlab-student-pdf-") as tmp:
        project = prepare_build_copy(root, Path(tmp))
        command = [*_jupyter_book(), "build", str(project), "--builder", "pdflatex"]
        result = subprocess.run(command, capture_output=True, text=True, cwd=project)
        if not quiet or result.returncode:
            sys.stdout.write(result.stdout[-4000:])
            sys.stderr.write(result.stderr[-4000:])
        built = sorted((project / "_build" / "latex").glob("*.pdf"))
        if result.returncode or len(built) != 1:
            raise StudentEditionError(f"jupyter-book PDF build failed (exit {result.returncode})")
        pdf_out.mkdir(parents=True, exist_ok=True)
        target = pdf_out / PDF_NAME
        shutil.copyfile(built[0], target)
        log = built[0].with_suffix(".log")
        if log.exists():
            shutil.copyfile(log, target.with_suffix(".log"))
        return target


# -------------------------------------------------------------------------- CLI


def build_student_edition(
    out_dir: Path,
    *,
    root: Path = ROOT,
    html: bool = True,
    quiet: bool = False,
    stub_code: bool = True,
) -> dict[Path, StripReport]:
    """Write ``out_dir/notebooks`` (and ``out_dir/html``); return the per-notebook reports."""
    out_dir.mkdir(parents=True, exist_ok=True)
    notebooks_out = out_dir / "notebooks"
    if notebooks_out.exists():
        shutil.rmtree(notebooks_out)
    reports = strip_tree(root / "book", notebooks_out, stub_code=stub_code)
    if html:
        build_html(root, out_dir / "html", quiet=quiet)
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build the student edition (notebooks and HTML, solutions removed)."
    )
    parser.add_argument("outdir", type=Path, help="where to write notebooks/ and html/")
    parser.add_argument("--no-html", action="store_true", help="write the notebooks only")
    parser.add_argument(
        "--keep-marked-code",
        action="store_true",
        help="notebooks only: remove the Markdown solutions but keep the code between the "
        "solution markers, for nbgrader or otter-grader to replace",
    )
    parser.add_argument(
        "--pdf",
        action="store_true",
        help=f"also build the student PDF, OUTDIR/pdf/{PDF_NAME} (needs texlive; "
        "see scripts/build_pdf.sh)",
    )
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the project root (default: this repository)"
    )
    args = parser.parse_args(argv)
    out_dir = args.outdir.resolve()
    root = args.root.resolve()
    if out_dir == root or (root / "book") in (out_dir, *out_dir.parents):
        parser.error("OUTDIR must not be the project itself or lie inside book/")
    if out_dir.exists() and any(
        p.name not in ("notebooks", "html", "pdf") for p in out_dir.iterdir()
    ):
        parser.error(f"{out_dir} holds other files: choose an empty or new folder")
    try:
        reports = build_student_edition(
            out_dir,
            root=root,
            html=not (args.no_html or args.keep_marked_code),
            stub_code=not args.keep_marked_code,
        )
        pdf = build_pdf(root, out_dir / "pdf") if args.pdf else None
    except StudentEditionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for rel, report in reports.items():
        print(
            f"{rel}: {len(report.stubbed_cells)} solution cell(s) stubbed, "
            f"{len(report.cleared_check_cells)} check cell(s) cleared, "
            f"{report.removed_markdown_cells} markdown cell(s) removed"
        )
    print(f"Student notebooks: {out_dir / 'notebooks'}")
    if not (args.no_html or args.keep_marked_code):
        print(f"Student HTML: {out_dir / 'html' / 'index.html'}")
    if pdf is not None:
        print(f"Student PDF: {pdf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
