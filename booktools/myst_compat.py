"""Rewrite the book's MyST so that it reads the same in JupyterLab and on the site.

JupyterLab renders notebook Markdown with ``jupyterlab-myst`` (mystmd), the site with
Jupyter Book 1 (myst-parser and Sphinx). Two roles the chapters used render in Sphinx
only:

* ``{cite:t}`key``` and ``{cite:p}`key1,key2```: mystmd has no bibliography in a
  notebook and shows the bare key. They become Markdown links with the author-year text
  and the full reference as the link's title. In a notebook the link points into the
  notebook itself, at the cell of the cited work: ``[Pascanu et al.
  (2013)](clip_norm.ipynb#cell-id=pascanu2013difficulty "Pascanu, Mikolov and Bengio.
  ... 2013.")``; in a Markdown page it is ``(#pascanu2013difficulty "...")``. On the
  site ``book/_ext/gradlab_book.py`` reads a link from a notebook to itself as the
  anchor ``#pascanu2013difficulty``, which sphinxcontrib-bibtex resolves to the
  bibliography entry (a citation with its tooltip, written "[Pascanu et al., 2013]"; it
  needs ``:all:`` on the ``{bibliography}`` of ``book/references.md``).
* ``{doc}`/book/x/y```: becomes ``[Title of y](../x/y.ipynb)``, a relative link that
  JupyterLab opens as the other notebook and that Jupyter Book resolves to the page.

Why a notebook does not link to ``#key``: jupyterlab-myst resolves an ``#id`` link
against the targets of the Markdown cells it has rendered so far, and with JupyterLab's
default cell windowing the cells far below the one in view are not rendered yet, so
every such link logged ``No target for internal reference "#key" was found.`` on the
console (``processNotebookMDAST`` in jupyterlab-myst's ``src/myst.ts``). A link with a
file part is an ordinary link to mystmd, never looked up; JupyterLab opens it as the
notebook, already open, and scrolls to the fragment: ``cell-id=<id>`` is JupyterLab's
fragment for a cell, found whether it is rendered or not. Every other in-page link of a
notebook, ``[below](#some-label)``, becomes ``(clip_norm.ipynb#some-label)`` for the same
reason (the site reads it as ``#some-label`` again).

In a notebook the rewrite also keeps two things in step:

* the last markdown cells list the works the notebook cites: a heading cell (id
  ``references``), then one cell per work whose cell id is its citation key, the target
  of its citation links in JupyterLab. All carry the tag ``remove-cell``: the site
  leaves them out;
* the code cells of a gated solution (between ``{solution-start}`` and
  ``{solution-end}``) get ``jupyter.source_hidden``, so that JupyterLab shows them
  folded until clicked, as sphinx-exercise folds them on the site (cell metadata only).

Everything else the chapters use renders in both without change: ``:::{exercise}``
with ``:label:`` (a box), ``:::{solution} label`` with ``:class: dropdown`` (folded
until clicked), the gated markers, dollar math with the macros of the notation cell
(``booktools/headers.py``). Fenced code blocks and inline code are copied verbatim. The
rewrite is idempotent: run it again and nothing changes.

Usage (from the repository root)::

    .venv/bin/python -m booktools.myst_compat                  # every page and notebook
    .venv/bin/python -m booktools.myst_compat book/training/costs.ipynb  # some files
    .venv/bin/python -m booktools.myst_compat --check          # report, change nothing

Markdown cells and the ``source_hidden`` flag only (``nbformat``; the ids, code and
outputs of the other cells untouched), so no notebook needs re-executing.
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
_CODE_SPAN = re.compile(r"(`+).*?(?<!`)\1(?!`)")
# An in-page link of a notebook, in either form: ](#frag or ](this.ipynb#cell-id=frag
_LOCAL_LINK = re.compile(
    r"\]\((?P<file>[^\s()#<>]+\.ipynb)?#(?P<cell>cell-id=)?(?P<frag>[A-Za-z][\w-]*)(?=[\s)])"
)


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


def anchor(source: Path, target: str, *, cell: bool = False) -> str:
    """The URL of a link to ``target`` in the same document.

    ``#target`` in a Markdown page. In a notebook, the notebook itself with the fragment
    (``clip_norm.ipynb#target``; ``clip_norm.ipynb#cell-id=target`` for a cell, which
    JupyterLab finds even when the cell is not rendered): jupyterlab-myst would look a
    bare ``#target`` up among the cells it has rendered so far and log an error when
    the cell is further down (see the module's docstring).
    """
    if source.suffix != ".ipynb":
        return f"#{target}"
    return f"{source.name}#{'cell-id=' if cell else ''}{target}"


def _cite_links(role: str, body: str, refs: dict[str, dict], source: Path, where: str) -> str:
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
        links.append(f'[{text}]({anchor(source, key, cell=True)} "{ref["full"]}")')
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


def _local_link(m: re.Match, source: Path, refs: dict[str, dict]) -> str:
    """An in-page link of a notebook in the form JupyterLab resolves (:func:`anchor`)."""
    if m["file"] not in (None, source.name):  # a link into another notebook
        return m[0]
    if m["cell"] and m["frag"] not in refs:  # a cell id of its own: as it is
        return f"]({source.name}#cell-id={m['frag']}"
    return f"]({anchor(source, m['frag'], cell=m['frag'] in refs)}"


def _convert_line(line: str, source: Path, refs: dict[str, dict], where: str) -> str:
    """The roles of one line, and in a notebook its in-page links outside code spans."""

    def role(m: re.Match) -> str:
        if m["role"] == "doc":
            return _doc_link(m["body"], source, where)
        return _cite_links(m["role"], m["body"], refs, source, where)

    line = _ROLE.sub(role, line)  # a role holds backticks: before the code spans
    if source.suffix != ".ipynb":
        return line
    pieces, start = [], 0
    for code in _CODE_SPAN.finditer(line):
        pieces += [
            _LOCAL_LINK.sub(lambda m: _local_link(m, source, refs), line[start : code.start()]),
            code[0],
        ]
        start = code.end()
    pieces.append(_LOCAL_LINK.sub(lambda m: _local_link(m, source, refs), line[start:]))
    return "".join(pieces)


def convert_markdown(text: str, source: Path, where: str = "") -> str:
    """``text`` (Markdown of ``source``) with its cite and doc roles rewritten.

    In a notebook, in-page links (``[text](#target)``) also point at the notebook itself
    (:func:`anchor`). Code blocks and inline code are left as they are.
    """
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
        out.append(_convert_line(line, source, refs, where))
    return "\n".join(out)


REFERENCES_ID = "references"
REFERENCES_HEADING = "## References"
REFERENCES_INTRO = "Works cited in this chapter (the book's References page lists all)."
# A citation link in a notebook (or the older ](#key "...") form): the key and its title
_LINKED_KEY = re.compile(r"\]\((?:[^\s()#<>]+\.ipynb)?#(?:cell-id=)?(?P<key>[A-Za-z][\w-]*) \"")
_GATE = re.compile(r"^[ \t]*(?:`{3,}|:{3,})[ \t]*\{solution-(?P<edge>start|end)\}", re.M)
_REMOVE = {"tags": ["remove-cell"]}


def references_cells(keys: list[str]) -> list:
    """The markdown cells that list the works a notebook cites, in order of citation.

    A heading cell (id ``references``), then one cell per work with the citation key as
    its cell id, the target of the work's citation links in JupyterLab
    (``#cell-id=key``). Each carries the ``remove-cell`` tag: the site leaves them out
    and links a citation to its bibliography entry instead.
    """
    refs = references()
    cells = [
        nbformat.v4.new_markdown_cell(
            f"{REFERENCES_HEADING}\n\n{REFERENCES_INTRO}", metadata=_REMOVE
        )
    ]
    cells[0].id = REFERENCES_ID
    for key in keys:
        cells.append(nbformat.v4.new_markdown_cell(refs[key]["full"], metadata=_REMOVE))
        cells[-1].id = key
    return cells


def _is_references_cell(cell) -> bool:
    return cell.cell_type == "markdown" and (
        cell.get("id") == REFERENCES_ID
        or (cell.get("id") in references() and "remove-cell" in cell.metadata.get("tags", []))
    )


def _cited_keys(nb) -> list[str]:
    keys: list[str] = []
    for cell in nb.cells:
        if cell.cell_type == "markdown" and not _is_references_cell(cell):
            keys += [
                m["key"] for m in _LINKED_KEY.finditer(cell.source) if m["key"] in references()
            ]
    return list(dict.fromkeys(keys))


def _sync_references_cells(nb, where: str) -> bool:
    keys = _cited_keys(nb)
    kept = [c for c in nb.cells if not _is_references_cell(c)]
    taken = {c.get("id") for c in kept}.intersection([*keys, REFERENCES_ID])
    if taken:
        raise MystCompatError(f"{where}: a cell already has the id {', '.join(sorted(taken))}")
    wanted = references_cells(keys) if keys else []

    def shape(cells: list) -> list:
        return [(c.get("id"), c.source, c.metadata.get("tags")) for c in cells]

    if shape(nb.cells) == shape(kept + wanted):
        return False
    nb.cells = kept + wanted
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

    Besides the roles and links: the last, ``remove-cell`` markdown cells list the
    works cited (:func:`references_cells`, the targets of the citation links in
    JupyterLab), and the code cells of gated solutions get ``jupyter.source_hidden`` so
    that JupyterLab shows them folded.
    """
    nb = nbformat.read(path, as_version=4)
    changed = False
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown" or _is_references_cell(cell):
            continue
        new = convert_markdown(cell.source, path, f"{path.name} cell {index}")
        if new != cell.source:
            cell.source = new
            changed = True
    changed |= _sync_references_cells(nb, path.name)
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
