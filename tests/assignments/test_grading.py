"""The round trip: otter-grader's local grading (no Docker) of the built assignments.

* End to end, ``booktools.assignments.grade`` (one ``otter run`` per notebook: the notebook
  executed in a fresh kernel, then the autograder's tests) on three chapters: the notebook
  with the solutions scores full marks; a known wrong answer scores less on its question; a
  notebook whose answer cell raises scores zero there and full marks on the question after
  it; ``final_grades.csv`` says so.
* Test by test, for every autograded question whose check needs nothing of the chapter but
  the answer: Otter's exception-test runner, on the test file from the autograder zip, with
  the reference answer (full marks), the student's stub (zero), and each wrong answer that
  ``tests/book/test_exercises*.py`` show the self-check rejects (less than full marks).
"""

from __future__ import annotations

import ast
import builtins
import json
import re
import shutil
import symtable
import zipfile

import nbformat
import pytest
from known_wrong import BOOK_TESTS, known_wrong

from booktools import assignments
from booktools import student_edition as se

#: otter-grader is neither installed nor pinned in requirements.txt yet (conftest.py stops
#: the suite if it is pinned and missing).
NO_OTTER = "otter-grader is not installed, and requirements.txt does not pin it yet"
ExceptionTestFile = pytest.importorskip("otter.test_files", reason=NO_OTTER).ExceptionTestFile
pd = pytest.importorskip("pandas", reason=NO_OTTER)

CHAPTERS = assignments.chapters()
#: Graded end to end (one ``otter run`` is a run of the chapter, so a few): a short chapter,
#: the one with two coding questions, and the one whose check cell reads the chapter's data.
END_TO_END = ("norms", "per_sample_dp", "clip_vs_ignore")
WRONG = known_wrong()


# ------------------------------------------------------------------ helpers


def _imports(nb) -> str:
    """The chapter's import statements, in order: what its solutions' code refers to."""
    found = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            for node in ast.parse(cell.source).body:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found.append(ast.unparse(node))
    return "\n".join(found)


def _solution_code(question) -> list[str]:
    return [i.source for i in question.solution.items if getattr(i, "cell_type", "") == "code"]


def _answer_name(question) -> str:
    call = ast.parse(question.check_cell.source).body[-1].value
    return call.args[0].id


def _globals(source: str) -> tuple[set[str], set[str]]:
    """(read, bound): the module-level names ``source`` reads (in any scope: a function's
    body reading a global counts, its own parameters and locals do not) and those it
    binds (assigned, defined or imported at the top)."""
    read: set[str] = set()
    bound: set[str] = set()
    tables = [symtable.symtable(source, "<cell>", "exec")]
    top = tables[0]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for symbol in table.get_symbols():
            name = symbol.get_name()
            if table is top:
                if symbol.is_referenced():
                    read.add(name)
                if symbol.is_assigned() or symbol.is_imported() or symbol.is_namespace():
                    bound.add(name)
            elif symbol.is_global() and symbol.is_referenced():
                read.add(name)
    return read, bound


def _needs_chapter(nb, question) -> bool:
    """Whether the answer or the check cell reads a name that only the chapter's other
    cells define (beyond its imports): such a question is graded end to end only."""
    sources = (*_solution_code(question), question.check_cell.source)
    read: set[str] = set()
    bound = _globals(_imports(nb))[1]
    for source in sources:
        r, b = _globals(source)
        read |= r
        bound |= b
    return bool(read - bound - set(dir(builtins)))


def _questions():
    unit, needs_chapter = [], []
    for chapter, path in CHAPTERS.items():
        nb = nbformat.read(path, as_version=4)
        for question in assignments.read_chapter(nb, chapter)[1].values():
            if question.autograded:
                group = needs_chapter if _needs_chapter(nb, question) else unit
                group.append((chapter, question, nb))
    return unit, needs_chapter


UNIT, NEEDS_CHAPTER = _questions()
PAIRS = [(c, q, nb, w) for c, q, nb in UNIT for w in WRONG if w.check == q.check]
_NAMESPACES: dict[str, dict] = {}


def _reference(nb, question) -> dict:
    """A copy of the names the check cell sees in the notebook with the reference answer:
    the chapter's imports, then the solution's code."""
    if question.name not in _NAMESPACES:
        namespace: dict = {}
        exec(_imports(nb), namespace)
        for source in _solution_code(question):
            exec(source, namespace)
        _NAMESPACES[question.name] = namespace
    return dict(_NAMESPACES[question.name])


