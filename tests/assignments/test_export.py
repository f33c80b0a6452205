"""What booktools.assignments writes: every exercise a question worth its stars, an
autograder whose tests are the chapters' own check cells, a student notebook with no
solution and no test, and an environment for the grader that installs this checkout.

The expectations are read from the instructor notebooks directly (labels, stars, the
student edition's code), and Otter's own parsers read what was written.
"""

from __future__ import annotations

import json
import re
import shutil
import zipfile

import nbformat
import pytest
import yaml
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from booktools import assignments
from booktools import student_edition as se

#: otter-grader is neither installed nor pinned in requirements.txt yet (conftest.py stops
#: the suite if it is pinned and missing).
NO_OTTER = "otter-grader is not installed, and requirements.txt does not pin it yet"
replace_solutions = pytest.importorskip("otter.assign.solutions", reason=NO_OTTER).replace_solutions
ExceptionTestFile = pytest.importorskip("otter.test_files", reason=NO_OTTER).ExceptionTestFile

CHAPTERS = assignments.chapters()


def _instructor(chapter):
    return nbformat.read(CHAPTERS[chapter], as_version=4)


def _student(built, chapter):
    return nbformat.read(built["out"] / chapter / "student" / f"{chapter}.ipynb", as_version=4)


def _zip(built, chapter):
    return zipfile.ZipFile(built["out"] / chapter / "autograder" / f"{chapter}-autograder.zip")


def _exercises(nb) -> dict[str, int]:
    """label -> stars, read from the Markdown: the first run of ★ after the label line."""
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    found = re.findall(r"\{exercise\}[^\n]*\n(?::[^\n]*\n)*?:label: (\S+)\n(?:[^★]*?)(★+)", text)
    assert text.count("{exercise}") == len(found)
    return {label: len(stars) for label, stars in found}


