"""Export the chapters' exercises as otter-grader assignments.

Usage (from the repository root, in an environment with otter-grader, see
``requirements.txt``)::

    .venv/bin/python -m booktools.assignments OUT                       # every chapter
    .venv/bin/python -m booktools.assignments OUT --chapter clip_norm   # some chapters
    .venv/bin/python -m booktools.assignments OUT --no-run-tests        # skip the check
    .venv/bin/python -m booktools.assignments grade ZIP SUBMISSION... --output RESULTS

For each chapter (the notebooks of the book's numbered parts in ``_toc.yml``; a chapter is
named by its notebook's stem, such as ``clip_norm``) it writes ``OUT/CHAPTER/`` with

* ``master/CHAPTER.ipynb``: the chapter in Otter Assign's notebook format, made from the
  instructor notebook by this module (never edit it: rebuild). Every ``{exercise}`` becomes
  a question named by its label, worth its difficulty in points (:data:`POINTS_PER_STAR`:
  ★ 1 point, ★★ 2, ★★★ 3). A coding exercise (a gated solution followed by a cell that
  calls one of the ``check_*`` functions of ``gradlab_book.exercises*``) is autograded:
  its solution code is the solution block (the region between the book's
  ``### BEGIN SOLUTION`` markers, or the whole cell, becomes ``raise NotImplementedError``
  for the student, as in the student edition) and its one test, hidden, runs the
  chapter's own check cell on the student's names and passes when the check returns
  True: the same ``check_*`` call grades the self-check and the assignment, and the
  check's printed verdict is the test's message. Any other exercise is a manually graded
  question whose solution block is its ``{solution}`` text;
* ``master/requirements.txt`` and ``master/wheels/``: what the autograder installs next
  to otter-grader (torch's CPU build, the wheels of ``gradlab`` and ``gradlab-book`` built
  from this checkout, and the book's runtime dependencies at the versions pinned in
  ``requirements.txt``);
* ``autograder/``: Otter Assign's output for the instructor: ``CHAPTER-autograder.zip``
  (the tests, ``otter_config.json``, ``environment.yml``, ``setup.sh`` and the wheels:
  upload it to Gradescope or give it to ``otter run``/``otter grade``) and
  ``CHAPTER.ipynb``, the notebook with the solutions;
* ``student/CHAPTER.ipynb``: the notebook to hand out: stubs, no solution, no test (the
  tests live in the autograder only), no output.

``OUT/CHAPTER/questions.csv`` lists the chapter's questions: chapter, name, kind
(``autograded`` or ``manual``), stars, points and the check that grades it;
``OUT/questions.csv`` those of every chapter built into ``OUT``.

By default Otter Assign then grades the notebook with the solutions against its own
autograder and fails unless it scores full marks (``--no-run-tests`` skips that: it runs
the whole chapter once).

``grade`` grades submitted notebooks locally without Docker, one ``otter run`` each (the
notebook is executed in a fresh kernel of the current environment, which must hold
gradlab and gradlab-book), and writes ``RESULTS/SUBMISSION/results.json`` (Gradescope's
format) for each and ``RESULTS/final_grades.csv`` in the columns of ``otter grade``.
See book/instructors.md for the workflow.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import csv
import importlib
import importlib.metadata
import io
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import nbformat
import yaml
from nbformat.v4 import new_code_cell, new_markdown_cell, new_raw_cell

from booktools import student_edition as se

ROOT = se.ROOT

#: Points per difficulty star: ★ 1 point, ★★ 2, ★★★ 3, for written and coding exercises.
POINTS_PER_STAR = 1

#: The Python of the grading image: the one CI runs (requirements.txt is pinned for it).
PYTHON_VERSION = "3.11"

#: Where Gradescope (and ``otter grade``'s containers) unpack the autograder's ``files``.
AUTOGRADER_FILES = "/autograder/source/files"

#: torch's CPU wheels: without this index pip takes PyPI's build of torch with CUDA.
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"

#: What the wheels are built from (the library's project and the book's).
_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "gradlab", "gradlab-book")

_STARS = re.compile(r"★+")
_LABEL = re.compile(r"^:label:\s*(\S+)\s*$", re.M)


class AssignmentError(Exception):
    """A chapter whose exercises cannot be exported as they stand (the message says where)."""


# ------------------------------------------------------------------ reading a chapter


@dataclass
class _Text:
    source: str
    cell: object  # the markdown cell it comes from (its metadata travels with it)


@dataclass
class _Block:
    kind: str  # "exercise", "solution", "solution-start" or "solution-end"
    label: str | None
    source: str


@dataclass
class _Gated:
    label: str
    items: list  # _Text and code cells, in order


@dataclass
class Question:
    """One exercise of a chapter, as an otter-grader question.

    ``check_cell`` is the chapter's self-check cell for an autograded question, None for a
    manually graded one; ``solution`` is a ``_Gated`` region or the ``{solution}`` block.
    """

    name: str
    stars: int
    text: str
    solution: object = None
    check_cell: object = None
    check: str | None = None  # the check_* function the check cell calls

    @property
    def autograded(self) -> bool:
        return self.check_cell is not None

    @property
    def points(self) -> int:
        return self.stars * POINTS_PER_STAR


def _label_of(kind: str, info: str, body: str, where: str) -> str | None:
    if kind == "solution-end":
        return None
    # an exercise's :label: option; a solution's label follows its directive's name
    match = _LABEL.search(body) if kind == "exercise" else re.match(r"\{[\w:-]+\}\s*(\S+)", info)
    if not match:
        raise AssignmentError(f"{where}: a {{{kind}}} without a label")
    return match.group(1)


def _segments(text: str, where: str) -> list:
    """Split a markdown cell into text and the exercise and solution blocks at its top level."""
    lines = text.split("\n")
    out: list = []
    buffer: list[str] = []

    def flush() -> None:
        chunk = "\n".join(buffer).strip("\n")
        if chunk.strip():
            out.append(chunk)
        buffer.clear()

    i = 0
    while i < len(lines):
        match = se._FENCE.match(lines[i])
        if not match:
            buffer.append(lines[i])
            i += 1
            continue
        j = se._closing(lines, i, match.group("fence"))
        name = se._directive_name(match.group("info"))
        block = "\n".join(lines[i : j + 1])
        if name in ("exercise", "solution", "solution-start", "solution-end"):
            flush()
            body = "\n".join(lines[i + 1 : j])
            label = _label_of(name, match.group("info"), body, where)
            out.append(_Block(name, label, block))
        elif name is not None and re.search(r"\{(exercise|solution[\w-]*)\}", block):
            raise AssignmentError(f"{where}: an exercise or solution inside a {{{name}}}")
        else:
            buffer.extend(lines[i : j + 1])
        i = j + 1
    flush()
    return out


def _items(nb, where: str) -> list:
    """The notebook as a flat list: _Text, _Block, _Gated and the other cells, in order."""
    flat: list = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            for part in _segments(cell.source, f"{where} cell {index}"):
                flat.append(_Text(part, cell) if isinstance(part, str) else part)
        else:
            flat.append(cell)
    items: list = []
    gated: _Gated | None = None
    for item in flat:
        kind = item.kind if isinstance(item, _Block) else None
        if gated is not None:
            if kind == "solution-end":
                items.append(gated)
                gated = None
            elif kind is not None:
                raise AssignmentError(f"{where}: a {{{kind}}} inside the solution of {gated.label}")
            else:
                gated.items.append(item)
        elif kind == "solution-start":
            gated = _Gated(item.label, [])
        elif kind == "solution-end":
            raise AssignmentError(f"{where}: {{solution-end}} without {{solution-start}}")
        else:
            items.append(item)
    if gated is not None:
        raise AssignmentError(f"{where}: the solution of {gated.label} has no {{solution-end}}")
    return items


def _check_call(cell, where: str) -> str | None:
    """The ``check_*`` function a check cell ends by calling; None for any other cell."""
    if cell.cell_type != "code" or not se._CHECK_CALL.search(cell.source):
        return None
    tree = ast.parse(cell.source)
    last = tree.body[-1] if tree.body else None
    if (
        isinstance(last, ast.Expr)
        and isinstance(last.value, ast.Call)
        and isinstance(last.value.func, ast.Name)
        and last.value.func.id in se.CHECKS
    ):
        return last.value.func.id
    raise AssignmentError(
        f"{where}: a check cell must end with the check_* call whose verdict it shows"
    )


def _stars(block: str, label: str, where: str) -> int:
    body = "\n".join(line for line in block.split("\n")[1:-1] if not line.startswith(":"))
    match = _STARS.search(body)
    if not match or len(match.group()) > 3:
        raise AssignmentError(f"{where}: exercise {label} has no difficulty (★ to ★★★)")
    return len(match.group())


def read_chapter(nb, where: str) -> tuple[list, dict[str, Question]]:
    """The chapter's items and its questions by label (in the order of the exercises).

    Raises:
        AssignmentError: an exercise without a difficulty or a solution, a solution without
            its exercise, or code between an exercise and its solution (a question's cells
            must be contiguous, and moving code would change what the notebook computes).
    """
    items = _items(nb, where)
    questions: dict[str, Question] = {}
    solutions: dict[str, object] = {}
    checks: dict[str, object] = {}
    pending: str | None = None  # a gated solution whose check cell is the next code cell
    for item in items:
        if isinstance(item, _Block) and item.kind == "exercise":
            if item.label in questions:
                raise AssignmentError(f"{where}: two exercises labelled {item.label}")
            stars = _stars(item.source, item.label, where)
            questions[item.label] = Question(item.label, stars, item.source)
        elif isinstance(item, (_Block, _Gated)):
            if item.label in solutions:
                raise AssignmentError(f"{where}: two solutions of {item.label}")
            solutions[item.label] = item
            if isinstance(item, _Gated):
                pending = item.label
        elif getattr(item, "cell_type", None) == "code" and pending is not None:
            check = _check_call(item, f"{where}, the cell after the solution of {pending}")
            if check is not None:
                checks[pending] = (item, check)
            pending = None
    for label, solution in solutions.items():
        if label not in questions:
            raise AssignmentError(f"{where}: a solution of {label}, which is no exercise here")
        questions[label].solution = solution
    for label, question in questions.items():
        if question.solution is None:
            raise AssignmentError(f"{where}: exercise {label} has no solution")
        if label in checks:
            question.check_cell, question.check = checks[label]
    # a question is emitted where its exercise stands: nothing that runs may lie between
    start: dict[str, int] = {}
    for index, item in enumerate(items):
        if isinstance(item, _Block) and item.kind == "exercise":
            start[item.label] = index
        elif isinstance(item, (_Block, _Gated)) and item.label in start:
            between = items[start[item.label] + 1 : index]
            if any(getattr(c, "cell_type", None) == "code" for c in between):
                raise AssignmentError(
                    f"{where}: code cells between exercise {item.label} and its solution"
                )
    return items, questions


# ---------------------------------------------------------------- the master notebook


def _raw(text: str):
    return new_raw_cell(text)


def _yaml_cell(comment: str, config: dict):
    return _raw(f"# {comment}\n" + yaml.safe_dump(config, sort_keys=False, allow_unicode=True))


def _prompted(body: list[str], indent: str) -> list[str]:
    """``body`` as an Otter solution whose prompt, for the student, is the book's stub."""
    return [
        f"{indent}# BEGIN SOLUTION NO PROMPT",
        *body,
        f"{indent}# END SOLUTION",
        f'{indent}""" # BEGIN PROMPT',
        f"{indent}{se.STUB}",
        f'{indent}"""; # END PROMPT',
    ]


