"""The PDF edition: _build/pdf/gradlab.pdf and gradlab-student.pdf (scripts/build_pdf.sh).

What a reader of the printed book needs, checked on the built files:

* each PDF opens, and its outline lists the parts and chapters of ``_toc.yml`` in order,
  under the titles the notebooks and pages give themselves (their first heading); the
  numbered chapters are numbered in the table of contents;
* no glyph is missing: XeLaTeX logs no "Missing character", the text has no replacement
  character, and the Unicode the book uses (τ, ε, ‖, γ, ∞, −) is in the text;
* the maths is typeset: no macro of the book is left as text;
* every figure is there: each chapter has as many images as its notebook has image
  outputs (an explorable counts once: its default frame);
* rendered pages are not blank (pdftoppm, then the fraction of non-white pixels); the
  renders go to test-artifacts/pdf/ to look at;
* the solutions are in the appendix chapter "Solutions" of gradlab.pdf, and the student
  PDF has none of them: neither their titles nor any of their text.

The suite skips, saying what to run, when the PDFs are not built.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import unicodedata
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "_build" / "pdf"
ARTIFACTS = ROOT / "test-artifacts" / "pdf"
EDITIONS = {"book": OUT / "gradlab.pdf", "student": OUT / "gradlab-student.pdf"}
#: Left out of the student edition (gradlab.book.student_edition.INSTRUCTOR_PAGES).
INSTRUCTOR_PAGES = ("book/instructors",)
SOLUTIONS = "Solutions"
BIBLIOGRAPHY = "Bibliography"  # sphinx-jupyterbook-latex's entry for the cited works

pypdf = pytest.importorskip(
    "pypdf", reason="tests/pdf reads the outline with pypdf: pip install pypdf==7.1.1"
)
_TOOLS = ("pdfinfo", "pdftotext", "pdfimages", "pdftoppm")
if missing := [tool for tool in _TOOLS if shutil.which(tool) is None]:
    pytest.skip(
        f"tests/pdf needs poppler-utils ({', '.join(missing)} missing): "
        "run 'bash scripts/build_pdf.sh' as root on Debian/Ubuntu, or install poppler-utils",
        allow_module_level=True,
    )
if not_built := [str(p.relative_to(ROOT)) for p in EDITIONS.values() if not p.exists()]:
    pytest.skip(
        f"the PDF edition is not built ({', '.join(not_built)} missing): "
        "run 'bash scripts/build_pdf.sh'",
        allow_module_level=True,
    )


# --------------------------------------------------------------------------- the sources


def _source(docname: str) -> Path:
    for suffix in (".ipynb", ".md"):
        path = ROOT / (docname + suffix)
        if path.exists():
            return path
    raise FileNotFoundError(f"{docname} in _toc.yml has no .ipynb or .md")


def _markdown_texts(path: Path) -> list[str]:
    if path.suffix == ".md":
        return [path.read_text(encoding="utf-8")]
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


def _plain(title: str) -> str:
    """A heading as the outline shows it: no Markdown code marks or emphasis."""
    return re.sub(r"[`*]", "", title).strip()


def first_heading(docname: str) -> str:
    for text in _markdown_texts(_source(docname)):
        text = re.sub(r"\A---\n.*?\n---\n", "", text, flags=re.S)  # front matter
        if match := re.search(r"^# +(.+?)\s*$", text, flags=re.M):
            return _plain(match.group(1))
    raise AssertionError(f"{docname} has no level-1 heading")


@cache
def toc_parts(edition: str) -> list[tuple[str, bool, list[str]]]:
    """(caption, numbered, chapter docnames) of each part, as the edition has them."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    parts = []
    for part in toc["parts"]:
        files = [
            str(ch["file"]).removesuffix(".md").removesuffix(".ipynb") for ch in part["chapters"]
        ]
        if edition == "student":
            files = [f for f in files if f not in INSTRUCTOR_PAGES]
        parts.append((part["caption"], bool(part.get("numbered")), files))
    return parts


def expected_chapters(edition: str) -> list[str]:
    """The chapter titles of the edition's outline, in order."""
    files = [f for _, _, part in toc_parts(edition) for f in part]
    titles = [first_heading(f) for f in files]
    if edition == "book":
        # gradlab_latex.SolutionsToAppendix: a chapter of the last part, before the
        # trailing page(s) that hold the bibliography.
        index = len(files)
        while index and "{bibliography}" in _source(files[index - 1]).read_text("utf-8"):
            index -= 1
        titles.insert(index, SOLUTIONS)
    return titles


def _source_text(docname: str) -> str:
    return _source(docname).read_text(encoding="utf-8")


# --------------------------------------------------------------------------- the PDFs