def _master_questions(built, chapter) -> dict[str, dict]:
    master = nbformat.read(built["out"] / chapter / "master" / f"{chapter}.ipynb", as_version=4)
    configs = [
        yaml.safe_load(c.source.split("\n", 1)[1])
        for c in master.cells
        if c.cell_type == "raw" and c.source.startswith("# BEGIN QUESTION")
    ]
    return {c["name"]: c for c in configs}


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_exercise_is_a_question_worth_its_stars(built, chapter):
    nb = _instructor(chapter)
    stars = _exercises(nb)
    questions = _master_questions(built, chapter)
    assert list(questions) == list(stars)  # every exercise, in the book's order
    report = se.strip_notebook(nb)[1]
    autograded = [n for n, c in questions.items() if not c.get("manual")]
    assert len(autograded) == len(report.cleared_check_cells)  # one per self-check cell
    for name, config in questions.items():
        assert config["points"] == stars[name] * assignments.POINTS_PER_STAR
        assert stars[name] in (1, 2, 3)
    assert assignments.POINTS_PER_STAR == 1  # the mapping book/instructors.md documents
    with _zip(built, chapter) as archive:
        tests = sorted(n for n in archive.namelist() if n.startswith("tests/"))
        assert tests == sorted(f"tests/{n}.py" for n in autograded)
        for name in autograded:
            test = ExceptionTestFile.from_string(archive.read(f"tests/{name}.py").decode())
            assert test.name == name
            assert [(c.hidden, c.points) for c in test.test_cases] == [(True, stars[name])]


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_student_notebook_holds_no_solution_and_no_test(built, chapter):
    nb = _instructor(chapter)
    student = _student(built, chapter)
    text = json.dumps(student)
    sources = "\n".join(c.source for c in student.cells)
    assert not re.search(r"BEGIN SOLUTION|END SOLUTION|BEGIN PROMPT|\{solution", sources)
    assert all(not c.get("outputs") for c in student.cells)
    assert "cases pass" not in text and "Passed." not in text
    _, questions = assignments.read_chapter(nb, chapter)
    hidden = []
    for question in questions.values():
        solution = question.solution
        if isinstance(solution, assignments._Block):
            hidden.append(solution.source.split("\n", 1)[1].rsplit("\n", 1)[0])
        else:
            for item in solution.items:
                if isinstance(item, assignments._Text):
                    hidden.append(item.source)
                else:
                    regions = re.findall(
                        r"### BEGIN SOLUTION\n(.*?)\n[ \t]*### END SOLUTION", item.source, re.S
                    )
                    hidden += regions or [item.source]
    assert len(hidden) >= len(questions)
    # a line of a solution may also stand in the chapter's text (the student edition)
    edition = "\n".join(c.source for c in se.strip_notebook(nb)[0].cells)
    for secret in hidden:
        assert secret.strip() not in sources
        for line in (ln.strip() for ln in secret.split("\n") if len(ln.strip()) >= 30):
            assert line not in sources or line in edition, f"{chapter}: a solution leaks: {line}"
    # the hidden tests live in the autograder only: the notebook's copy has no test case
    assert set((built["out"] / chapter / "student").iterdir()) == {
        built["out"] / chapter / "student" / f"{chapter}.ipynb"
    }
    for test in student.metadata["otter"]["tests"].values():
        assert "test_case" not in test.replace("import test_case", "")
        assert "def " not in test and "check_" not in test


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_student_code_is_the_student_editions(built, chapter):
    """The code students get is the student edition's, cell for cell, plus Otter's own
    two cells (its grader at the top, the export for submission at the end)."""
    edition = se.strip_notebook(_instructor(chapter))[0]
    student = _student(built, chapter)
    ours = [c for c in student.cells if c.cell_type == "code"]
    otters = [c for c in ours if c.metadata.get("editable") is False]
    assert [c.source.split("\n")[0] for c in otters] == [
        "# Initialize Otter",
        "# Save your notebook first, then run this cell to export your submission.",
    ]
    assert [c.source for c in ours if c not in otters] == [
        c.source for c in edition.cells if c.cell_type == "code"
    ]


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_each_test_runs_the_chapters_check_cell(built, chapter):
    _, questions = assignments.read_chapter(_instructor(chapter), chapter)
    with _zip(built, chapter) as archive:
        for question in (q for q in questions.values() if q.autograded):
            source = archive.read(f"tests/{question.name}.py").decode()
            call = question.check_cell.source.rstrip().split("\n")
            # the call, and each line before it, appear in the test as the cell has them
            for line in call:
                if line.strip():
                    assert repr(line.strip())[1:-1] in source, (question.name, line)
            assert f"import_module({assignments._check_module(question.check)!r})" in source
            assert "assert passed is True, verdict.getvalue()" in source


def test_autograder_installs_this_checkout(built):
    from importlib.metadata import version

    pins = assignments._pins(assignments.ROOT)
    wheels = sorted((built["out"] / "wheels").glob("*.whl"))
    assert [w.name.split("-")[0] for w in wheels] == ["gradlab", "gradlab_book"]
    for chapter in CHAPTERS:
        with _zip(built, chapter) as archive:
            env = yaml.safe_load(archive.read("environment.yml"))
            config = json.loads(archive.read("otter_config.json"))
            assert config["assignment_name"] == chapter and config["show_hidden"] is True
            deps = env["dependencies"]
            assert f"python={assignments.PYTHON_VERSION}" in deps
            pip = next(d["pip"] for d in deps if isinstance(d, dict))
            assert pip[0] == f"otter-grader[grading,plugins]=={version('otter-grader')}"
            assert f"--extra-index-url={assignments.TORCH_INDEX}" in pip
            assert f"torch=={pins['torch']}+cpu" in pip
            for wheel in wheels:
                assert f"/autograder/source/files/wheels/{wheel.name}" in pip
                assert archive.read(f"files/wheels/{wheel.name}") == wheel.read_bytes()
            for dependency in ("numpy", "matplotlib", "opacus", "ipywidgets", "pillow"):
                assert f"{dependency}=={pins[dependency]}" in pip
    # the wheels hold this checkout's checks, which grade the submissions
    with zipfile.ZipFile(wheels[1]) as wheel:
        for path in (assignments.ROOT / "gradlab-book" / "gradlab_book").glob("exercises*.py"):
            assert wheel.read(f"gradlab_book/{path.name}") == path.read_bytes()