def _grade_test(built, chapter, question, env):
    """Otter's grading of one question's test file on ``env``: (score, possible, message)."""
    archive = built["out"] / chapter / "autograder" / f"{chapter}-autograder.zip"
    with zipfile.ZipFile(archive) as z:
        source = z.read(f"tests/{question.name}.py").decode()
    test = ExceptionTestFile.from_string(source, path=f"tests/{question.name}.py")
    test.run(env)
    return test.score, test.possible, test.test_case_results[0].message


def _student(built, chapter):
    return nbformat.read(built["out"] / chapter / "student" / f"{chapter}.ipynb", as_version=4)


def _answer_cells(nb) -> dict:
    """The student's code cell of each autograded question (Otter tags it with the test)."""
    return {
        c.metadata["otter"]["tests"][0]: c
        for c in nb.cells
        if c.cell_type == "code" and c.metadata.get("otter", {}).get("tests")
    }


# ------------------------------------------------------------- test by test


def test_the_unit_questions_and_the_end_to_end_chapters_cover_every_check():
    check_cells = sum(
        len(se.strip_notebook(nbformat.read(p, as_version=4))[1].cleared_check_cells)
        for p in CHAPTERS.values()
    )
    # One per coding exercise: every code cell of the chapters that calls a self-check.
    calls = re.compile(r"^\s*check_\w+\(", re.MULTILINE)
    coding = sum(
        1
        for p in CHAPTERS.values()
        for cell in nbformat.read(p, as_version=4).cells
        if cell.cell_type == "code" and calls.search(cell.source)
    )
    assert len(UNIT) + len(NEEDS_CHAPTER) == check_cells == coding
    assert {c for c, _, _ in NEEDS_CHAPTER} <= set(END_TO_END), NEEDS_CHAPTER
    assert [q.name for _, q, _ in NEEDS_CHAPTER] == ["clip-vs-ignore-threshold"]
    graded = {q.check for _, q, _ in UNIT} | {q.check for _, q, _ in NEEDS_CHAPTER}
    assert {w.check for w in WRONG} <= graded
    assert len(PAIRS) > 150


@pytest.mark.parametrize("chapter, question, nb", UNIT, ids=[q.name for _, q, _ in UNIT])
def test_the_reference_answer_scores_full_marks(built, chapter, question, nb):
    score, possible, message = _grade_test(built, chapter, question, _reference(nb, question))
    assert score == possible == question.points, message


@pytest.mark.parametrize("chapter, question, nb", UNIT, ids=[q.name for _, q, _ in UNIT])
def test_the_stub_handed_out_scores_zero(built, chapter, question, nb):
    env = _reference(nb, question)
    exec(_answer_cells(_student(built, chapter))[question.name].source, env)
    score, possible, message = _grade_test(built, chapter, question, env)
    assert (score, possible) == (0, question.points)
    assert "Not implemented yet" in message


@pytest.mark.parametrize(
    "chapter, question, nb, wrong",
    PAIRS,
    ids=[f"{q.name}-{w.where}" for _, q, _, w in PAIRS],
)
def test_a_known_wrong_answer_scores_less(built, chapter, question, nb, wrong):
    env = _reference(nb, question)
    env[_answer_name(question)] = wrong.answer
    score, possible, message = _grade_test(built, chapter, question, env)
    assert score < possible == question.points, message
    assert message.strip() and "AssertionError" in message  # the check's verdict


# ------------------------------------------------------------- end to end


def _wrong_import(check: str, name: str) -> tuple[str, object]:
    """A cell that defines ``name`` as the first module-level wrong answer for ``check``,
    and that answer."""
    for wrong in WRONG:
        module = getattr(wrong.answer, "__module__", "")
        named = getattr(wrong.answer, "__name__", "")
        ours = wrong.check == check and "rejects" in wrong.where and named.startswith("_")
        if ours and getattr(__import__(module), named, None) is wrong.answer:
            source = (
                f"import sys\nsys.path.insert(0, {str(BOOK_TESTS)!r})\n"
                f"from {module} import {named} as {name}"
            )
            return source, wrong.answer
    raise AssertionError(f"no module-level wrong answer for {check}")


