"""Sphinx hooks for the PDF edition (LaTeX builder), loaded through ``local_extensions``.

Everything here but the last item acts on the LaTeX builder only (``jupyter-book build .
--builder pdflatex``; ``scripts/build_pdf.sh``); the HTML book is left as it is.

* **Maths macros.** The book defines its macros once, for MathJax, in ``_config.yml``
  (``mathjax3_config.tex.macros``). The same macros go into the LaTeX preamble as
  commands (:func:`latex_macros`), so the PDF cannot disagree with the site, with a
  plain-text form of each for the PDF bookmarks (:func:`bookmark_macros`).
* **Explorable figures.** A kernel-free explorable (``gradlab_book.interactive``) is a
  ``text/html`` output: sliders over precomputed PNG frames, with the default frame as the
  ``src`` of its ``<img class="gradlab-frame">``. LaTeX cannot show HTML, so before MyST-NB
  picks each output's MIME type, that default frame is lifted out of the HTML into an
  ``image/png`` alternative of the same output (:class:`ExplorableFrames`), which MyST-NB's
  priority list for the latex builder already prefers to ``text/plain``. The committed
  outputs are used as they are: no notebook has to be re-executed for the PDF.
* **Solutions.** The exercises stay in place; every solution (sphinx-exercise, plain and
  gated) moves to an appendix chapter, "Solutions", grouped by chapter, before the
  references (:class:`SolutionsToAppendix`). The student edition is built from notebooks
  with the solutions removed (``booktools.student_edition --pdf``).
* **Parts.** The parts' captions in ``_toc.yml`` number themselves ("Part I: Foundations"),
  so LaTeX's own "Part I" line above each is dropped.
* **bbm.sty.** sphinx-jupyterbook-latex's class loads it; Debian has it only in
  texlive-fonts-extra (1.4 GB). Where it is missing, a stand-in is written next to the
  .tex (:data:`BBM_STANDIN`).
* **The web page's ".pdf" button** (sphinx-book-theme) only opens the print dialog; it is
  relabelled "Print", so that it does not promise a file (:func:`_honest_print_button`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import html
import re
import shutil
import subprocess
import unicodedata
from pathlib import Path

from docutils import nodes
from sphinx.errors import ExtensionError
from sphinx.transforms.post_transforms import SphinxPostTransform

#: The default frame of an explorable: ``<img class="gradlab-frame" ... src="data:...">``.
_FRAME_IMG = re.compile(r'<img\b[^>]*\bclass="[^"]*\bgradlab-frame\b[^"]*"[^>]*>', re.S)
_SRC = re.compile(r'\bsrc="data:image/png;base64,([A-Za-z0-9+/=\s]+)"')
_ALT = re.compile(r'\balt="([^"]*)"')

#: Title of the chapter the solutions are moved to.
SOLUTIONS_TITLE = "Solutions"


# ----------------------------------------------------------------------------- maths


def latex_macros(macros: dict) -> str:
    """LaTeX definitions of MathJax ``tex.macros`` entries.

    A macro is either a string (no arguments) or ``[body, nargs]`` (MathJax's form; an
    optional third item, a default for the first argument, is honoured too). Each is
    written as ``\\providecommand`` then ``\\renewcommand``, so a name LaTeX already
    defines (``\\sign``, ``\\norm`` in some packages) is replaced rather than an error.
    """
    lines = []
    for name, spec in macros.items():
        if not re.fullmatch(r"[A-Za-z]+", str(name)):
            raise ValueError(f"macro name {name!r} is not a LaTeX control word")
        if isinstance(spec, str):
            body, nargs, default = spec, 0, None
        else:
            body, nargs, *rest = spec
            default = rest[0] if rest else None
        args = f"[{int(nargs)}]" if nargs else ""
        if default is not None:
            args += f"[{default}]"
        lines.append(f"\\providecommand{{\\{name}}}{{}}\\renewcommand{{\\{name}}}{args}{{{body}}}")
    return "\n".join(lines)


#: TeX names whose Unicode name is not "GREEK SMALL/CAPITAL LETTER <NAME>".
_GREEK_VARIANTS = {
    "epsilon": "GREEK LUNATE EPSILON SYMBOL",
    "varepsilon": "GREEK SMALL LETTER EPSILON",
    "vartheta": "GREEK THETA SYMBOL",
    "phi": "GREEK PHI SYMBOL",
    "varphi": "GREEK SMALL LETTER PHI",
    "varpi": "GREEK PI SYMBOL",
    "varrho": "GREEK RHO SYMBOL",
    "varsigma": "GREEK SMALL LETTER FINAL SIGMA",
}


def _greek(name: str) -> str:
    """The Unicode letter of a TeX Greek-letter command (``tau`` -> τ); '' if not Greek."""
    case = "CAPITAL" if name[:1].isupper() else "SMALL"
    for candidate in (_GREEK_VARIANTS.get(name), f"GREEK {case} LETTER {name.upper()}"):
        try:
            if candidate:
                return unicodedata.lookup(candidate)
        except KeyError:
            continue
    return ""


def _blackboard(letter: str) -> str:
    for candidate in (
        f"DOUBLE-STRUCK CAPITAL {letter}",
        f"MATHEMATICAL DOUBLE-STRUCK CAPITAL {letter}",
    ):
        try:
            return unicodedata.lookup(candidate)
        except KeyError:
            continue
    return letter


def pdf_text(body: str) -> str:
    """A plain-Unicode rendering of a macro body, for PDF bookmarks (``\\pdfstringdef``).

    Bookmarks are plain text: ``\\varepsilon`` inside a macro would stop XeLaTeX there
    ("Improper alphabetic constant" under unicode-math), so each macro gets a text form:
    ``\\left\\lVert #1 \\right\\rVert_{#2}`` becomes ``‖#1‖_#2``, ``\\mathbb{R}`` ``ℝ``.
    """
    word_end = r"(?![A-Za-z])"
    text = re.sub(r"\\(?:left|right|[bB]igg?)" + word_end, "", body)
    text = re.sub(r"\\[lr]?Vert" + word_end + r"|\\\|", "‖", text)
    text = re.sub(r"\\[lr]vert" + word_end, "|", text)
    text = re.sub(r"\\mathbb\{(\w)\}", lambda m: _blackboard(m.group(1)), text)
    styled = r"\\(?:mathbf|boldsymbol|bm|mathrm|mathit|operatorname|text)\{([^{}]*)\}"
    text = re.sub(styled, r"\1", text)
    text = re.sub(r"\\([A-Za-z]+)", lambda m: _greek(m.group(1)), text)
    # A subscript keeps its underscore, written as a text command (after the clean-up).
    text = re.sub(r"_\{([^{}]*)\}|_(\S)", lambda m: "\x00" + (m.group(1) or m.group(2)), text)
    text = re.sub(r"\s+", "", text.replace("{", "").replace("}", ""))
    return text.replace("\x00", "\\textunderscore ")


_OPERATORS = ("min", "max", "sup", "inf", "arg", "log", "exp", "lim", "det", "dim", "ker")


def bookmark_macros(macros: dict) -> str:
    """``\\pdfstringdefDisableCommands`` giving each macro its :func:`pdf_text` form."""
    defs = []
    for name, spec in macros.items():
        body, nargs = (spec, 0) if isinstance(spec, str) else (spec[0], int(spec[1]))
        params = "".join(f"#{i}" for i in range(1, nargs + 1))
        defs.append(f"\\def\\{name}{params}{{{pdf_text(body)}}}")
    # amsmath's operator names, which hyperref drops from bookmarks ("removing \\min").
    defs += [f"\\def\\{op}{{{op}}}" for op in _OPERATORS]
    return (
        "\\ifdefined\\pdfstringdefDisableCommands\\pdfstringdefDisableCommands{%\n  "
        + "%\n  ".join(defs)
        + "%\n}\\fi"
    )


def _add_preamble(app, config) -> None:
    elements = dict(config.latex_elements or {})
    # No index: the API page's autodoc entries would need makeindex or xindy (not installed
    # by Debian's TeX packages for XeLaTeX), and a PDF reader searches the text anyway.
    elements["makeindex"] = ""
    elements["printindex"] = ""
    config.latex_domain_indices = False
    config.latex_elements = elements
    macros = ((config.mathjax3_config or {}).get("tex") or {}).get("macros") or {}
    if not macros:
        return
    # A glyph missing from the fonts is reported in the log ("Missing character: There is
    # no ... in font ..."), which tests/pdf searches for: made explicit, whatever the format.
    block = "\\tracinglostchars=2\\relax\n"
    block += "% Maths macros of the book, from mathjax3_config.tex.macros in _config.yml\n"
    block += latex_macros(macros) + "\n" + bookmark_macros(macros) + "\n"
    # The parts' captions in _toc.yml carry their own numbers ("Part I: Foundations"), and
    # the last is "Appendices": LaTeX's own "Part I" line above each would repeat them.
    block += "\\renewcommand{\\thepart}{}\\addto\\captionsenglish{\\renewcommand{\\partname}{}}\n"
    elements["preamble"] = elements.get("preamble", "") + "\n" + block
    config.latex_elements = elements


# ----------------------------------------------------------------------------- figures


def explorable_frame(markup: str) -> tuple[bytes, str] | None:
    """(PNG bytes, alt text) of the default frame of an explorable's HTML, or None."""
    img = _FRAME_IMG.search(markup)
    if not img:
        return None
    src = _SRC.search(img.group(0))
    if not src:
        return None
    try:
        data = base64.b64decode("".join(src.group(1).split()), validate=True)
    except (binascii.Error, ValueError):
        return None
    if not data.startswith(b"\x89PNG"):
        return None
    alt = _ALT.search(img.group(0))
    return data, html.unescape(alt.group(1)) if alt else ""


