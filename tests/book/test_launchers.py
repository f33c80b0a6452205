"""The ways out of the web book: Binder's environment and the pages' download buttons.

* ``binder/requirements.txt`` (what Binder installs; repo2docker reads ``binder/`` before
  the repository root): it asks for torch's CPU wheel explicitly, from the PyTorch CPU
  index, agrees with ``requirements.txt`` on every version it pins, installs gradlab with
  its book extra, covers every package the notebooks import, and leaves out the build and
  test tools. ``binder/runtime.txt`` asks for the Python that gradlab requires. Offline:
  nothing is installed.
* The download button of a notebook page (sphinx-book-theme) serves
  ``_build/html/_sources/<page>.ipynb``: that file is the notebook itself, and it runs
  in a fresh kernel of this environment (gradlab installed) from a temporary folder
  outside the repository, so it cannot lean on files beside it in the clone.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

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


def test_binder_installs_gradlab_with_its_book_extra_and_no_tools():
    binder, other = _pins(BINDER / "requirements.txt")
    assert any(re.fullmatch(r"(-e\s+)?\.\[book\]", line) for line in other), other
    book = re.search(r"^book\s*=\s*\[(.*?)\]", _pyproject(), flags=re.M | re.S).group(1)
    for dep in re.findall(r'"([^"]+)"', book):
        assert canonicalize_name(Requirement(dep).name) in binder, f"{dep} is not pinned"
    assert not {canonicalize_name(t) for t in TOOLS} & set(binder)
    assert not any(name.startswith("sphinx") for name in binder)


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
                if module in sys.stdlib_module_names or module == "gradlab":
                    continue
                names = {canonicalize_name(d) for d in distributions.get(module, [module])}
                if not names & set(binder):
                    missing.setdefault(module, set()).add(path.relative_to(ROOT).as_posix())
    assert not missing, f"imported by the notebooks, not in binder/requirements.txt: {missing}"


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
