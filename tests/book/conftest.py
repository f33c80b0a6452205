"""The book suite needs the book's code and toolchain: say how to get them, then stop."""

import importlib.util

import pytest

_NEEDED = ("numpy", "matplotlib", "ipywidgets", "nbformat", "nbclient", "nbval", "yaml")
_missing = [name for name in _NEEDED if importlib.util.find_spec(name) is None]
if _missing:
    pytest.exit(
        f"The book suite needs {', '.join(_missing)}: run `bash scripts/build_book.sh`, "
        "which installs the pinned requirements.txt into .venv, then "
        "`bash scripts/test.sh book`.",
        returncode=4,
    )