def otter_solution_code(source: str, where: str = "") -> str:
    """The book's solution code with Otter's markers; the student gets the book's stub.

    Each region between the book's ``### BEGIN SOLUTION`` and ``### END SOLUTION`` lines
    becomes an Otter ``# BEGIN SOLUTION NO PROMPT`` region followed by an Otter prompt that
    holds the stub at the markers' indentation; a cell without markers is one region. Otter
    Assign's student notebook is then the student edition's code, line for line.

    Args:
        source (str): a solution code cell of the book.
        where (str): where the cell is, for error messages. Default: ``""``

    Returns:
        str: the cell for the Otter Assign notebook.

    Raises:
        booktools.student_edition.StudentEditionError: unbalanced or nested markers.
    """
    _, marked = se.stub_solution_regions(source, where)  # validates the markers
    lines = source.split("\n")
    if not marked:
        return "\n".join(_prompted(lines, ""))
    out: list[str] = []
    region: list[str] | None = None
    indent = ""
    for line in lines:
        text = line.strip()
        if text == se.BEGIN:
            region, indent = [], line[: len(line) - len(line.lstrip())]
        elif text == se.END:
            out.extend(_prompted(region, indent))
            region = None
        elif region is not None:
            region.append(line)
        else:
            out.append(line)
    return "\n".join(out)


