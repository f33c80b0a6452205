"""The MyST rewrite that makes the chapters read the same in JupyterLab and on the site."""

from __future__ import annotations

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from booktools import myst_compat as mc

ROOT = mc.ROOT
HERE = ROOT / "book" / "algorithms" / "some_chapter.ipynb"  # where the text "lives"


def test_references_are_read_from_the_bib():
    refs = mc.references()
    assert refs["pascanu2013difficulty"]["short"] == "Pascanu et al."
    assert refs["pascanu2013difficulty"]["year"] == "2013"
    assert refs["glorot2010understanding"]["short"] == "Glorot and Bengio"
    assert refs["mikolov2012statistical"]["full"].startswith("Tomáš Mikolov. ")
    assert all('"' not in r["full"] for r in refs.values())


@pytest.mark.parametrize(
    ("bibtex", "text"),
    [
        ("Tom{\\'a}{\\v{s}} Mikolov", "Tomáš Mikolov"),
        ("Mart{\\'\\i}n Abadi", "Martín Abadi"),  # the dotless i takes the accent
        ("Mart{\\'i}n", "Martín"),
        ("Tram{\\`e}r", "Tramèr"),
    ],
)
def test_bibtex_accents_become_letters(bibtex, text):
    assert mc.plain(bibtex) == text


def test_textual_and_parenthetical_citations_become_links_to_the_key():
    out = mc.convert_markdown("by {cite:t}`pascanu2013difficulty`.", HERE)
    assert out.startswith(
        "by [Pascanu et al. (2013)](some_chapter.ipynb#cell-id=pascanu2013difficulty "
        '"Razvan Pascanu'
    )
    out = mc.convert_markdown("hard {cite:p}`bengio1994learning,pascanu2013difficulty`.", HERE)
    assert out.startswith("hard [(Bengio et al., 1994](some_chapter.ipynb#cell-id=bengio1994")
    assert "; [Pascanu et al., 2013)](some_chapter.ipynb#cell-id=pascanu2013difficulty " in out
    assert "{cite" not in out
    # A Markdown page (opened in JupyterLab as a file, not a notebook) keeps the anchor.
    page = mc.convert_markdown("by {cite:t}`pascanu2013difficulty`.", ROOT / "book/intro.md")
    assert page.startswith('by [Pascanu et al. (2013)](#pascanu2013difficulty "Razvan')
    with pytest.raises(mc.MystCompatError, match="nosuchkey"):
        mc.convert_markdown("{cite:p}`nosuchkey`", HERE)


def test_in_page_links_of_a_notebook_point_at_the_notebook():
    """jupyterlab-myst looks a bare ``#target`` up among the cells it has rendered so far:
    with JupyterLab's default windowing a target further down is not rendered yet and the
    link logs "No target for internal reference". A link with a file part it leaves alone.
    """
    old = 'See [Pascanu et al. (2013)](#pascanu2013difficulty "R. P.") and [below](#a-label).'
    out = mc.convert_markdown(old, HERE)
    assert out == (
        'See [Pascanu et al. (2013)](some_chapter.ipynb#cell-id=pascanu2013difficulty "R. P.")'
        " and [below](some_chapter.ipynb#a-label)."
    )
    assert mc.convert_markdown(out, HERE) == out
    kept = (
        "`[x](#a-label)` and [other](../foundations/norms.ipynb#a-label), "
        "[cell](some_chapter.ipynb#cell-id=abc), [site](https://example.org/#a-label)"
    )
    assert mc.convert_markdown(kept, HERE) == kept
    assert mc.convert_markdown("```\n[x](#a-label)\n```", HERE) == "```\n[x](#a-label)\n```"
    page = ROOT / "book" / "intro.md"
    assert mc.convert_markdown("[below](#a-label)", page) == "[below](#a-label)"


def test_doc_roles_become_relative_links_with_the_title():
    out = mc.convert_markdown("See {doc}`/book/foundations/norms` and {doc}`/book/intro`.", HERE)
    assert out == (
        "See [Measuring a gradient: norms](../foundations/norms.ipynb) and "
        f"[{mc.title(ROOT / 'book/intro.md')}](../intro.md)."
    )
    out = mc.convert_markdown("{doc}`the norms chapter </book/foundations/norms>`", HERE)
    assert out == "[the norms chapter](../foundations/norms.ipynb)"
    with pytest.raises(mc.MystCompatError):
        mc.convert_markdown("{doc}`/book/nowhere`", HERE)


def test_code_blocks_are_verbatim_and_the_rewrite_is_idempotent():
    text = (
        "Before {cite:t}`zhang2020why`.\n\n```markdown\nWrite {cite:t}`zhang2020why`.\n```\n\n"
        ":::{exercise}\n:label: e\nSee {doc}`/book/foundations/norms`.\n:::"
    )
    once = mc.convert_markdown(text, HERE)
    assert "```markdown\nWrite {cite:t}`zhang2020why`.\n```" in once
    assert once.startswith("Before [Zhang et al. (2020)](some_chapter.ipynb#cell-id=zhang2020why ")
    assert "See [Measuring a gradient: norms](../foundations/norms.ipynb)." in once
    assert mc.convert_markdown(once, HERE) == once