class ExplorableFrames(SphinxPostTransform):
    """Give each explorable output an ``image/png`` alternative: its default frame.

    Runs on MyST-NB's ``mime_bundle`` containers before its ``SelectMimeType`` (priority
    4) replaces each bundle by one MIME type.
    """

    default_priority = 3
    builders = ("latex",)

    def run(self, **kwargs) -> None:
        app = self.app
        folder = Path(app.outdir).parent / "jupyter_execute" / "gradlab_frames"
        srcdir = Path(app.srcdir).resolve()
        for bundle in list(self.document.findall(nodes.container)):
            if bundle.get("nb_element") != "mime_bundle":
                continue
            kinds = {child.get("mime_type"): child for child in bundle.children}
            if "image/png" in kinds or "text/html" not in kinds:
                continue
            markup = "".join(raw.astext() for raw in kinds["text/html"].findall(nodes.raw))
            frame = explorable_frame(markup)
            if frame is None:
                continue
            data, alt = frame
            path = folder / f"{hashlib.sha256(data).hexdigest()}.png"
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            rel = path.resolve().relative_to(srcdir).as_posix()
            self.env.images.add_file(self.env.docname or "", rel)
            image = nodes.image(uri=rel, candidates={"*": rel}, alt=alt)
            image["classes"].append("gradlab-explorable-frame")
            container = nodes.container(mime_type="image/png")
            container += image
            bundle.insert(0, container)