def test_source(question: Question) -> str:
    """The Otter test cell of an autograded question: the chapter's check cell, run on the
    student's names.

    The check cell's statements before its last run first (imports, and any data the
    check is given), in a copy of the student's global names; then the ``check_*``
    function is bound from ``gradlab_book`` itself (a name the student defined cannot stand
    in for it) and its call is evaluated. The test passes when the check returns True;
    otherwise its message is the verdict the check printed (a raise, such as the
    ``NameError`` of a function the student never defined, fails the test as well).

    Args:
        question (Question): an autograded question.

    Returns:
        str: the source of the test cell (Otter's exception-based format).
    """
    tree = ast.parse(question.check_cell.source)
    lines = question.check_cell.source.split("\n")
    last = tree.body[-1]
    setup = "\n".join(lines[: last.lineno - 1]).strip()
    call = "\n".join(lines[last.lineno - 1 : last.end_lineno]).strip()
    module = _check_module(question.check)
    name = "test_" + re.sub(r"\W", "_", question.name)
    config = {"hidden": True, "points": question.points}
    return (
        '""" # BEGIN TEST CONFIG\n'
        + yaml.safe_dump(config, sort_keys=False)
        + '""" # END TEST CONFIG\n'
        + textwrap.dedent(
            f"""\
            def {name}(env):
                # Written by booktools.assignments from the chapter's check cell.
                import contextlib
                import importlib
                import io

                namespace = dict(env)
                verdict = io.StringIO()
                with contextlib.redirect_stdout(verdict):
                    exec({setup!r}, namespace)
                    module = importlib.import_module({module!r})
                    namespace[{question.check!r}] = getattr(module, {question.check!r})
                    passed = eval({call!r}, namespace)
                assert passed is True, verdict.getvalue()
            """
        )
    )