def test_notebook_gets_a_references_cell_and_folded_gated_code(tmp_path):
    code_before = new_code_cell("x = 1", execution_count=1)
    code_before.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ok\n")]
    gated = new_code_cell("def f():\n    ### BEGIN SOLUTION\n    pass\n    ### END SOLUTION")
    nb = new_notebook(
        cells=[
            new_markdown_cell("# T\n\nAs {cite:t}`zhang2020why` and {cite:p}`kingma2015adam`."),
            code_before,
            new_markdown_cell(":::{exercise}\n:label: e1\nDo.\n:::"),
            new_markdown_cell("```{solution-start} e1\n:class: dropdown\n```"),
            gated,
            new_markdown_cell("```{solution-end}\n```"),
            new_code_cell("f()"),
        ]
    )
    path = tmp_path / "ch.ipynb"
    nbformat.write(nb, path)
    ids = [c.id for c in nb.cells]
    assert mc.convert_notebook(path)
    out = nbformat.read(path, as_version=4)
    # a heading, then one cell per work in order of citation, its key as its cell id:
    # the target of the links (#cell-id=key), which JupyterLab finds rendered or not
    assert [c.id for c in out.cells] == [*ids, mc.REFERENCES_ID, "zhang2020why", "kingma2015adam"]
    refs = out.cells[-3:]
    assert all(c.metadata["tags"] == ["remove-cell"] for c in refs)
    assert refs[0].source.startswith(mc.REFERENCES_HEADING)
    assert refs[1].source == mc.references()["zhang2020why"]["full"]
    assert "ch.ipynb#cell-id=zhang2020why" in out.cells[0].source
    assert out.cells[1].outputs == code_before.outputs
    assert out.cells[4].metadata["jupyter"] == {"source_hidden": True}
    assert "jupyter" not in out.cells[1].metadata and "jupyter" not in out.cells[6].metadata
    assert not mc.convert_notebook(path)  # idempotent


def test_the_older_references_cell_is_replaced(tmp_path):
    """Notebooks written by the previous rewrite: one cell of ``(key)=`` targets."""
    old = new_markdown_cell(
        "## References\n\n(zhang2020why)=\nJ. Zhang.", metadata={"tags": ["remove-cell"]}
    )
    old.id = mc.REFERENCES_ID
    text = new_markdown_cell('By [Zhang et al. (2020)](#zhang2020why "J. Zhang.").')
    path = tmp_path / "ch.ipynb"
    nbformat.write(new_notebook(cells=[text, old]), path)
    assert mc.convert_notebook(path)
    out = nbformat.read(path, as_version=4)
    assert [c.id for c in out.cells] == [text.id, mc.REFERENCES_ID, "zhang2020why"]
    assert "(zhang2020why)=" not in out.cells[1].source
    assert out.cells[0].source.startswith("By [Zhang et al. (2020)](ch.ipynb#cell-id=zhang")
    # a cell of the chapter that already has a key's id would be a second target
    clash = new_code_cell("x = 1")
    clash.id = "zhang2020why"
    nbformat.write(new_notebook(cells=[text, clash]), path)
    with pytest.raises(mc.MystCompatError, match="zhang2020why"):
        mc.convert_notebook(path)


SPHINX_CONF = """
extensions = ["myst_parser", "sphinxcontrib.bibtex"]
bibtex_bibfiles = [{bib!r}]
bibtex_reference_style = "author_year"
nitpicky = True

def setup(app):
    # the book's Sphinx extension, by its path (its module name is the book package's)
    import importlib.util

    spec = importlib.util.spec_from_file_location("gradlab_book_ext", {ext!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    app.add_transform(module._SelfLinks)
"""

SPHINX_PAGE = """# Page

{text}

(a-label)=
## Below

```{{bibliography}}
:all:
```
"""


def _site_html(tmp_path, text: str, name: str) -> str:
    """``text`` built by Sphinx with myst-parser, sphinxcontrib-bibtex and the book's
    self-link transform (book/_ext/gradlab_book.py); a warning fails the build."""
    from sphinx.application import Sphinx
    from sphinx.util.docutils import docutils_namespace

    src = tmp_path / name
    src.mkdir()
    ext = str(ROOT / "book" / "_ext" / "gradlab_book.py")
    (src / "conf.py").write_text(SPHINX_CONF.format(ext=ext, bib=str(mc.BIB)))
    (src / "index.md").write_text(SPHINX_PAGE.format(text=text))
    with docutils_namespace():  # each app registers its nodes afresh
        app = Sphinx(
            src, src, src / "_build", src / "_doctrees", "html", status=None, warningiserror=True
        )
        app.build()
    return (src / "_build" / "index.html").read_text()


def test_the_site_reads_a_link_to_the_notebook_itself_as_the_anchor(tmp_path):
    """On the site a citation to ``page#cell-id=key`` is the citation ``#key`` gives:
    sphinxcontrib-bibtex's author-year link to the bibliography entry; ``page#label``
    links as ``#label`` (a .md page stands for the notebook: the same link kind)."""
    anchors = _site_html(
        tmp_path,
        '[Pascanu et al. (2013)](#pascanu2013difficulty "R. P.") and [below](#a-label).',
        "anchors",
    )
    own = _site_html(
        tmp_path,
        '[Pascanu et al. (2013)](index.md#cell-id=pascanu2013difficulty "R. P.") and '
        "[below](index.md#a-label).",
        "own",
    )

    def body(html: str) -> str:
        return html[html.index("<h1>") : html.index("</section>")]

    assert body(own) == body(anchors)
    assert "Pascanu" in body(own) and 'href="#a-label"' in body(own)
    assert "cell-id" not in own


def test_the_book_is_converted():
    """Every page and notebook is written the portable way (run the module if not)."""
    pending = [p for p in mc.book_files() if mc.main([str(p), "--check"])]
    assert pending == [], "run: .venv/bin/python -m booktools.myst_compat"
