"""The ways out of the web book: Binder's environment, Colab's setup cell, the pages' downloads.

* ``binder/requirements.txt`` (what Binder installs; repo2docker reads ``binder/`` before
  the repository root): it asks for torch's CPU wheel explicitly, from the PyTorch CPU
  index, agrees with ``requirements.txt`` on every version it pins, installs the library
  and the book's distribution from the clone and jupyterlab-myst (what renders the
  exercises and solutions in JupyterLab), covers every package the notebooks import, and
  leaves out the build and test tools. ``binder/runtime.txt`` asks for the Python that
  gradlab requires. Offline: nothing is installed.
* The setup cell every notebook starts with (``booktools.headers.SETUP_SOURCE``), run as
  it runs on Colab, with pip replaced by a recorder: it installs both packages from the
  repository against the kernel's own torch, pinned exactly, and says in one sentence
  what to do when pip cannot; it does nothing where the packages are importable.
* The download button of a notebook page (sphinx-book-theme) serves
  ``_build/html/_sources/<page>.ipynb``: that file is the notebook itself, and it runs
  in a fresh kernel of this environment (gradlab installed) from a temporary folder
  outside the repository, so it cannot lean on files beside it in the clone.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from booktools import headers

ROOT = Path(__file__).resolve().parents[2]
BINDER = ROOT / "binder"
SITE = ROOT / "_build" / "html"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: Run from their downloaded copy: an algorithm chapter (explorable, exercises, checks)
#: and a foundations one; a few seconds each when executed.
EXECUTED = ("book/algorithms/clip_norm", "book/foundations/norms")
#: Never needed to run a chapter; Binder must not spend its build on them.
TOOLS = (
    "pytest",
    "pytest-xdist",
    "hypothesis",
    "nbval",
    "ruff",
    "playwright",
    "coverage",
    "jupyter-book",
    "sphinx",
    "myst-nb",
    "sphinx-book-theme",
    "pypdf",
)


def _pins(path: Path) -> tuple[dict[str, str], list[str]]:
    """({canonical name: version} of the ``name==version`` lines, the other lines)."""
    pins, other = {}, []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-") or "==" not in line:
            other.append(line)
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"{path.name}: {line!r} is not an exact pin"
        pins[canonicalize_name(req.name)] = spec.version
    return pins, other


def _pyproject() -> str:
    return (ROOT / "pyproject.toml").read_text(encoding="utf-8")


def _book_dependencies() -> list[Requirement]:
    text = (ROOT / "gradlab-book" / "pyproject.toml").read_text(encoding="utf-8")
    return [Requirement(d) for d in tomllib.loads(text)["project"]["dependencies"]]


def _toc_docnames() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    names, stack = [toc["root"]], [toc]
    while stack:
        entry = stack.pop()
        for key in ("parts", "chapters", "sections"):
            for child in entry.get(key, []):
                if "file" in child:
                    names.append(str(child["file"]).removesuffix(".ipynb").removesuffix(".md"))
                stack.append(child)
    return names


def _notebooks() -> list[Path]:
    return [ROOT / f"{d}.ipynb" for d in _toc_docnames() if (ROOT / f"{d}.ipynb").exists()]


def _imported_modules(source: str) -> set[str]:
    """Top-level modules a code cell imports (IPython magics turned into Python first)."""
    from IPython.core.inputtransformer2 import TransformerManager

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree = ast.parse(TransformerManager().transform_cell(source))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


# ------------------------------------------------------------------------------ Binder


def test_binder_installs_the_cpu_build_of_torch():
    pins, other = _pins(BINDER / "requirements.txt")
    assert f"--extra-index-url {CPU_INDEX}" in other or f"--index-url {CPU_INDEX}" in other
    torch = Version(pins["torch"])
    assert torch.local == "cpu", f"binder pins torch=={torch}, not the +cpu wheel"
    wanted = Version(_pins(ROOT / "requirements.txt")[0]["torch"])
    assert torch.public == wanted.public, f"binder torch {torch}, requirements.txt {wanted}"


def test_binder_agrees_with_requirements_txt():
    binder, _ = _pins(BINDER / "requirements.txt")
    pinned, _ = _pins(ROOT / "requirements.txt")
    for name, version in binder.items():
        assert name in pinned, f"binder pins {name}, which requirements.txt does not"
        assert Version(version).public == Version(pinned[name]).public, (
            f"{name}: binder {version}, requirements.txt {pinned[name]}"
        )


def test_binder_installs_the_library_and_the_book_from_the_clone_and_no_tools():
    binder, other = _pins(BINDER / "requirements.txt")
    assert any(re.fullmatch(r"(-e\s+)?\.", line) for line in other), other
    assert any(re.fullmatch(r"(-e\s+)?\./gradlab-book/?", line) for line in other), other
    for dep in _book_dependencies():
        if dep.name != "gradlab":  # the line above installs it, from the same clone
            assert canonicalize_name(dep.name) in binder, f"{dep} is not pinned"
    assert not {canonicalize_name(t) for t in TOOLS} & set(binder)
    assert not any(name.startswith("sphinx") for name in binder)


def test_binder_installs_jupyterlab_myst_as_pinned():
    """Without it JupyterLab shows every {exercise} and {solution} as raw MyST."""
    binder, _ = _pins(BINDER / "requirements.txt")
    pinned, _ = _pins(ROOT / "requirements.txt")
    assert binder.get("jupyterlab-myst") == pinned["jupyterlab-myst"]


def test_binder_python_is_one_gradlab_supports():
    runtime = (BINDER / "runtime.txt").read_text(encoding="utf-8").strip()
    match = re.fullmatch(r"python-(3\.\d+)", runtime)
    assert match, runtime
    requires = re.search(r'^requires-python\s*=\s*"([^"]+)"', _pyproject(), flags=re.M)
    assert Version(match.group(1)) in SpecifierSet(requires.group(1))


def test_binder_covers_what_the_notebooks_import():
    binder, _ = _pins(BINDER / "requirements.txt")
    distributions = importlib.metadata.packages_distributions()
    notebooks = _notebooks()
    assert notebooks
    missing = {}
    for path in notebooks:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        for cell in cells:
            if cell["cell_type"] != "code":
                continue
            for module in _imported_modules("".join(cell["source"])):
                if module in sys.stdlib_module_names or module in ("gradlab", "gradlab_book"):
                    continue  # installed from the clone (the test above)
                names = {canonicalize_name(d) for d in distributions.get(module, [module])}
                if not names & set(binder):
                    missing.setdefault(module, set()).add(path.relative_to(ROOT).as_posix())
    assert not missing, f"imported by the notebooks, not in binder/requirements.txt: {missing}"


# ------------------------------------------------------------------ Colab's setup cell


class _Pip:
    """Stands in for ``subprocess.run`` in the setup cell: records pip, answers ``code``."""

    def __init__(self, code: int) -> None:
        self.code, self.calls, self.constraints = code, [], []

    def __call__(self, command, **kwargs):
        self.calls.append(list(command))
        if "-c" in command:
            self.constraints.append(Path(command[command.index("-c") + 1]).read_text())
        return subprocess.CompletedProcess(command, self.code, b"", b"")


def _run_setup_cell(monkeypatch, folder: Path, code: int, missing=("gradlab_book",)) -> _Pip:
    """Run the setup cell in ``folder`` as a kernel without ``missing`` would."""
    find_spec = importlib.util.find_spec
    pip = _Pip(code)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else find_spec(name)
    )
    monkeypatch.setattr(subprocess, "run", pip)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(folder)
    exec(compile(headers.SETUP_SOURCE, "setup-cell", "exec"), {})
    return pip


def test_the_setup_cell_does_nothing_where_the_packages_are_importable(
    monkeypatch, tmp_path, capsys
):
    pip = _run_setup_cell(monkeypatch, tmp_path, 0, missing=())
    assert pip.calls == [] and capsys.readouterr().out == ""


def test_the_setup_cell_installs_both_packages_against_the_kernels_torch(
    monkeypatch, tmp_path, capsys
):
    import torch

    pip = _run_setup_cell(monkeypatch, tmp_path, 0)
    assert capsys.readouterr().out == ""
    (command,) = pip.calls
    assert command[:4] == [sys.executable, "-m", "pip", "install"]
    assert pip.constraints == [f"torch=={torch.__version__}\n"]
    wanted = [a for a in command if "@" in a]
    assert [Requirement(a).name for a in wanted] == ["gradlab", "gradlab-book"]
    url = "git+https://github.com/gradlab/gradlab"
    assert [Requirement(a).url for a in wanted] == [url, f"{url}#subdirectory=gradlab-book"]
    assert (ROOT / "gradlab-book" / "pyproject.toml").is_file()  # what the subdirectory names
    assert not any(a.split("=")[0].split("<")[0].split(">")[0] == "torch" for a in command)


def test_the_setup_cell_says_what_to_do_when_pip_cannot(monkeypatch, tmp_path, capsys):
    import torch

    _run_setup_cell(monkeypatch, tmp_path, 1)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.count(": ") == 1, out
    assert str(torch.__version__) in out and "Binder" in out
    (library_torch,) = [
        d
        for d in tomllib.loads(_pyproject())["project"]["dependencies"]
        if Requirement(d).name == "torch"
    ]
    assert library_torch in out


def test_the_setup_cell_uses_a_clone_it_is_opened_in(monkeypatch, capsys):
    pip = _run_setup_cell(monkeypatch, ROOT / "book" / "training", 0)
    assert pip.calls == [] and capsys.readouterr().out == ""
    assert sys.path[:2] == [str(ROOT), str(ROOT / "gradlab-book")]


# ---------------------------------------------------------------------- download buttons

needs_site = pytest.mark.skipif(
    not (SITE / "index.html").exists(),
    reason="the book is not built: run 'bash scripts/build_book.sh'",
)


def _download_href(docname: str) -> str:
    page = (SITE / f"{docname}.html").read_text(encoding="utf-8")
    match = re.search(r'<a href="([^"]+)"[^>]*btn-download-source-button', page)
    assert match, f"{docname}: no download button"
    return match.group(1)


@needs_site
@pytest.mark.parametrize("docname", EXECUTED)
def test_the_download_button_serves_the_notebook(docname):
    href = _download_href(docname)
    served = (SITE / docname).parent.joinpath(href).resolve()
    assert served == (SITE / "_sources" / f"{docname}.ipynb").resolve(), href
    assert json.loads(served.read_text("utf-8")) == json.loads(
        (ROOT / f"{docname}.ipynb").read_text("utf-8")
    ), f"{served} is not the notebook as committed (rebuild the book)"


def _current_env_kernel():
    """A kernel manager for this very Python (gradlab installed), whatever kernelspecs exist."""
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import KernelManager

    class CurrentEnv(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return KernelSpec(
                resource_dir=ipykernel.kernelspec.RESOURCES,
                **ipykernel.kernelspec.get_kernel_dict(),
            )

    return KernelManager(kernel_name="current-env", kernel_spec_manager=CurrentEnv())


@needs_site
@pytest.mark.parametrize("docname", EXECUTED)
def test_a_downloaded_notebook_runs_in_a_fresh_kernel(docname, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    served = (SITE / docname).parent.joinpath(_download_href(docname)).resolve()
    download = tmp_path / served.name  # a reader's Downloads folder: nothing beside it
    download.write_bytes(served.read_bytes())
    assert ROOT not in tmp_path.parents
    nb = nbformat.read(download, as_version=4)
    client = NotebookClient(
        nb,
        km=_current_env_kernel(),
        timeout=120,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert sorted(p.name for p in tmp_path.iterdir()) == [download.name], (
        "the notebook wrote files beside itself"
    )