def _check_module(check: str) -> str:
    import gradlab_book

    for info in pkgutil.iter_modules(gradlab_book.__path__):
        if info.name.startswith("exercises"):
            module = importlib.import_module(f"gradlab_book.{info.name}")
            if check in getattr(module, "__all__", ()):
                return module.__name__
    raise AssignmentError(f"no gradlab_book.exercises* module exports {check}")


def _markdown(source: str, like=None):
    cell = new_markdown_cell(source)
    if like is not None and like.metadata:
        cell.metadata = copy.deepcopy(like.metadata)
    return cell


def _solution_cells(question: Question, where: str) -> list:
    solution = question.solution
    if isinstance(solution, _Block):  # a {solution} block: shown to the graders unfolded
        lines = [line for line in solution.source.split("\n") if line.strip() != ":class: dropdown"]
        return [new_markdown_cell("\n".join(lines))]
    cells = []
    for item in solution.items:
        if isinstance(item, _Text):
            cells.append(new_markdown_cell(item.source))
        elif item.cell_type == "code":
            cell = copy.deepcopy(item)
            cell.source = otter_solution_code(item.source, f"{where} {question.name}")
            cell.outputs, cell.execution_count = [], None
            # booktools.myst_compat folds the book's solution code; the student's is open
            cell.metadata.get("jupyter", {}).pop("source_hidden", None)
            if cell.metadata.get("jupyter") == {}:
                del cell.metadata["jupyter"]
            cells.append(cell)
        else:
            raise AssignmentError(f"{where}: a {item.cell_type} cell in a solution")
    if question.autograded:
        # Otter runs a question's tests after its last solution cell, and keeps that cell in
        # the student's notebook only if it is code: explanations go before the last code.
        code = [i for i, c in enumerate(cells) if c.cell_type == "code"]
        if not code:
            raise AssignmentError(f"{where}: the solution of {question.name} has no code")
        last = code[-1]
        cells = cells[:last] + cells[last + 1 :] + [cells[last]]
    return cells


def _question_cells(question: Question, where: str) -> list:
    config = {"name": question.name, "points": question.points}
    if not question.autograded:
        config["manual"] = True
    cells = [
        _yaml_cell("BEGIN QUESTION", config),
        new_markdown_cell(question.text),
        _raw("# BEGIN SOLUTION"),
        *_solution_cells(question, where),
        _raw("# END SOLUTION"),
    ]
    if question.autograded:
        cells += [_raw("# BEGIN TESTS"), new_code_cell(test_source(question)), _raw("# END TESTS")]
    cells.append(_raw("# END QUESTION"))
    if question.autograded:  # the book's own self-check, for the student, after the question
        check = copy.deepcopy(question.check_cell)
        check.outputs, check.execution_count = [], None
        cells.append(check)
    return cells