def test_questions_csv_lists_every_question(built):
    import csv

    with open(built["out"] / "questions.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    expected = [
        (chapter, q.name, "autograded" if q.autograded else "manual", str(q.points))
        for chapter, qs in built["questions"].items()
        for q in qs
    ]
    assert [(r["chapter"], r["question"], r["kind"], r["points"]) for r in rows] == expected
    assert {r["check"] for r in rows if r["kind"] == "autograded"} <= set(se.CHECKS)
    for chapter in CHAPTERS:
        with open(built["out"] / chapter / "questions.csv", encoding="utf-8") as f:
            assert list(csv.DictReader(f)) == [r for r in rows if r["chapter"] == chapter]


def test_a_rebuild_of_one_chapter_keeps_the_others_in_questions_csv(built, tmp_path, monkeypatch):
    def session_wheels(out, root=assignments.ROOT):  # the session's, not built again
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(built["out"] / "wheels", out)
        return sorted(out.glob("*.whl"))

    monkeypatch.setattr(assignments, "build_wheels", session_wheels)
    assignments.build(tmp_path, ["ignore_value"], run_tests=False)
    (tmp_path / "ignore_value" / "student" / "stale.txt").write_text("from the first build")
    assignments.build(tmp_path, ["ignore_value", "norms"], run_tests=False)  # one rebuilt
    text = (tmp_path / "questions.csv").read_text()
    chapters = [line.split(",")[0] for line in text.splitlines()[1:]]
    assert chapters == ["norms"] * 5 + ["ignore_value"] * 5  # the book's order
    assert not (tmp_path / "ignore_value" / "student" / "stale.txt").exists()


# ------------------------------------------------------------- the conversion


def test_solution_code_becomes_the_student_editions_stub_under_otter():
    source = (
        "def f(x):\n"
        '    """Doc."""\n'
        "    ### BEGIN SOLUTION\n"
        "    y = x + 1\n"
        "    return y\n"
        "    ### END SOLUTION\n"
        "\n"
        "z = 1"
    )
    converted = assignments.otter_solution_code(source)
    student = "\n".join(replace_solutions(converted.split("\n"), "python"))
    assert student == se.stub_solution_regions(source)[0]
    solution = {}
    exec(converted, solution)  # the autograder's notebook runs the solution unchanged
    assert solution["f"](1) == 2 and solution["z"] == 1
    whole = assignments.otter_solution_code("threshold = 2.0")
    assert "\n".join(replace_solutions(whole.split("\n"), "python")) == se.STUB
    with pytest.raises(se.StudentEditionError):
        assignments.otter_solution_code("### BEGIN SOLUTION\nx = 1")


def _chapter(*cells):
    return new_notebook(cells=list(cells))


GATED = [
    new_markdown_cell(":::{exercise}\n:label: e1\n★★ Write `f(x)`.\n:::"),
    new_markdown_cell("```{solution-start} e1\n:class: dropdown\n```"),
    new_code_cell("def f(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION"),
    new_markdown_cell("Why: SECRET.\n\n```{solution-end}\n```\nAfter the solution."),
    new_code_cell("from gradlab_book.exercises import check_total_norm\n\ncheck_total_norm(f)"),
]


