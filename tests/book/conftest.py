"""The book suite needs the book's code and toolchain: say how to get them, then stop.

The repository's tools (``booktools``) are never installed: they are imported from the
checkout, whose root this puts on ``sys.path`` (``python -m pytest`` from the root does so
already; the ``pytest`` command does not).
"""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_NEEDED = ("numpy", "matplotlib", "ipywidgets", "nbformat", "nbclient", "nbval", "yaml")
_missing = [name for name in _NEEDED if importlib.util.find_spec(name) is None]
if importlib.util.find_spec("gradlab_book") is None:
    _missing.append("gradlab_book (pip install -e ./gradlab-book)")
if _missing:
    pytest.exit(
        f"The book suite needs {', '.join(_missing)}: run `bash scripts/build_book.sh`, "
        "which installs the pinned requirements.txt, gradlab and gradlab-book into .venv, "
        "then `bash scripts/test.sh book`.",
        returncode=4,
    )


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test, as the experiment scripts run: their prefixes
    reproduce bit for bit only so."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
