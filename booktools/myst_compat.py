"""Rewrite the book's MyST so that it reads the same in JupyterLab and on the site.

JupyterLab renders notebook Markdown with ``jupyterlab-myst`` (mystmd), the site with
Jupyter Book 1 (myst-parser and Sphinx). Two roles the chapters used render in Sphinx
only:

* ``{cite:t}`key``` and ``{cite:p}`key1,key2```: mystmd has no bibliography in a
  notebook and shows the bare key. They become Markdown links to the key,
  ``[Pascanu et al. (2013)](#pascanu2013difficulty "Pascanu, Mikolov and Bengio. On
  the difficulty ... 2013.")``: JupyterLab shows the author-year text with the full
  reference as the link's tooltip; on the site sphinxcontrib-bibtex resolves ``#key``
  to the bibliography entry (a citation with its tooltip, written "[Pascanu et al.,
  2013]"), which needs ``:all:`` on the ``{bibliography}`` of ``book/references.md``.
* ``{doc}`/book/x/y```: becomes ``[Title of y](../x/y.ipynb)``, a relative link that
  JupyterLab opens as the other notebook and that Jupyter Book resolves to the page.

In a notebook the rewrite also keeps two things in step:

* a last markdown cell (id ``references``, tag ``remove-cell``) lists the works the
  notebook cites, each under a ``(key)=`` target: in JupyterLab a citation link jumps to
  its entry there (and previews it on hover); the site leaves the cell out;
* the code cells of a gated solution (between ``{solution-start}`` and
  ``{solution-end}``) get ``jupyter.source_hidden``, so that JupyterLab shows them
  folded until clicked, as sphinx-exercise folds them on the site (cell metadata only).

Everything else the chapters use renders in both without change: ``:::{exercise}``
with ``:label:`` (a box), ``:::{solution} label`` with ``:class: dropdown`` (folded
until clicked), the gated markers, dollar math with the macros of the notation cell
(``booktools/headers.py``). Fenced code blocks are copied verbatim. The rewrite
is idempotent: run it again and nothing changes.

Usage (from the repository root)::

    .venv/bin/python -m booktools.myst_compat                  # every page and notebook
    .venv/bin/python -m booktools.myst_compat book/training/costs.ipynb  # some files
    .venv/bin/python -m booktools.myst_compat --check          # report, change nothing

Markdown cells and the ``source_hidden`` flag only (``nbformat``; cell ids, code and
outputs untouched), so no notebook needs re-executing.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]  # booktools runs from the clone, never installed
BOOK = ROOT / "book"
BIB = BOOK / "references.bib"

_ROLE = re.compile(r"\{(?P<role>cite:[a-z]+|cite|doc)\}`(?P<body>[^`]+)`")
_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})")
_EXPLICIT = re.compile(r"^(?P<text>.*?)\s*<(?P<target>[^<>]+)>$", re.S)


class MystCompatError(Exception):
    """A role that cannot be rewritten (unknown key or document)."""


# ------------------------------------------------------------------ references


_ACCENTS = {
    "'": "\u0301",
    "`": "\u0300",
    "^": "\u0302",
    '"': "\u0308",
    "~": "\u0303",
    "v": "\u030c",
    "c": "\u0327",
    "=": "\u0304",
    ".": "\u0307",
    "u": "\u0306",
    "H": "\u030b",
}


def plain(text: str) -> str:
    """BibTeX markup to plain text: ``Tom{\\'a}{\\v{s}}`` -> ``Tomáš``."""
    import unicodedata

    def accent(match: re.Match) -> str:
        return unicodedata.normalize("NFC", match.group(2) + _ACCENTS[match.group(1)])

    # TeX puts an accent on a dotless i or j (Mart{\'\i}n): here, on the letter
    text = re.sub(r"\\([\'`^\"~=.])\{?\\([ij])\b\}?", accent, text)
    text = re.sub(r"\\([\'`^\"~=.])\{?([A-Za-z])\}?", accent, text)
    text = re.sub(r"\\([vcuH])\{([A-Za-z])\}", accent, text)
    text = re.sub(r"\\([vcuH]) ([A-Za-z])", accent, text)
    text = text.replace("--", "\u2013").replace("\\&", "&")
    return re.sub(r"[{}]", "", text).strip()


@functools.cache
def references(bib: Path = BIB) -> dict[str, dict]:
    """key -> {"short": "Pascanu et al.", "year": "2013", "full": "..."} from the .bib."""
    from pybtex.database import parse_file

    data = parse_file(str(bib))
    out = {}
    for key, entry in data.entries.items():
        people = entry.persons.get("author") or entry.persons.get("editor") or []
        lasts = [plain(" ".join(p.prelast_names + p.last_names)) for p in people]
        if len(lasts) == 1:
            short = lasts[0]
        elif len(lasts) == 2:
            short = f"{lasts[0]} and {lasts[1]}"
        else:
            short = f"{lasts[0]} et al."
        names = [
            plain(" ".join(p.first_names + p.middle_names + p.prelast_names + p.last_names))
            for p in people
        ]
        authors = ", ".join(names[:-1]) + (" and " if len(names) > 1 else "") + names[-1]
        fields = entry.fields
        venue = next(
            (fields[f] for f in ("journal", "booktitle", "school", "publisher") if f in fields),
            "",
        )
        year = plain(fields.get("year", "n.d."))
        full = f"{authors}. {plain(fields.get('title', ''))}"
        full += "" if full.endswith(("?", "!")) else "."
        if venue:
            full += f" {plain(venue)},"
        full += f" {year}."
        out[key] = {"short": short, "year": year, "full": full.replace('"', "'")}
    return out


def _cite_links(role: str, body: str, refs: dict[str, dict], where: str) -> str:
    keys = [k.strip() for k in re.split(r"[,;]", body) if k.strip()]
    unknown = [k for k in keys if k not in refs]
    if unknown:
        raise MystCompatError(f"{where}: unknown citation key(s) {', '.join(unknown)}")
    parenthetical = role in ("cite:p", "cite:ps", "cite")
    links = []
    for n, key in enumerate(keys):
        ref = refs[key]
        if parenthetical:
            text = f"{ref['short']}, {ref['year']}"
            text = ("(" if n == 0 else "") + text + (")" if n == len(keys) - 1 else "")
        else:
            text = f"{ref['short']} ({ref['year']})"
        links.append(f'[{text}](#{key} "{ref["full"]}")')
    return "; ".join(links) if parenthetical else " and ".join(links)


# ------------------------------------------------------------------- documents


def _doc_file(docname: str) -> Path:
    for suffix in (".ipynb", ".md"):
        path = ROOT / (docname.strip("/") + suffix)
        if path.is_file():
            return path
    raise MystCompatError(f"no document {docname}")


@functools.cache
def title(path: Path) -> str:
    """The first level-1 heading of a notebook or Markdown page."""
    if path.suffix == ".ipynb":
        nb = nbformat.read(path, as_version=4)
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    else:
        text = path.read_text(encoding="utf-8")
    match = re.search(r"^# +(.+?)\s*$", text, re.M)
    if not match:
        raise MystCompatError(f"{path}: no level-1 heading to use as a link text")
    return match.group(1)


def _doc_link(body: str, source: Path, where: str) -> str:
    match = _EXPLICIT.match(body)
    text, target = (match["text"], match["target"]) if match else (None, body)
    if not target.startswith("/"):  # relative to the document that links
        target = "/" + str((source.parent / target).relative_to(ROOT))
    try:
        path = _doc_file(target)
    except MystCompatError as err:
        raise MystCompatError(f"{where}: {err}") from None
    rel = Path(os.path.relpath(path, source.parent)).as_posix()
    return f"[{text or title(path)}]({rel})"


# ------------------------------------------------------------------- markdown


def convert_markdown(text: str, source: Path, where: str = "") -> str:
    """``text`` (Markdown of ``source``) with its cite and doc roles rewritten."""
    refs = references()
    out: list[str] = []
    fence: str | None = None
    for line in text.split("\n"):
        match = _FENCE.match(line)
        if fence is not None:  # inside a code block: verbatim
            closes = match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence)
            if closes and not line.strip()[len(match.group(1)) :].strip():
                fence = None
            out.append(line)
            continue
        if match and not line.strip()[len(match.group(1)) :].startswith("{"):
            fence = match.group(1)  # a plain code fence (not a directive)
            out.append(line)
            continue

        def replace(m: re.Match) -> str:
            if m["role"] == "doc":
                return _doc_link(m["body"], source, where)
            return _cite_links(m["role"], m["body"], refs, where)

        out.append(_ROLE.sub(replace, line))
    return "\n".join(out)


