"""The library installs and imports with torch alone: the boundary between the two products.

A fresh virtual environment gets ``torch`` (the pinned CPU wheel) and then
``pip install .`` of a copy of the library's files. There every public name of
:mod:`gradlab` imports, the book's dependencies are absent from ``pip list``, and
``import gradlab.book`` says which extra to install. The wheel's metadata asks for torch
and nothing else. This takes about a minute (torch is installed once, for this module).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"
BOOK_ONLY = {"numpy", "matplotlib", "pillow", "ipywidgets", "jupyter-book", "nbval"}


def _run(*command: str, cwd: Path | None = None) -> str:
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _library_sources(dest: Path) -> Path:
    """The files `pip install .` needs, copied so the checkout gets no build litter."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(
        ROOT / "gradlab", dest / "gradlab", ignore=shutil.ignore_patterns("__pycache__")
    )
    return dest


@pytest.fixture(scope="module")
def library_env(tmp_path_factory) -> Path:
    """A venv with torch and `pip install .` of the library, nothing else; its python."""
    work = tmp_path_factory.mktemp("library-only")
    _run(sys.executable, "-m", "venv", str(work / "venv"))
    python = work / "venv" / "bin" / "python"
    _run(str(python), "-m", "pip", "install", "--quiet", TORCH)
    _run(str(python), "-m", "pip", "install", "--quiet", str(_library_sources(work / "src")))
    return python


def test_pip_list_has_torch_and_gradlab_but_nothing_of_the_book(library_env):
    listed = json.loads(_run(str(library_env), "-m", "pip", "list", "--format=json"))
    names = {entry["name"].lower() for entry in listed}
    assert {"torch", "gradlab"} <= names
    assert names & BOOK_ONLY == set()


def test_every_public_name_imports(library_env):
    script = textwrap.dedent(
        """
        import sys
        import gradlab
        missing = [name for name in gradlab.__all__ if not hasattr(gradlab, name)]
        assert not missing, missing
        loaded = {"numpy", "matplotlib", "PIL", "ipywidgets"} & set(sys.modules)
        assert not loaded, f"import gradlab loaded {loaded}"
        print(len(gradlab.__all__))
        """
    )
    out = _run(str(library_env), "-c", script, cwd=library_env.parent)
    assert int(out) >= 7


def test_the_book_package_names_its_extra(library_env):
    script = "import gradlab.book"
    result = subprocess.run(
        [str(library_env), "-c", script], capture_output=True, text=True, cwd=library_env.parent
    )
    assert result.returncode != 0
    assert 'pip install "gradlab[book]"' in result.stderr


def test_the_wheel_requires_torch_alone(library_env):
    script = textwrap.dedent(
        """
        from importlib.metadata import requires
        print("\\n".join(requires("gradlab")))
        """
    )
    requirements = _run(str(library_env), "-c", script, cwd=library_env.parent).splitlines()
    core = [r for r in requirements if "extra ==" not in r]
    assert len(core) == 1 and core[0].startswith("torch"), core


def _pinned(name: str) -> str:
    """``name==version`` as requirements.txt pins it."""
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.lower().startswith(f"{name}=="):
            return line.strip()
    raise AssertionError(f"{name} is not pinned in requirements.txt")


def test_the_library_suite_needs_only_the_library_and_the_test_tools(library_env):
    _run(
        str(library_env),
        "-m",
        "pip",
        "install",
        "--quiet",
        _pinned("pytest"),
        _pinned("hypothesis"),
    )
    # -P: the installed gradlab, not the checkout's sources, is the one under test.
    result = subprocess.run(
        [str(library_env), "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/lib"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
