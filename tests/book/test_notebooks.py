"""Properties every chapter notebook must keep (nbval checks their outputs separately)."""

import re

import nbformat
import pytest

from booktools import headers

NOTEBOOKS = headers.notebooks()
IGNORE_MARK = "# NBVAL_IGNORE_OUTPUT"
TIMING_NOTEBOOKS = {"costs"}


def test_there_are_chapters():
    assert len(NOTEBOOKS) >= 9


def test_every_notebook_carries_the_current_header():
    assert headers.stale(headers.macro_cell_source()) == [], (
        "run: .venv/bin/python -m booktools.headers"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_executed_in_order(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    counts = [c.execution_count for c in code]
    assert None not in counts, "every code cell is committed executed"
    assert counts == list(range(1, len(code) + 1)), "executed top to bottom in one kernel"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_only_timings_escape_nbval(path):
    """Timings are the one genuinely variable output, and only the cost chapter has them."""
    nb = nbformat.read(path, as_version=4)
    ignored = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(IGNORE_MARK)]
    if path.stem not in TIMING_NOTEBOOKS:
        assert ignored == [], f"{path.name} hides outputs from nbval"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_memory_addresses_in_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text", "") + str(out.get("data", {}).get("text/plain", ""))
            assert not re.search(r" at 0x[0-9a-f]{6,}", text), text[:200]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_control_characters_in_sources(path):
    # A "\v" or "\b" written in a non-raw Python string lands here as a control
    # character: MathJax fails on it and XeLaTeX stops ("invalid character").
    nb = nbformat.read(path, as_version=4)
    for index, cell in enumerate(nb.cells):
        bad = sorted({hex(ord(ch)) for ch in cell.source if ord(ch) < 32 and ch not in "\n\t"})
        assert not bad, f"cell {index} holds control characters {bad}"
