"""The status page names the machine that recorded the data (book/_ext/gradlab_book.py)."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STATUS = ROOT / "book" / "appendix" / "status.md"


def _extension():
    # by its path: Sphinx loads it under the name of the book's package, gradlab_book
    spec = importlib.util.spec_from_file_location(
        "gradlab_book_ext", ROOT / "book" / "_ext" / "gradlab_book.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PLATFORM = {
    "torch": "2.13.0+cpu",
    "numpy": "2.4.6",
    "cpu": "Some CPU 9000",
    "capability": "AVX512",
    "torch_blas": "mkl",
    "numpy_blas": "scipy-openblas",
    "aten_cpu_capability": "",
    "mkl_cbwr": "",
    "openblas_coretype": "",
}


def test_platforms_are_grouped_by_the_files_that_recorded_them(tmp_path):
    ext = _extension()
    other = {**PLATFORM, "capability": "DEFAULT", "aten_cpu_capability": "default"}
    (tmp_path / "a.json").write_text(json.dumps({"platform": PLATFORM, "x": [1]}))
    (tmp_path / "b.json").write_text(json.dumps({"platform": other}))
    (tmp_path / "c.json").write_text(json.dumps({"platform": dict(PLATFORM)}))
    (tmp_path / "timings.json").write_text(json.dumps({"rows": []}))  # no platform
    (tmp_path / "list.json").write_text("[1, 2]")
    assert ext.recorded_platforms(tmp_path) == [
        (PLATFORM, ["a.json", "c.json"]),
        (other, ["b.json"]),
    ]
    table = ext.platform_table(tmp_path).splitlines()
    assert table[0] == "| | Platform 1 | Platform 2 |"
    assert "| CPU | Some CPU 9000 | Some CPU 9000 |" in table
    assert "| ATen CPU capability (torch's kernels) | AVX512 | DEFAULT |" in table
    assert "| ATEN_CPU_CAPABILITY | unset | default |" in table
    assert table[-1] == "| Data files | `a.json`, `c.json` | `b.json` |"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "No data file" in ext.platform_table(empty)


def test_the_page_names_the_machine_of_the_committed_data():
    ext = _extension()
    data = ROOT / ext.DATA
    recorded = [
        json.loads(p.read_text())["platform"]
        for p in sorted(data.glob("*.json"))
        if isinstance(json.loads(p.read_text()), dict) and "platform" in json.loads(p.read_text())
    ]
    assert recorded, "no committed data file records its platform"
    table = ext.platform_table(data)
    for platform in recorded:
        for key in ("cpu", "capability", "torch", "torch_blas", "numpy", "numpy_blas"):
            assert str(platform[key]) in table, key
    text = STATUS.read_text(encoding="utf-8")
    assert "{{ recorded_platform }}" in text
    # and says in what a reader's own run may differ
    for words in ("last bits", "ATEN_CPU_CAPABILITY=default", "stored data", "Timings"):
        assert words in text, words


def test_figures_get_their_docstrings_under_the_packages_name(monkeypatch):
    """Sphinx imports the extension as ``gradlab_book``, the book package's own name: the
    figure functions' docstrings are still found (they were not: find_spec answered the
    extension's own file, and every notebook figure kept its file name as alt text)."""
    ext = _extension()
    monkeypatch.setitem(sys.modules, "gradlab_book", ext)
    ext._FIGURE_DOCS = None
    docs = ext._figure_docs()
    assert docs["unit_ball_figure"].startswith(
        ast.get_docstring(_function("figures/norms.py", "unit_ball_figure")).split("\n\n")[0][:40]
    )


def _function(module: str, name: str) -> ast.FunctionDef:
    tree = ast.parse((ROOT / "gradlab-book" / "gradlab_book" / module).read_text())
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