REFERENCES_ID = "references"
REFERENCES_HEADING = "## References"
_LINKED_KEY = re.compile(r"\]\(#(?P<key>[A-Za-z][\w-]*) \"")
_GATE = re.compile(r"^[ \t]*(?:`{3,}|:{3,})[ \t]*\{solution-(?P<edge>start|end)\}", re.M)


def references_cell_source(keys: list[str]) -> str:
    """A markdown cell listing the works a notebook cites, each one a MyST target.

    It carries the ``remove-cell`` tag: the site leaves it out (myst-nb does not even
    parse it) and resolves ``#key`` to its bibliography, while in JupyterLab each
    citation link jumps to (and previews, on hover) the entry here.
    """
    refs = references()
    lines = [
        REFERENCES_HEADING,
        "",
        "Works cited in this chapter (the book's References page lists all).",
    ]
    for key in keys:
        lines += ["", f"({key})=", refs[key]["full"]]
    return "\n".join(lines)


def _cited_keys(nb) -> list[str]:
    keys: list[str] = []
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.get("id") != REFERENCES_ID:
            keys += [
                m["key"] for m in _LINKED_KEY.finditer(cell.source) if m["key"] in references()
            ]
    return list(dict.fromkeys(keys))


def _sync_references_cell(nb) -> bool:
    keys = _cited_keys(nb)
    present = [c for c in nb.cells if c.get("id") == REFERENCES_ID]
    if not keys:
        nb.cells = [c for c in nb.cells if c.get("id") != REFERENCES_ID]
        return bool(present)
    source = references_cell_source(keys)
    if present and present[0].source == source and nb.cells[-1] is present[0]:
        return False
    cell = nbformat.v4.new_markdown_cell(source, metadata={"tags": ["remove-cell"]})
    cell.id = REFERENCES_ID
    nb.cells = [c for c in nb.cells if c.get("id") != REFERENCES_ID] + [cell]
    return True