def master_notebook(nb, name: str, config: dict, where: str = ""):
    """The Otter Assign notebook of a chapter and its questions.

    Args:
        nb (nbformat.NotebookNode): the instructor notebook (not modified).
        name (str): the assignment's name.
        config (dict): the rest of the assignment configuration (Otter Assign's keys).
        where (str): where the notebook is, for error messages. Default: ``""``

    Returns:
        tuple: the master notebook and the list of its :class:`Question`.
    """
    items, questions = read_chapter(nb, where or name)
    emitted = set()
    check_ids = {id(q.check_cell) for q in questions.values() if q.autograded}
    cells = [_yaml_cell("ASSIGNMENT CONFIG", {"name": name, **config})]
    for item in items:
        if isinstance(item, _Block):  # an exercise; its solution and check come with it
            if item.kind == "exercise":
                cells += _question_cells(questions[item.label], where)
                emitted.add(item.label)
        elif isinstance(item, _Gated):
            continue
        elif isinstance(item, _Text):
            cells.append(_markdown(item.source, item.cell))
        elif id(item) in check_ids:
            continue
        else:
            cells.append(copy.deepcopy(item))
    master = copy.deepcopy(nb)
    master.cells = cells
    for index, cell in enumerate(master.cells):
        cell["id"] = f"c{index:04d}"  # stable ids: the same chapter gives the same notebook
    return master, list(questions.values())


# ------------------------------------------------------------------------- building


def chapters(root: Path = ROOT) -> dict[str, Path]:
    """The chapters by name: the notebooks of the numbered parts of ``_toc.yml``, in order."""
    toc = yaml.safe_load((root / "_toc.yml").read_text(encoding="utf-8"))
    found: dict[str, Path] = {}
    for part in toc.get("parts", []):
        if not part.get("numbered"):
            continue
        for entry in part.get("chapters", []):
            path = root / (entry["file"] + ".ipynb")
            if path.exists():
                if path.stem in found:
                    raise AssignmentError(f"two chapters named {path.stem}")
                found[path.stem] = path
    return found


def _pins(root: Path) -> dict[str, str]:
    pins = {}
    for line in (root / "requirements.txt").read_text(encoding="utf-8").splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("==", 1)
            pins[re.sub(r"[-_.]+", "-", name.strip()).lower()] = version.strip()
    return pins


def _runtime_requirements(root: Path) -> list[str]:
    """gradlab-book's and gradlab's own dependencies, at the versions requirements.txt pins."""
    pins = _pins(root)
    names: list[str] = []
    for dist in ("gradlab-book", "gradlab"):
        for requirement in importlib.metadata.requires(dist) or []:
            if ";" in requirement:
                continue  # an extra's or a marker's dependency
            name = re.match(r"[A-Za-z0-9._-]+", requirement).group()
            key = re.sub(r"[-_.]+", "-", name).lower()
            if key not in ("gradlab", "torch") and key not in names:
                names.append(key)
    missing = [n for n in names if n not in pins]
    if missing:
        raise AssignmentError(f"requirements.txt pins none of {', '.join(missing)}")
    return [f"{name}=={pins[name]}" for name in names]


def build_wheels(out: Path, root: Path = ROOT) -> list[Path]:
    """The wheels of gradlab and gradlab-book, built from a copy of the checkout's files.

    The copy holds what a clone holds (tracked files, and new ones that git does not
    ignore), so no build litter reaches the checkout and nothing else reaches a wheel.

    Args:
        out (Path): the folder to write the two wheels into (emptied first).
        root (Path): the repository. Default: this repository

    Returns:
        list[Path]: the two wheels.
    """
    if out.exists():  # an earlier build's wheels, possibly of other versions
        shutil.rmtree(out)
    out.mkdir(parents=True)
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *_SOURCES],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    with tempfile.TemporaryDirectory(prefix="gradlab-wheels-") as tmp:
        copy_root = Path(tmp) / "src"
        for name in filter(None, listed.split("\0")):
            if (root / name).is_file():
                (copy_root / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / name, copy_root / name)
        command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out)]
        result = subprocess.run(
            [*command, str(copy_root), str(copy_root / "gradlab-book")],
            capture_output=True,
            text=True,
        )
        if result.returncode:
            raise AssignmentError(f"pip wheel failed:\n{result.stdout}\n{result.stderr}")
    wheels = sorted(out.glob("gradlab-*.whl")) + sorted(out.glob("gradlab_book-*.whl"))
    if len(wheels) != 2:
        raise AssignmentError(f"expected two wheels in {out}, found {wheels}")
    return wheels