def test_a_gated_exercise_becomes_one_autograded_question():
    master, questions = assignments.master_notebook(_chapter(*GATED), "demo", {})
    (question,) = questions
    assert (question.name, question.points, question.check) == ("e1", 2, "check_total_norm")
    kinds = [(c.cell_type, c.source.split("\n")[0]) for c in master.cells]
    assert kinds == [
        ("raw", "# ASSIGNMENT CONFIG"),
        ("raw", "# BEGIN QUESTION"),
        ("markdown", ":::{exercise}"),
        ("raw", "# BEGIN SOLUTION"),
        ("markdown", "Why: SECRET."),  # explanations before the last solution code
        ("code", "def f(x):"),
        ("raw", "# END SOLUTION"),
        ("raw", "# BEGIN TESTS"),
        ("code", '""" # BEGIN TEST CONFIG'),
        ("raw", "# END TESTS"),
        ("raw", "# END QUESTION"),
        ("code", "from gradlab_book.exercises import check_total_norm"),
        ("markdown", "After the solution."),
    ]


@pytest.mark.parametrize(
    "cells, message",
    [
        ([new_markdown_cell(":::{exercise}\n:label: e1\nNo stars.\n:::")], "no difficulty"),
        ([GATED[0]], "e1 has no solution"),
        ([GATED[1], GATED[2], GATED[3]], "which is no exercise here"),
        ([GATED[0], new_code_cell("x = 1"), *GATED[1:]], "code cells between exercise e1"),
        (
            [*GATED[:4], new_code_cell("check_total_norm(f)\nprint('done')")],
            "must end with the check_* call",
        ),
        (GATED[:3], "has no {solution-end}"),
        ([new_markdown_cell("::::{note}\n:::{exercise}\n:label: e2\n★\n:::\n::::")], "inside a"),
    ],
)
def test_a_chapter_that_cannot_be_exported_says_why(cells, message):
    with pytest.raises(assignments.AssignmentError, match=re.escape(message)):
        assignments.master_notebook(_chapter(*cells), "demo", {}, "here.ipynb")


def test_cli_refuses_an_unknown_chapter_and_a_folder_in_book(tmp_path, capsys):
    assert assignments.main([str(tmp_path / "out"), "--chapter", "nope"]) == 1
    assert "no chapter nope" in capsys.readouterr().err
    assert not (tmp_path / "out" / "wheels").exists()  # refused before building anything
    with pytest.raises(SystemExit):
        assignments.main([str(assignments.ROOT / "book" / "out")])
    assert "inside book/" in capsys.readouterr().err


def test_chapters_are_the_numbered_parts_of_the_toc():
    toc = yaml.safe_load((assignments.ROOT / "_toc.yml").read_text())
    # The numbered notebooks; a Markdown page (gradlab in your trainer) has no exercise.
    numbered = [
        e["file"].rsplit("/", 1)[1]
        for p in toc["parts"]
        if p.get("numbered")
        for e in p["chapters"]
        if (assignments.ROOT / f"{e['file']}.ipynb").is_file()
    ]
    assert list(CHAPTERS) == numbered and len(numbered) == 18
    assert "corrections" not in CHAPTERS  # an appendix, its exercises have no stars


def test_cli_grade_passes_its_arguments_and_prints_the_grades(tmp_path, monkeypatch, capsys):
    import pandas as pd

    calls = []

    def fake_grade(autograder, submissions, output):
        calls.append((autograder, submissions, output))
        return pd.DataFrame({"file": ["a.ipynb"], "q": [2]})

    monkeypatch.setattr(assignments, "grade", fake_grade)
    argv = ["grade", str(tmp_path / "z.zip"), str(tmp_path / "s1"), str(tmp_path / "s2")]
    assert assignments.main([*argv, "--output", str(tmp_path / "r")]) == 0
    assert calls == [(tmp_path / "z.zip", [tmp_path / "s1", tmp_path / "s2"], tmp_path / "r")]
    out = capsys.readouterr().out
    assert "a.ipynb" in out and str(tmp_path / "r" / "final_grades.csv") in out