@cache
def reader(edition: str):
    return pypdf.PdfReader(EDITIONS[edition])


@cache
def outline(edition: str) -> list[tuple[int, str, int]]:
    """(depth, title, 1-based page) of every outline entry, in order."""
    pdf = reader(edition)
    entries: list[tuple[int, str, int]] = []

    def walk(items, depth: int) -> None:
        for item in items:
            if isinstance(item, list):
                walk(item, depth + 1)
            else:
                entries.append((depth, item.title, pdf.get_destination_page_number(item) + 1))

    walk(pdf.outline, 0)
    return entries


def chapter_pages(edition: str) -> list[tuple[str, int, int]]:
    """(title, first page, last page) of each chapter in the outline (depth 1)."""
    starts = [(title, page) for depth, title, page in outline(edition) if depth == 1]
    total = len(reader(edition).pages)
    return [
        (title, page, (starts[i + 1][1] - 1) if i + 1 < len(starts) else total)
        for i, (title, page) in enumerate(starts)
    ]


@cache
def page_texts(edition: str) -> list[str]:
    """The text of every page (pdftotext), NFKC-normalised: math italic 𝜏 reads as τ."""
    text = subprocess.run(
        ["pdftotext", "-enc", "UTF-8", str(EDITIONS[edition]), "-"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [unicodedata.normalize("NFKC", page) for page in text.split("\f")]


def full_text(edition: str) -> str:
    return "\n".join(page_texts(edition))


def squash(text: str) -> str:
    """Letters and digits only, lower case: immune to line breaks, hyphenation, kerning."""
    return re.sub(r"[\W_]+", "", unicodedata.normalize("NFKC", text).lower())


@cache
def images_per_page(edition: str) -> dict[int, int]:
    listing = subprocess.run(
        ["pdfimages", "-list", str(EDITIONS[edition])], capture_output=True, text=True, check=True
    ).stdout.splitlines()[2:]
    counts: dict[int, int] = {}
    for line in listing:
        fields = line.split()
        if len(fields) > 2 and fields[2] == "image":  # not the "smask" alpha channels
            counts[int(fields[0])] = counts.get(int(fields[0]), 0) + 1
    return counts


# ----------------------------------------------------------------------- the notebooks


def _solution_cells(cells: list[dict]) -> list[bool]:
    """Which cells lie inside a gated solution ({solution-start} ... {solution-end})."""
    inside, flags = False, []
    for cell in cells:
        text = "".join(cell["source"]) if cell["cell_type"] == "markdown" else ""
        if "{solution-start}" in text:
            inside = True
        flags.append(inside)
        if "{solution-end}" in text:
            inside = False
    return flags


def _shown_images(cell: dict) -> int:
    tags = set(cell.get("metadata", {}).get("tags", []))
    if tags & {"remove-cell", "remove-output"}:
        return 0
    count = 0
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        html = "".join(data.get("text/html", ""))
        if "image/png" in data or "image/jpeg" in data or 'class="gradlab-frame"' in html:
            count += 1
    return count


def _markdown_images(text: str) -> int:
    return len(re.findall(r"!\[[^\]]*\]\(|^[`:]{3,}\{(?:figure|image)\}", text, flags=re.M))


def expected_images(edition: str) -> dict[str, int]:
    """Images each chapter should have, by chapter title (the solutions' in "Solutions")."""
    import nbformat

    from booktools.student_edition import strip_notebook

    counts: dict[str, int] = {}
    for _, _, files in toc_parts(edition):
        for docname in files:
            path, title = _source(docname), first_heading(docname)
            if path.suffix == ".md":
                counts[title] = _markdown_images(path.read_text(encoding="utf-8"))
                continue
            nb = nbformat.read(path, as_version=4)
            if edition == "student":
                nb, _ = strip_notebook(nb, str(path))
            cells = [dict(c) for c in nb.cells]
            gated = _solution_cells(cells)
            for cell, in_solution in zip(cells, gated, strict=True):
                if cell["cell_type"] == "markdown":
                    n, key = _markdown_images("".join(cell["source"])), title
                else:
                    n = _shown_images(cell)
                    key = SOLUTIONS if in_solution and edition == "book" else title
                counts[key] = counts.get(key, 0) + n
    return counts


def solution_chunks() -> list[str]:
    """Runs of plain prose and code from the solutions of the instructor sources, squashed.

    Taken from what gradlab.book.student_edition removes (``{solution}`` blocks, gated
    solutions and the code between the solution markers), with maths and Markdown marks
    cut out; only runs long enough to be specific, and absent from the student sources
    (so a phrase the exercise itself uses does not count).
    """
    import nbformat

    from booktools import student_edition as se

    removed: list[str] = []
    student_text = []
    for _, _, files in toc_parts("book"):
        for docname in files:
            path = _source(docname)
            if path.suffix == ".md":
                state = se._MarkdownState()
                student_text.append(se.strip_markdown(path.read_text(encoding="utf-8"), state))
                removed += state.removed
                continue
            nb = nbformat.read(path, as_version=4)
            state = se._MarkdownState()
            for cell in nb.cells:
                if cell.cell_type == "markdown":
                    se.strip_markdown(cell.source, state)
                else:
                    region = re.findall(
                        rf"^[ \t]*{se.BEGIN}\n(.*?)^[ \t]*{se.END}", cell.source, re.M | re.S
                    )
                    removed += "\n".join(region).splitlines()
                    if state.in_gated:
                        removed += cell.source.splitlines()
            removed += state.removed
            student, _ = se.strip_notebook(nb, str(path))
            student_text += [c.source for c in student.cells]
    in_student = squash("\n".join(student_text))
    chunks = []
    for line in removed:
        line = re.sub(r"\$\$.*?\$\$|\$[^$]*\$|\{[a-z-]+\}`[^`]*`|^[`:]{3,}.*$", "|", line)
        for run in re.split(r"[|`*]|\\\w+", line):
            key = squash(run)
            if len(key) >= 30 and key not in in_student:
                chunks.append(key)
    return sorted(set(chunks))


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("edition", EDITIONS)
def test_the_pdf_opens_with_the_book_title(edition):
    pdf = reader(edition)
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    assert len(pdf.pages) > 50
    assert pdf.metadata.title.startswith(config["title"])
    info = subprocess.run(
        ["pdfinfo", str(EDITIONS[edition])], capture_output=True, text=True, check=True
    ).stdout
    assert re.search(r"^Pages:\s+\d+", info, flags=re.M)


@pytest.mark.parametrize("edition", EDITIONS)
def test_the_outline_has_the_parts_and_chapters_in_order(edition):
    parts = [title for depth, title, _ in outline(edition) if depth == 0]
    chapters = [title for depth, title, _ in outline(edition) if depth == 1]
    captions = [caption for caption, _, _ in toc_parts(edition)]
    # A part's entry is its caption (gradlab_latex drops LaTeX's own "Part I" numbering).
    assert [re.sub(r"^\s*(?:[IVXLC]+\s+)?", "", p) for p in parts] == captions
    expected = expected_chapters(edition)
    # LaTeX sets a straight apostrophe as a closing quote.
    printed = [c.replace("\u2019", "'") for c in chapters if c != BIBLIOGRAPHY]
    assert printed == expected
    if edition == "student":
        assert SOLUTIONS not in chapters and first_heading("book/instructors") not in chapters


@pytest.mark.parametrize("edition", EDITIONS)
def test_the_numbered_chapters_are_numbered_in_the_contents(edition):
    first_chapter = chapter_pages(edition)[0][1]
    contents = squash(" ".join(page_texts(edition)[: first_chapter - 1]))
    number = 0
    for _, numbered, files in toc_parts(edition):
        for docname in files:
            number += 1
            if numbered:
                assert squash(f"{number} {first_heading(docname)}") in contents, docname


@pytest.mark.parametrize("edition", EDITIONS)
def test_no_glyph_is_missing(edition):
    log = EDITIONS[edition].with_suffix(".log").read_text(encoding="utf-8", errors="replace")
    missing = sorted(set(re.findall(r"Missing character: There is no (.+?) in font", log)))
    assert not missing, f"XeLaTeX had no glyph for {missing}"
    text = full_text(edition)
    assert "\ufffd" not in text
    # The Unicode the book's sources use, in prose, code or maths, is in the text.
    sources = "".join(_source_text(f) for _, _, files in toc_parts(edition) for f in files)
    used = {
        "\N{GREEK SMALL LETTER TAU}": (r"\tau", r"\maxnorm"),
        "\N{GREEK SMALL LETTER EPSILON}": (r"\varepsilon", r"\eps"),
        "\N{DOUBLE VERTICAL LINE}": (r"\|", r"\norm", r"\lVert"),
        "\N{GREEK SMALL LETTER GAMMA}": (r"\gamma", r"\clipcoef"),
        "\N{INFINITY}": (r"\infty",),
        "\N{MINUS SIGN}": (),
    }
    for char, spellings in used.items():
        if char in sources or any(s in sources for s in spellings):
            assert char in text, f"{char} is in the book's sources but not in the PDF's text"


_LIST_MARKER = re.compile(r"^\s{0,3}(?:[-+*]|\d+[.)])\s")


def cut_inline_maths() -> list[str]:
    """Where a line of the sources opens ``$`` inline maths and the next line starts like a
    Markdown list item ("+ 10^{-6})$"): Markdown starts a list there and cuts the maths in
    two, so the web page and the PDF both print it as LaTeX source."""
    found = []
    for _, _, files in toc_parts("book"):
        for docname in files:
            path = _source(docname)
            for text in _markdown_texts(path):
                lines = text.splitlines()
                for line, after in itertools.pairwise(lines):
                    dollars = len(re.findall(r"(?<![\\$])\$(?!\$)", line))
                    if dollars % 2 and _LIST_MARKER.match(after):
                        found.append(f"{path.relative_to(ROOT)}: {after.strip()[:30]}")
    return found


@pytest.mark.parametrize("edition", EDITIONS)
def test_the_maths_is_typeset(edition):
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    macros = config["sphinx"]["config"]["mathjax3_config"]["tex"]["macros"]
    texts = page_texts(edition)
    raw = re.compile(
        r"\\(?:" + "|".join(macros) + r"|frac|left|right|mathbf|operatorname)(?![A-Za-z])"
    )
    printed = {
        title: found
        for title, first, last in chapter_pages(edition)
        if (found := sorted(set(raw.findall("\n".join(texts[first - 1 : last])))))
    }
    if printed and (cut := cut_inline_maths()):
        pytest.xfail(
            f"maths printed as LaTeX source in {sorted(printed)}: inline maths cut by a line "
            f"that Markdown reads as a list item (the web page has it too); join the lines: {cut}"
        )
    assert not printed, f"maths printed as LaTeX source: {printed}"


@pytest.mark.parametrize("edition", EDITIONS)
def test_every_figure_is_present(edition):
    per_page = images_per_page(edition)
    found = {
        title: sum(per_page.get(p, 0) for p in range(first, last + 1))
        for title, first, last in chapter_pages(edition)
    }
    expected = expected_images(edition)
    assert sum(expected.values()) > 10
    for title, count in expected.items():
        assert found.get(title, 0) == count, f"{title}: {found.get(title, 0)} images, not {count}"
    # Nothing before the first chapter or after the last claims an image of its own.
    assert sum(per_page.values()) == sum(expected.values())


def _ink(png: Path) -> float:
    from PIL import Image

    image = Image.open(png).convert("L")
    histogram = image.histogram()
    return sum(histogram[:235]) / (image.width * image.height)


@pytest.mark.parametrize("edition", EDITIONS)
def test_rendered_pages_are_not_blank(edition):
    """The title page, each chapter's first page and each first page with a figure."""
    out = ARTIFACTS / edition
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    per_page = images_per_page(edition)
    pages = {1: "text"}
    for _, first, last in chapter_pages(edition):
        pages.setdefault(first, "text")
        figure = next((p for p in range(first, last + 1) if per_page.get(p)), None)
        if figure:
            pages[figure] = "figure"
    for page, kind in sorted(pages.items()):
        prefix = out / f"page-{page:03d}"
        subprocess.run(
            [
                "pdftoppm",
                "-r",
                "40",
                "-png",
                "-singlefile",
                "-f",
                str(page),
                "-l",
                str(page),
                str(EDITIONS[edition]),
                str(prefix),
            ],
            check=True,
        )
        ink = _ink(prefix.with_suffix(".png"))
        # A page of text inks 2 to 15 % of its pixels; a figure page more; no page all.
        assert (0.004 if kind == "text" else 0.02) < ink < 0.6, f"page {page}: {ink:.1%} ink"


def test_the_solutions_are_in_their_appendix_chapter():
    titles = {title: (first, last) for title, first, last in chapter_pages("book")}
    first, last = titles[SOLUTIONS]
    texts = page_texts("book")
    where = [i + 1 for i, page in enumerate(texts) if "Solution to Exercise" in page]
    assert where, "no solution in gradlab.pdf"
    assert all(first <= page <= last for page in where), where
    chunks = solution_chunks()
    in_appendix = squash(" ".join(texts[first - 1 : last]))
    assert sum(chunk in in_appendix for chunk in chunks) >= 0.8 * len(chunks) > 0


def test_the_student_pdf_has_no_solution():
    text = full_text("student")
    assert "Solution to Exercise" not in text
    assert SOLUTIONS not in [t for d, t, _ in outline("student") if d == 1]
    chunks = solution_chunks()
    book, student = squash(full_text("book")), squash(text)
    shown = [chunk for chunk in chunks if chunk in book]
    assert len(shown) >= 10, "too few solution passages found in gradlab.pdf to compare"
    leaked = [chunk for chunk in shown if chunk in student]
    assert not leaked, f"solution text in the student PDF: {leaked[:3]}"
