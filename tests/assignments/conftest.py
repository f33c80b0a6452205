"""The assignments suite needs otter-grader and the book's code: say how to get them, then stop.

Until ``requirements.txt`` pins otter-grader, an environment without it skips the suite
(each module says why); once pinned, a missing or different otter-grader stops it. Every
chapter's assignment is built once per session (``booktools.assignments.build``,
without Otter Assign's own run of the solutions: the suite grades them itself), into a
temporary folder. The repository root goes on ``sys.path`` for ``booktools``, and
``tests/book`` for the wrong answers of its exercise tests.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "tests" / "book"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def _pinned_otter() -> str | None:
    for line in (ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines():
        if line.lower().startswith("otter-grader=="):
            return line.split("==", 1)[1].strip()
    return None


_pin = _pinned_otter()
_needed = ["gradlab_book", "nbformat", "yaml"] + (["otter", "pandas", "dill"] if _pin else [])
_missing = [name for name in _needed if importlib.util.find_spec(name) is None]
if _missing:
    pytest.exit(
        f"The assignments suite needs {', '.join(_missing)}: run `bash scripts/build_book.sh`, "
        "which installs the pinned requirements.txt (otter-grader included), gradlab and "
        "gradlab-book into .venv, then `bash scripts/test.sh assignments`.",
        returncode=4,
    )
if _pin is not None and _pin != importlib.metadata.version("otter-grader"):
    pytest.exit(
        f"requirements.txt pins otter-grader=={_pin}, this environment has "
        f"{importlib.metadata.version('otter-grader')}: run `bash scripts/build_book.sh`.",
        returncode=4,
    )


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """Every chapter's assignment: ``{"out": folder, "questions": {chapter: [Question]}}``."""
    from booktools import assignments

    out = tmp_path_factory.mktemp("assignments")
    questions = assignments.build(out, run_tests=False)
    return {"out": out, "questions": questions}