def _requirements_text(wheels: list[Path], root: Path) -> str:
    torch = _pins(root).get("torch")
    return "\n".join(
        [
            # "=": the form micromamba's environment files take (otter's setup.sh uses mamba)
            f"--extra-index-url={TORCH_INDEX}",
            f"torch=={torch}+cpu",
            *(f"{AUTOGRADER_FILES}/wheels/{w.name}" for w in wheels),
            *_runtime_requirements(root),
            "",
        ]
    )


def _otter():
    """otter-grader's modules that this uses, or an error that says how to install them."""
    try:
        import otter.assign
        import otter.grade.utils
        import otter.run
        import otter.test_files
    except ImportError as exc:
        raise AssignmentError(
            "otter-grader is not installed in this environment: install the pins of "
            "requirements.txt (bash scripts/build_book.sh)"
        ) from exc
    return otter


def build_chapter(
    path: Path, out: Path, wheels: list[Path], *, root: Path = ROOT, run_tests: bool = True
) -> list[Question]:
    """Write ``out/master``, ``out/autograder`` and ``out/student`` for one chapter.

    Args:
        path (Path): the instructor notebook.
        out (Path): the chapter's folder (replaced if it holds an earlier build).
        wheels (list[Path]): the wheels of gradlab and gradlab-book (see :func:`build_wheels`).
        root (Path): the repository. Default: this repository
        run_tests (bool): have Otter Assign grade the solutions and fail below full marks.
            Default: ``True``

    Returns:
        list[Question]: the chapter's questions.
    """
    otter = _otter()
    name = path.stem
    nb = nbformat.read(path, as_version=4)
    if out.exists():
        if not (out / "master").is_dir():
            raise AssignmentError(f"{out} exists and is no earlier build: remove it")
        shutil.rmtree(out)
    master_dir = out / "master"
    (master_dir / "wheels").mkdir(parents=True)
    for wheel in wheels:
        shutil.copy2(wheel, master_dir / "wheels" / wheel.name)
    (master_dir / "requirements.txt").write_text(_requirements_text(wheels, root))
    config = {
        "requirements": "requirements.txt",
        "python_version": PYTHON_VERSION,
        "tests": {"ok_format": False},
        "autograder_files": [f"wheels/{w.name}" for w in wheels],
        # students see each hidden test's verdict once the grades are published
        "generate": {"show_hidden": True},
        "run_tests": run_tests,
    }
    master, questions = master_notebook(nb, name, config, str(path.relative_to(root)))
    nbformat.write(master, master_dir / f"{name}.ipynb")
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            otter.assign.main(str(master_dir / f"{name}.ipynb"), str(out))
    except Exception as exc:
        message = f"otter assign failed on {name}: {exc}\n{output.getvalue()}"
        raise AssignmentError(message) from exc
    (archive,) = (out / "autograder").glob(f"{name}-autograder_*.zip")
    archive.rename(out / "autograder" / f"{name}-autograder.zip")
    return questions


def build(
    out: Path, names: list[str] | None = None, *, root: Path = ROOT, run_tests: bool = True
) -> dict[str, list[Question]]:
    """Build the assignments of the chapters named (all by default) into ``out``.

    Args:
        out (Path): the output folder.
        names (list[str] | None): chapter names (notebook stems). Default: every chapter
        root (Path): the repository. Default: this repository
        run_tests (bool): see :func:`build_chapter`. Default: ``True``

    Returns:
        dict[str, list[Question]]: each chapter's questions.
    """
    _otter()  # before anything is built
    found = chapters(root)
    names = names or list(found)
    unknown = [n for n in names if n not in found]
    if unknown:
        raise AssignmentError(f"no chapter {', '.join(unknown)}; the chapters: {', '.join(found)}")
    out.mkdir(parents=True, exist_ok=True)
    wheels = build_wheels(out / "wheels", root)
    built = {}
    for name in names:
        built[name] = build_chapter(found[name], out / name, wheels, root=root, run_tests=run_tests)
        _write_questions(out / name / "questions.csv", {name: built[name]})
    # every chapter built into ``out`` so far, this time or before, in the book's order
    rows = [
        (out / name / "questions.csv").read_text(encoding="utf-8").split("\n", 1)[1]
        for name in found
        if (out / name / "questions.csv").is_file()
    ]
    (out / "questions.csv").write_text(_QUESTIONS_HEADER + "".join(rows), encoding="utf-8")
    return built