# ----------------------------------------------------------------------------- solutions


def _walk(node: nodes.Node, parent: nodes.Element | None = None, files: tuple = ()):
    """Yield (node, its parent, the ``start_of_file`` nodes around it), top-down.

    The parents are taken from the descent, not from ``node.parent``: earlier transforms
    (sphinx-jupyterbook-latex) replace nodes without updating their children's parents.
    """
    from sphinx import addnodes

    yield node, parent, files
    inner = (*files, node) if isinstance(node, addnodes.start_of_file) else files
    for child in list(getattr(node, "children", ())):
        yield from _walk(child, node, inner)


class SolutionsToAppendix(SphinxPostTransform):
    """Move every solution of the printed book into an appendix chapter, "Solutions".

    The exercises stay where they are; their solutions follow, chapter by chapter, in a
    chapter of the last part (Appendices), placed before the references. Runs on the whole
    book (the LaTeX builder applies post-transforms to the assembled document), after
    sphinx-exercise has titled each solution "Solution to Exercise N" (priorities 20-22)
    and after sphinx-jupyterbook-latex has arranged the parts and chapters (priority 700).
    Each solution is kept inside a ``start_of_file`` of its own chapter, so the LaTeX
    labels inside it keep their names and every link to or from it still resolves.
    """

    default_priority = 750
    builders = ("latex",)

    def run(self, **kwargs) -> None:
        from sphinx import addnodes

        try:
            from sphinx_exercise.nodes import solution_node
        except ImportError:  # pragma: no cover - sphinx-exercise is in requirements.txt
            return
        solutions = []  # (solution, its parent, its chapter's start_of_file)
        chapters = []  # (start_of_file of a chapter, its parent): inside a part's file
        for node, parent, files in _walk(self.document):
            if isinstance(node, solution_node):
                solutions.append((node, parent, files[-1] if files else None))
            elif isinstance(node, addnodes.start_of_file) and len(files) == 1:
                chapters.append((node, parent))
        if not solutions or not chapters:
            return

        section = nodes.section(ids=["gradlab-solutions"], names=["gradlab-solutions"])
        section += nodes.title(SOLUTIONS_TITLE, SOLUTIONS_TITLE)
        section += nodes.paragraph(
            "",
            "The solutions to the exercises, chapter by chapter. In the web edition and in "
            "the notebooks each one follows its exercise.",
        )
        current = None
        for solution, parent, origin in solutions:
            docname = origin["docname"] if origin is not None else self.env.config.root_doc
            if current is None or current["docname"] != docname:
                current = addnodes.start_of_file(docname=docname)
                chapter = next(origin.findall(nodes.title), None) if origin else None
                if chapter is not None:
                    current += nodes.rubric("", "", *chapter.deepcopy().children)
                section += current
            parent.remove(solution)
            current += solution

        # A chapter of the last part, before the trailing page(s) that hold the bibliography.
        try:
            cite = self.env.get_domain("cite")  # sphinxcontrib-bibtex
        except ExtensionError:
            cite = None
        bib_docs = {getattr(key, "docname", None) for key in getattr(cite, "bibliographies", {})}
        holder = chapters[-1][1]
        last = [chapter for chapter, parent in chapters if parent is holder]
        anchor = None
        for chapter in reversed(last):
            if chapter["docname"] not in bib_docs:
                break
            anchor = chapter
        wrapper = addnodes.start_of_file(docname="gradlab-solutions")
        wrapper += section
        if anchor is not None:
            holder.insert(holder.index(anchor), wrapper)
        else:
            holder.append(wrapper)