def _submissions(built, chapter, folder):
    """Write the notebooks to grade for ``chapter`` into ``folder``."""
    folder.mkdir()
    student = _student(built, chapter)
    cells = _answer_cells(student)
    questions = {q.name: q for q in built["questions"][chapter] if q.autograded}
    if chapter == "norms":
        q = questions["norms-total-norm"]
        cells[q.name].source, _ = _wrong_import(q.check, _answer_name(q))
        nbformat.write(student, folder / "wrong.ipynb")
    elif chapter == "per_sample_dp":
        for name, question in questions.items():
            (cells[name].source,) = _solution_code(question)
        crashing = cells["per_sample_dp-ignore-per-sample"]
        crashing.source = 'raise RuntimeError("a bug in the student\'s cell")\n' + crashing.source
        nbformat.write(student, folder / "crash.ipynb")
    elif chapter == "clip_vs_ignore":
        reference = built["out"] / chapter / "autograder" / f"{chapter}.ipynb"
        shutil.copy(reference, folder / "reference.ipynb")
        # A rule that returns the same number whatever the warm-up: right in the units of
        # the run it was read from, wrong in any other (check_threshold_choice says so).
        cells[
            "clip-vs-ignore-threshold"
        ].source = "def choose_threshold(warmup_norms):\n    return 12.0\n"
        nbformat.write(student, folder / "wrong.ipynb")


@pytest.fixture(scope="module")
def graded(built, tmp_path_factory):
    """``{chapter: (final_grades as a DataFrame, results folder)}`` for the end-to-end chapters."""
    results = {}
    for chapter in END_TO_END:
        base = tmp_path_factory.mktemp(chapter)
        _submissions(built, chapter, base / "submissions")
        zip_path = built["out"] / chapter / "autograder" / f"{chapter}-autograder.zip"
        grades = assignments.grade(zip_path, [base / "submissions"], base / "results")
        results[chapter] = (grades, base / "results")
    return results


def _rows(graded, chapter) -> dict:
    grades, folder = graded[chapter]
    assert (folder / "final_grades.csv").read_text() == grades.to_csv(index=False)
    return {row["file"]: row for row in pd.read_csv(folder / "final_grades.csv").to_dict("records")}


def _points(built, chapter) -> dict:
    return {q.name: q.points for q in built["questions"][chapter] if q.autograded}


@pytest.mark.parametrize("chapter", END_TO_END)
def test_the_grades_hold_the_points_of_the_stars(built, graded, chapter):
    rows, points = _rows(graded, chapter), _points(built, chapter)
    assert {q: rows["points-per-question"][q] for q in points} == points
    assert rows["points-per-question"]["total_points_earned"] == sum(points.values())


def test_the_notebook_with_the_solutions_scores_full_marks(built, graded):
    reference = _rows(graded, "clip_vs_ignore")["reference.ipynb"]
    assert reference["clip-vs-ignore-threshold"] == 2
    assert reference["percent_correct"] == 1 and reference["grading_status"] == "Completed"


@pytest.mark.parametrize(
    "chapter, question",
    [("norms", "norms-total-norm"), ("clip_vs_ignore", "clip-vs-ignore-threshold")],
)
def test_a_known_wrong_answer_scores_less_on_its_question(built, graded, chapter, question):
    row = _rows(graded, chapter)["wrong.ipynb"]
    assert row[question] < _points(built, chapter)[question]
    results = json.loads((graded[chapter][1] / "wrong" / "results.json").read_text())
    (test,) = [t for t in results["tests"] if t["name"] == question]
    assert test["score"] == 0 and "AssertionError" in test["output"]
    assert test["visibility"] == "after_published"  # the verdict, once grades are out
    if chapter == "norms":  # the message is the verdict the self-check prints
        import contextlib
        import io

        from gradlab_book.exercises import check_total_norm

        _, answer = _wrong_import("check_total_norm", "f")
        verdict = io.StringIO()
        with contextlib.redirect_stdout(verdict):
            assert check_total_norm(answer) is False
        assert verdict.getvalue().strip().split("\n")[0] in test["output"]


def test_a_notebook_that_raises_in_one_question_still_grades_the_rest(built, graded):
    row = _rows(graded, "per_sample_dp")["crash.ipynb"]
    points = _points(built, "per_sample_dp")
    assert row["per_sample_dp-ignore-per-sample"] == 0
    assert row["per_sample_dp-ghost-norm"] == points["per_sample_dp-ghost-norm"] > 0
    assert row["grading_status"] == "Completed"
    results = json.loads((graded["per_sample_dp"][1] / "crash" / "results.json").read_text())
    (test,) = [t for t in results["tests"] if t["name"] == "per_sample_dp-ignore-per-sample"]
    assert "NameError" in test["output"] and "ignore_per_sample" in test["output"]
