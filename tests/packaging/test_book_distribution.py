"""The book's distribution, ``gradlab-book``: it builds, installs from its wheel beside the
library's, and every chapter that reads stored data runs alone from the installed wheels.

Both wheels are built with ``pip wheel --no-deps`` from a copy of a clone. One fresh
virtual environment (for this module) gets the pinned torch, the two wheels, and the
kernel and notebook runner (ipykernel, nbclient), every version as ``requirements.txt``
pins it (``-c``). There the book's modules import, its stored data is read from the
installed package (``importlib.resources``), and each chapter that reads stored data,
copied alone into an empty folder (as Colab or a download has it), runs to its end in a
kernel of that environment. Several minutes: the set-up is about one, then each chapter
runs once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import textwrap
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version
from wheels import ROOT, build_wheel, clone_copy, fresh_venv, pinned, run, wheel_files

BOOK = ROOT / "gradlab-book"
DATA = BOOK / "gradlab_book" / "data"
#: The chapters that read stored data (test_the_list_of_chapters_that_read_data_is_complete).
DATA_CHAPTERS = (
    "book/training/skip_step",
    "book/training/clip_vs_ignore",
    "book/training/rnn_long_dependency",
    "book/training/costs",
    "book/adaptive/adaptive_thresholds",
    "book/adaptive/choosing_threshold",
    "book/adaptive/loss_spikes",
    "book/scale/per_sample_dp",
)
#: Runs a notebook in a kernel of the python that runs this, whatever kernelspecs exist.
RUNNER = textwrap.dedent(
    """
    import sys

    import ipykernel.kernelspec
    import nbformat
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError


    class ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return KernelSpec(
                resource_dir=ipykernel.kernelspec.RESOURCES,
                **ipykernel.kernelspec.get_kernel_dict(),
            )


    path, folder = sys.argv[1], sys.argv[2]
    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="this-python", kernel_spec_manager=ThisPython())
    client = NotebookClient(nb, km=km, timeout=900, resources={"metadata": {"path": folder}})
    try:
        client.execute()
    except CellExecutionError as error:
        sys.exit(f"{path}: {error}")
    finally:
        nbformat.write(nb, path)  # the executed notebook, for the test to read
    """
)


def _project() -> dict:
    return tomllib.loads((BOOK / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("wheels")
    clone = clone_copy(work / "clone")
    return {
        "library": build_wheel(clone, work / "library"),
        "book": build_wheel(clone / "gradlab-book", work / "book"),
    }


@pytest.fixture(scope="module")
def book_env(tmp_path_factory, wheels) -> Path:
    """A venv with torch, the two wheels, ipykernel and nbclient, as pinned; its python."""
    python = fresh_venv(tmp_path_factory.mktemp("book-env") / "venv")
    run(
        str(python),
        "-m",
        "pip",
        "install",
        "--quiet",
        "-c",
        str(ROOT / "requirements.txt"),
        str(wheels["library"]),
        str(wheels["book"]),
        pinned("ipykernel"),
        pinned("nbclient"),
    )
    return python


def _outside(python: Path) -> Path:
    """A folder outside the checkout to run in, so nothing of it is importable."""
    folder = python.parents[2] / "run"
    folder.mkdir(exist_ok=True)
    assert ROOT not in folder.parents
    return folder


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def test_the_book_wheel_holds_its_code_and_its_data_and_nothing_else(wheels):
    files = wheel_files(wheels["book"])
    version = _project()["version"]
    assert {n.split("/")[0] for n in files} == {
        "gradlab_book",
        f"gradlab_book-{version}.dist-info",
    }
    shipped = {n.removeprefix("gradlab_book/") for n in files if n.startswith("gradlab_book/")}
    sources = {
        path.relative_to(BOOK / "gradlab_book").as_posix()
        for path in (BOOK / "gradlab_book").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert shipped == sources
    assert {f"data/{p.name}" for p in DATA.iterdir()} <= shipped
    assert len(list(DATA.iterdir())) >= 7


def test_the_book_requires_this_release_of_the_library():
    requirements = [Requirement(r) for r in _project()["dependencies"]]
    (library,) = [r for r in requirements if r.name == "gradlab"]
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert library.specifier.contains(Version(root), prereleases=True), (library, root)
    assert "torch" not in {r.name for r in requirements}, "torch comes with the library"
    assert {"numpy", "matplotlib", "pillow", "ipywidgets", "opacus"} <= {
        r.name for r in requirements
    }


def test_the_installed_book_declares_its_version_and_the_library(book_env):
    script = textwrap.dedent(
        """
        from importlib.metadata import requires, version
        import gradlab_book
        print(version("gradlab-book"), gradlab_book.__version__)
        print(*requires("gradlab-book"), sep="\\n")
        """
    )
    first, *requirements = run(str(book_env), "-c", script, cwd=_outside(book_env)).splitlines()
    assert first.split() == [_project()["version"]] * 2
    assert any(Requirement(r).name == "gradlab" for r in requirements)


def test_every_book_module_imports_from_the_installed_wheel(book_env):
    script = textwrap.dedent(
        """
        import importlib, pkgutil
        import gradlab_book
        names = [m.name for m in pkgutil.walk_packages(gradlab_book.__path__, "gradlab_book.")]
        for name in names:
            importlib.import_module(name)
        print(gradlab_book.__file__)
        print(len(names))
        """
    )
    where, count = run(str(book_env), "-c", script, cwd=_outside(book_env), env=_env()).split()
    assert "site-packages" in where and ROOT.as_posix() not in where
    assert int(count) >= 30


def test_the_stored_data_is_read_from_the_installed_package(book_env):
    script = textwrap.dedent(
        """
        import json
        from gradlab_book import stored
        from gradlab_book.figures import adaptive, privacy, rnn, spikes, training
        loaded = {
            "traces": len(adaptive.load_traces()),
            "rnn": len(rnn.load_results()["runs"]),
            "grid": len(training.load_grid()),
            "spikes": len(spikes.load_runs()["runs"]),
            "table": len(spikes.load_table()),
            "spike costs": len(spikes.load_costs()),
            "dp costs": len(privacy.load_costs()),
        }
        print(json.dumps({"folder": str(stored.folder()), "loaded": loaded}))
        """
    )
    out = json.loads(run(str(book_env), "-c", script, cwd=_outside(book_env), env=_env()))
    assert "site-packages" in out["folder"] and ROOT.as_posix() not in out["folder"]
    assert all(n > 0 for n in out["loaded"].values()), out["loaded"]


def _code(notebook: Path) -> str:
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def test_the_list_of_chapters_that_read_data_is_complete():
    """Every chapter whose code names a loader or a stored path of the book is listed."""
    readers = set()
    for module in (BOOK / "gradlab_book" / "figures").glob("*.py"):
        text = module.read_text(encoding="utf-8")
        readers |= set(re.findall(r"^def (load_\w+)\(", text, flags=re.M))
        readers |= set(re.findall(r"^(\w+) = stored\.\w+\(", text, flags=re.M))
    assert {"load_traces", "load_grid", "DATA_PATH"} <= readers
    names = "|".join(sorted(readers))
    pattern = re.compile(rf"\b(?:{names})\b|\bstored\.")
    reading = {
        path.relative_to(ROOT).with_suffix("").as_posix()
        for path in sorted((ROOT / "book").rglob("*.ipynb"))
        if ".ipynb_checkpoints" not in path.parts and pattern.search(_code(path))
    }
    assert reading == set(DATA_CHAPTERS)


@pytest.mark.parametrize("chapter", DATA_CHAPTERS, ids=lambda c: c.rsplit("/", 1)[1])
def test_a_chapter_that_reads_stored_data_runs_alone(book_env, chapter, tmp_path):
    folder = tmp_path / "downloads"  # nothing beside the notebook, nothing of the clone
    folder.mkdir()
    notebook = folder / f"{Path(chapter).name}.ipynb"
    shutil.copyfile(ROOT / f"{chapter}.ipynb", notebook)
    runner = tmp_path / "run_notebook.py"
    runner.write_text(RUNNER)
    run(str(book_env), str(runner), str(notebook), str(folder), cwd=folder, env=_env())
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    setup = next(c for c in cells if c.get("id") == "setup")
    assert setup["outputs"] == [], "the setup cell must be silent where the wheels are installed"
    errors = [o for c in cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert errors == []
