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
    assert out.startswith('by [Pascanu et al. (2013)](#pascanu2013difficulty "Razvan Pascanu')
    out = mc.convert_markdown("hard {cite:p}`bengio1994learning,pascanu2013difficulty`.", HERE)
    assert out.startswith("hard [(Bengio et al., 1994](#bengio1994learning ")
    assert "; [Pascanu et al., 2013)](#pascanu2013difficulty " in out
    assert "{cite" not in out
    with pytest.raises(mc.MystCompatError, match="nosuchkey"):
        mc.convert_markdown("{cite:p}`nosuchkey`", HERE)


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
    assert once.startswith("Before [Zhang et al. (2020)](#zhang2020why ")
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
    assert [c.id for c in out.cells] == [*ids, mc.REFERENCES_ID]
    refs = out.cells[-1]
    assert refs.metadata["tags"] == ["remove-cell"]
    assert refs.source.index("(zhang2020why)=") < refs.source.index("(kingma2015adam)=")
    assert out.cells[1].outputs == code_before.outputs
    assert out.cells[4].metadata["jupyter"] == {"source_hidden": True}
    assert "jupyter" not in out.cells[1].metadata and "jupyter" not in out.cells[6].metadata
    assert not mc.convert_notebook(path)  # idempotent


def test_the_book_is_converted():
    """Every page and notebook is written the portable way (run the module if not)."""
    pending = [p for p in mc.book_files() if mc.main([str(p), "--check"])]
    assert pending == [], "run: .venv/bin/python -m booktools.myst_compat"