_QUESTIONS_HEADER = "chapter,question,kind,stars,points,check\n"


def _write_questions(path: Path, built: dict[str, list[Question]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(_QUESTIONS_HEADER.strip().split(","))
        for chapter, questions in built.items():
            for q in questions:
                kind = "autograded" if q.autograded else "manual"
                writer.writerow([chapter, q.name, kind, q.stars, q.points, q.check or ""])


# -------------------------------------------------------------------------- grading


def grade(autograder: Path, submissions: list[Path], output: Path):
    """Grade notebooks locally with ``otter run`` (no Docker) and write ``final_grades.csv``.

    Args:
        autograder (Path): an assignment's ``CHAPTER-autograder.zip``.
        submissions (list[Path]): notebooks, or folders whose ``*.ipynb`` are graded.
        output (Path): where to write ``SUBMISSION/results.json`` and ``final_grades.csv``.

    Returns:
        pandas.DataFrame: the grades, as written to ``final_grades.csv`` (the first row
        holds the points possible, as ``otter grade`` writes it).
    """
    otter = _otter()
    paths = []
    for path in submissions:
        paths += sorted(path.glob("*.ipynb")) if path.is_dir() else [path]
    output.mkdir(parents=True, exist_ok=True)
    scores = []
    for path in paths:
        here = output / path.stem
        here.mkdir(exist_ok=True)
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                result = otter.run.main(
                    str(path), autograder=str(autograder), output_dir=str(here), no_logo=True
                )
        except Exception as exc:  # a submission that cannot be graded scores 0, with why
            result = otter.test_files.GradingResults.without_results(exc)
        (here / "grading.log").write_text(log.getvalue(), encoding="utf-8")
        result.file = path.name
        scores.append(result)
    grades = otter.grade.utils.merge_scores_to_df(scores)
    grades.to_csv(output / "final_grades.csv", index=False)
    return grades


# -------------------------------------------------------------------------- CLI


def _build_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m booktools.assignments",
        description="Export the chapters' exercises as otter-grader assignments "
        "(`python -m booktools.assignments grade --help` grades submissions).",
    )
    parser.add_argument("out", type=Path, help="where to write one folder per chapter")
    parser.add_argument(
        "--chapter",
        action="append",
        metavar="NAME",
        help="a chapter to build, by its notebook's name (clip_norm); repeat for more. "
        "Default: every chapter",
    )
    parser.add_argument(
        "--no-run-tests",
        action="store_true",
        help="do not grade the solutions against the autograder (each run executes the chapter)",
    )
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if out == ROOT or (ROOT / "book") in (out, *out.parents):
        parser.error("OUT must not be the repository itself or lie inside book/")
    try:
        built = build(out, args.chapter, run_tests=not args.no_run_tests)
    except (AssignmentError, se.StudentEditionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for chapter, questions in built.items():
        auto = sum(q.points for q in questions if q.autograded)
        manual = sum(q.points for q in questions if not q.autograded)
        print(
            f"{chapter}: {len(questions)} questions; points: {auto} autograded, "
            f"{manual} graded by hand; {out / chapter}"
        )
    print(f"Questions and points: {out / 'questions.csv'}")
    return 0


def _grade_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m booktools.assignments grade",
        description="Grade submitted notebooks locally with otter run (no Docker).",
    )
    parser.add_argument("autograder", type=Path, help="the assignment's CHAPTER-autograder.zip")
    parser.add_argument("submissions", type=Path, nargs="+", help="notebooks or folders of them")
    parser.add_argument("--output", "-o", type=Path, required=True, help="where to write results")
    args = parser.parse_args(argv)
    try:
        grades = grade(args.autograder, args.submissions, args.output)
    except AssignmentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(grades.to_string(index=False))
    print(f"Grades: {args.output / 'final_grades.csv'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["grade"]:
        return _grade_main(argv[1:])
    return _build_main(argv)


if __name__ == "__main__":
    sys.exit(main())
