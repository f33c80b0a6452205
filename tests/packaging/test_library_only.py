"""The library's wheel holds the library only, and installs and imports with torch alone.

The boundary between the two products. ``pip wheel --no-deps`` builds the library's wheel
from a copy of a clone (``wheels.clone_copy``), which holds the book's distribution
(``gradlab-book/``) and the repository's tools (``booktools/``) beside the library:
neither may land in the wheel. A fresh virtual environment gets ``torch`` (the pinned CPU
wheel) and that wheel. There every public name of :mod:`gradlab` imports, the book's
dependencies are absent from ``pip list``, no book module is importable, and the wheel's
metadata asks for torch and nothing else. This takes about a minute (torch is installed
once, for this module).
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
import tomllib
from wheels import ROOT, build_wheel, clone_copy, fresh_venv, pinned, run, wheel_files

BOOK_ONLY = {"numpy", "matplotlib", "pillow", "ipywidgets", "opacus", "jupyter-book", "nbval"}


@pytest.fixture(scope="module")
def library_wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("library-wheel")
    return build_wheel(clone_copy(work / "clone"), work / "dist")


@pytest.fixture(scope="module")
def library_env(tmp_path_factory, library_wheel) -> Path:
    """A venv with torch and the library's wheel, nothing else; its python."""
    python = fresh_venv(tmp_path_factory.mktemp("library-only") / "venv")
    run(str(python), "-m", "pip", "install", "--quiet", str(library_wheel))
    return python


def test_the_library_wheel_holds_the_library_only(library_wheel):
    files = wheel_files(library_wheel)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert {name.split("/")[0] for name in files} == {"gradlab", f"gradlab-{version}.dist-info"}
    book = [n for n in files if n.startswith(("gradlab/book/", "gradlab_book/", "booktools/"))]
    assert book == []
    shipped = {name.removeprefix("gradlab/") for name in files if name.startswith("gradlab/")}
    sources = {
        path.relative_to(ROOT / "gradlab").as_posix()
        for path in (ROOT / "gradlab").rglob("*")
        if path.suffix in (".py", ".typed") and "__pycache__" not in path.parts
    }
    assert shipped == sources


def test_pip_list_has_torch_and_gradlab_but_nothing_of_the_book(library_env):
    listed = json.loads(run(str(library_env), "-m", "pip", "list", "--format=json"))
    names = {entry["name"].lower() for entry in listed}
    assert {"torch", "gradlab"} <= names
    assert names & (BOOK_ONLY | {"gradlab-book"}) == set()


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
    out = run(str(library_env), "-c", script, cwd=library_env.parent)
    assert int(out) >= 7


def test_no_book_module_is_installed_with_the_library(library_env):
    script = textwrap.dedent(
        """
        import importlib.util
        for name in ("gradlab.book", "gradlab_book", "booktools"):
            print(name, importlib.util.find_spec(name) is not None)
        """
    )
    out = run(str(library_env), "-c", script, cwd=library_env.parent).split("\n")
    assert out[:3] == ["gradlab.book False", "gradlab_book False", "booktools False"]


def test_the_wheel_requires_torch_alone(library_env):
    script = textwrap.dedent(
        """
        from importlib.metadata import requires
        print("\\n".join(requires("gradlab")))
        """
    )
    requirements = run(str(library_env), "-c", script, cwd=library_env.parent).splitlines()
    core = [r for r in requirements if "extra ==" not in r]
    assert len(core) == 1 and core[0].startswith("torch"), core
    extras = {r.split("extra ==")[1].strip(" \"'") for r in requirements if "extra ==" in r}
    assert extras == {"test"}, "the book is a distribution of its own, not an extra"


#: Modules of tests/lib run against the installed wheel: the two-phase core (norms, keep
#: rules, the skip, the guard) and flat gradients. The whole suite runs in the library
#: suite; here every module is collected (imported), which is what needs the wheel whole.
CORE_MODULES = ("test_clip_keep.py", "test_step.py", "test_guard_api.py", "test_flat.py")


def test_the_library_suite_needs_only_the_library_and_the_test_tools(library_env):
    run(
        str(library_env),
        "-m",
        "pip",
        "install",
        "--quiet",
        pinned("pytest"),
        pinned("hypothesis"),
    )
    # -P: the installed gradlab, not the checkout's sources, is the one under test.
    pytest = [str(library_env), "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    collected = subprocess.run(
        [*pytest, "--collect-only", "tests/lib"], capture_output=True, text=True, cwd=ROOT
    )
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-2000:]
    result = subprocess.run(
        [*pytest, *(f"tests/lib/{m}" for m in CORE_MODULES)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