def _hide_gated_code(nb) -> bool:
    """Collapse in JupyterLab the code cells of gated solutions (``jupyter.source_hidden``).

    sphinx-exercise folds a gated solution on the site; JupyterLab cannot fold cells
    from a Markdown directive, but it shows a code cell whose source is hidden as a
    bar that opens on a click. Metadata only: the code, the outputs and the execution
    are untouched.
    """
    changed = False
    inside = False
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for m in _GATE.finditer(cell.source):
                inside = m["edge"] == "start"
        elif cell.cell_type == "code" and inside:
            jupyter = cell.metadata.setdefault("jupyter", {})
            if jupyter.get("source_hidden") is not True:
                jupyter["source_hidden"] = True
                changed = True
    return changed


def convert_notebook(path: Path, *, write: bool = True) -> bool:
    """Rewrite the Markdown cells of one notebook; True if anything changed.

    Besides the roles: a last, ``remove-cell`` markdown cell lists the works cited
    (the targets of the citation links in JupyterLab), and the code cells of gated
    solutions get ``jupyter.source_hidden`` so that JupyterLab shows them folded.
    """
    nb = nbformat.read(path, as_version=4)
    changed = False
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown" or cell.get("id") == REFERENCES_ID:
            continue
        new = convert_markdown(cell.source, path, f"{path.name} cell {index}")
        if new != cell.source:
            cell.source = new
            changed = True
    changed |= _sync_references_cell(nb)
    changed |= _hide_gated_code(nb)
    if changed and write:
        nbformat.write(nb, path)
    return changed


def convert_page(path: Path, *, write: bool = True) -> bool:
    text = path.read_text(encoding="utf-8")
    new = convert_markdown(text, path, path.name)
    if new != text and write:
        path.write_text(new, encoding="utf-8")
    return new != text


def book_files(book: Path = BOOK) -> list[Path]:
    skip = {"_build", ".ipynb_checkpoints", "_ext", "_static"}
    return sorted(
        p
        for p in book.rglob("*")
        if p.suffix in (".ipynb", ".md") and not skip.intersection(p.relative_to(book).parts)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="default: every file under book/")
    parser.add_argument("--check", action="store_true", help="only report what would change")
    args = parser.parse_args(argv)
    files = [p.resolve() for p in args.files] or book_files()
    pending = []
    for path in files:
        convert = convert_notebook if path.suffix == ".ipynb" else convert_page
        if convert(path, write=not args.check):
            pending.append(path)
            verb = "would rewrite" if args.check else "rewrote"
            print(f"{verb} {path.relative_to(ROOT)}")
    return 1 if args.check and pending else 0


if __name__ == "__main__":
    sys.exit(main())