# ----------------------------------------------------------------------------- bbm.sty

#: sphinx-jupyterbook-latex's class loads ``bbm`` (for ``\mathbbm``), which Debian ships only
#: in texlive-fonts-extra (0.5 GB download, 1.4 GB installed). The book never uses
#: ``\mathbbm``; where bbm.sty is missing, this stand-in maps it to ``\mathbb``.
BBM_STANDIN = r"""\NeedsTeXFormat{LaTeX2e}
\ProvidesPackage{bbm}[2026/12/01 gradlab stand-in (book/_ext/gradlab_latex.py)]
\RequirePackage{amssymb}
\providecommand{\mathbbm}[1]{\mathbb{#1}}
\endinput
"""


def _has_tex_file(name: str) -> bool:
    kpsewhich = shutil.which("kpsewhich")
    if kpsewhich is None:
        return False
    found = subprocess.run([kpsewhich, name], capture_output=True, text=True, check=False)
    return bool(found.stdout.strip())


def _bbm_standin(app) -> None:
    if app.builder.name != "latex" or _has_tex_file("bbm.sty"):
        return
    out = Path(app.outdir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bbm.sty").write_text(BBM_STANDIN, encoding="utf-8")


# ----------------------------------------------------------------------------- HTML: .pdf


def _honest_print_button(app, pagename, templatename, context, doctree) -> None:
    """sphinx-book-theme's download menu offers ".pdf", which only opens the browser's print
    dialog for the page. Say so: it becomes "Print" (the PDF edition of the whole book is
    ``scripts/build_pdf.sh``'s, see README.md)."""
    for group in context.get("header_buttons") or []:
        for button in group.get("buttons", []) if isinstance(group, dict) else []:
            if button.get("label") == "download-pdf-button":
                button["text"] = "Print"
                button["icon"] = "fas fa-print"
                button["tooltip"] = "Print this page, or save it as PDF, from the print dialog"


def setup(app):
    # After _config.yml (and sphinx-external-toc) have filled the config.
    app.connect("config-inited", _add_preamble, priority=900)
    app.connect("builder-inited", _bbm_standin)
    app.add_post_transform(ExplorableFrames)
    app.add_post_transform(SolutionsToAppendix)
    # After sphinx-book-theme has made its header buttons (priority 501).
    app.connect("html-page-context", _honest_print_button, priority=600)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "env_version": 1}
