"""Rewrite the introduction's hero figure, ``book/_static/explorables/cliff.html``.

``book/intro.md`` includes that file; :func:`gradlab_book.direct.write_hero` writes it.
Run after changing the cliff figure: ``.venv/bin/python -m booktools.hero``. The book
suite fails while the file is stale (``tests/book/test_direct.py``).
"""

from __future__ import annotations

from pathlib import Path

from gradlab_book.direct import write_hero

ROOT = Path(__file__).resolve().parents[1]  # booktools runs from the clone, never installed
HERO_PATH = ROOT / "book" / "_static" / "explorables" / "cliff.html"


if __name__ == "__main__":
    print(f"wrote {write_hero(HERO_PATH)}")
