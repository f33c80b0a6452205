"""The student edition removes every solution, runs up to the first exercise, and
gives back passing checks once the solutions are pasted in again.

A tiny fixture book (two notebooks, an intro and an instructors' page, written
here with sentinel strings in every kind of solution) is executed, turned into the
student edition once per test session (HTML build included), and searched. The real
chapters under book/ are checked too, whichever of them exist.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from booktools import student_edition as se

ROOT = se.ROOT

SENTINELS = [
    "SENTINEL_CODE_A",  # inside ### BEGIN/END SOLUTION
    "SENTINEL_GATED_MD_A",  # markdown between solution-start and solution-end
    "SENTINEL_MD_SOLUTION_A",  # a ```{solution} block
    "SENTINEL_CODE_B",  # a gated code cell without markers
    "SENTINEL_OUTPUT_B",  # that cell's printed output
    "SENTINEL_MD_SOLUTION_B",  # a :::{solution} block
    "SENTINEL_CODE_B2",  # a second marked solution
    "SENTINEL_INSTRUCTORS",  # the instructors' page
]
CHECK_PASSED = re.compile(r"All \d+ cases pass\.|Passed\.")
KERNEL = "python3"


# ------------------------------------------------------------------ unit tests


def test_stub_keeps_signature_and_indentation():
    source = textwrap.dedent(
        """\
        def f(x):
            \"\"\"Doc.\"\"\"
            ### BEGIN SOLUTION
            y = x + 1
            return y
            ### END SOLUTION

        z = 1"""
    )
    out, replaced = se.stub_solution_regions(source)
    assert replaced
    assert out == 'def f(x):\n    """Doc."""\n    raise NotImplementedError\n\nz = 1'
    assert se.stub_solution_regions("x = 1") == ("x = 1", False)


@pytest.mark.parametrize(
    "source",
    [
        "### BEGIN SOLUTION\nx = 1",
        "x = 1\n### END SOLUTION",
        "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION",
    ],
)
def test_unbalanced_markers_are_an_error(source):
    with pytest.raises(se.StudentEditionError):
        se.stub_solution_regions(source, "here")


def test_check_cells_are_recognised_by_the_exercise_checks():
    from gradlab_book import exercises, exercises_precision

    assert set(exercises.__all__) <= set(se.CHECKS)
    assert "check_max_loss_scale" in se.CHECKS  # a chapter's own module counts too
    assert "check_max_loss_scale" in exercises_precision.__all__
    assert all(name.startswith("check_") for name in se.CHECKS)
    assert se._CHECK_CALL.search("from x import y\n\ncheck_total_norm(my_total_norm)")
    assert not se._CHECK_CALL.search("check_figure(sweep)")
    assert not se._CHECK_CALL.search("torch._amp_foreach_non_finite_check_and_unscale_(g)")


def test_markdown_solutions_go_and_code_fences_stay():
    text = textwrap.dedent(
        """\
        Before.

        :::{exercise}
        :label: e1
        Do it.
        :::

        ::::{solution} e1
        :class: dropdown
        Secret.
        :::{note}
        Nested secret.
        :::
        ::::

        ```{solution} e1
        Backtick secret.
        ```

        ```markdown
        :::{solution} shown-as-syntax
        Kept.
        :::
        ```

        After."""
    )
    out = se.strip_markdown_file(text)
    assert "secret" not in out.lower()
    assert "Do it." in out and "Before." in out and "After." in out
    assert ":::{solution} shown-as-syntax" in out and "Kept." in out


def test_gated_markdown_spans_cells_and_must_end():
    state = se._MarkdownState()
    assert se.strip_markdown("Q\n```{solution-start} e1\n:class: dropdown\n```", state) == "Q"
    assert state.in_gated
    assert se.strip_markdown("hidden text", state) == ""
    assert se.strip_markdown("```{solution-end}\n```\nvisible", state) == "visible"
    assert not state.in_gated
    with pytest.raises(se.StudentEditionError):
        se.strip_markdown_file("```{solution-start} e1\n```\nno end")


def test_stubs_are_unfolded_for_the_student():
    """booktools.myst_compat folds a gated solution's code for JupyterLab; the stub
    that replaces it in the student edition is shown."""
    solution = new_code_cell("def f():\n    ### BEGIN SOLUTION\n    pass\n    ### END SOLUTION")
    solution.metadata["jupyter"] = {"source_hidden": True}
    kept = new_code_cell("print(1)")
    kept.metadata["jupyter"] = {"source_hidden": True, "outputs_hidden": False}
    nb = new_notebook(
        cells=[
            new_markdown_cell(":::{exercise}\n:label: e1\nDo.\n:::"),
            new_markdown_cell("```{solution-start} e1\n:class: dropdown\n```"),
            solution,
            new_markdown_cell("```{solution-end}\n```"),
            kept,
        ]
    )
    student, report = se.strip_notebook(nb)
    stub = next(c for c in student.cells if c.get("id") == solution.id)
    assert report.stubbed_cells == [solution.id]
    assert "raise NotImplementedError" in stub.source and "jupyter" not in stub.metadata
    assert student.cells[-1].metadata["jupyter"]["source_hidden"] is True  # not a solution
    assert solution.metadata["jupyter"] == {"source_hidden": True}  # the input is untouched


# ------------------------------------------------------------- fixture book


def _gated(label: str) -> list:
    return [
        new_markdown_cell(f"```{{solution-start}} {label}\n:class: dropdown\n```"),
    ]


def _gated_end():
    return new_markdown_cell("```{solution-end}\n```")


def _chapter_a():
    return new_notebook(
        cells=[
            new_markdown_cell("# Chapter Alpha\n\nThe word zebracorn is indexed for search."),
            new_code_cell(
                "import torch\n\nfrom gradlab_book.exercises import check_grad_ignore_value\n\n"
                'torch.manual_seed(0)\nprint("setup ok")'
            ),
            new_markdown_cell(
                ":::{exercise}\n:label: fixture-a-ignore\n"
                "Write `my_ignore_value_(parameters, clip_value)`.\n:::"
            ),
            *_gated("fixture-a-ignore"),
            new_code_cell(
                "def my_ignore_value_(parameters, clip_value):\n"
                "    ### BEGIN SOLUTION\n"
                "    # SENTINEL_CODE_A\n"
                "    if isinstance(parameters, torch.Tensor):\n"
                "        parameters = [parameters]\n"
                "    grads = [p.grad for p in parameters if p.grad is not None]\n"
                "    maxima = [g.abs().amax().double() for g in grads if g.numel() > 0]\n"
                "    if not maxima:\n"
                "        return torch.tensor(0.0)\n"
                "    largest = torch.stack(maxima).amax()\n"
                "    for g in grads:\n"
                "        g.masked_fill_(~(largest < clip_value), 0.0)\n"
                "    return largest\n"
                "    ### END SOLUTION"
            ),
            new_markdown_cell("Why a select: SENTINEL_GATED_MD_A."),
            _gated_end(),
            new_code_cell("check_grad_ignore_value(my_ignore_value_)"),
            new_markdown_cell(
                ":::{exercise}\n:label: fixture-a-think\nWhy zero everything?\n:::\n\n"
                "```{solution} fixture-a-think\n:class: dropdown\nSENTINEL_MD_SOLUTION_A\n```"
            ),
            new_code_cell('print("after the exercises")'),
        ],
        metadata={"kernelspec": {"name": KERNEL, "display_name": "Python 3", "language": "python"}},
    )


def _chapter_b():
    return new_notebook(
        cells=[
            new_markdown_cell("# Chapter Beta"),
            new_code_cell(
                "from gradlab_book.exercises import check_clip_grad_value\n"
                "from gradlab_book.exercises_training import check_threshold_choice\n\n"
                'print("imports ok")'
            ),
            new_markdown_cell(":::{exercise}\n:label: fixture-b-threshold\nChoose `answer`.\n:::"),
            *_gated("fixture-b-threshold"),
            new_code_cell('answer = 5.0  # SENTINEL_CODE_B\nprint("SENTINEL_OUTPUT_B")'),
            _gated_end(),
            new_code_cell(
                "check_threshold_choice(answer, [1.0, 2.0, 3.0], [10.0], keep_fraction=1)"
            ),
            new_markdown_cell(
                ":::{exercise}\n:label: fixture-b-clip\n"
                "Write `my_clip_value_(parameters, clip_value)`.\n:::"
            ),
            *_gated("fixture-b-clip"),
            new_code_cell(
                "def my_clip_value_(parameters, clip_value):\n"
                "    ### BEGIN SOLUTION\n"
                "    if hasattr(parameters, 'grad'):  # one bare tensor\n"
                "        parameters = [parameters]\n"
                "    for p in parameters:  # SENTINEL_CODE_B2\n"
                "        if p.grad is not None:\n"
                "            p.grad.clamp_(-clip_value, clip_value)\n"
                "    ### END SOLUTION"
            ),
            _gated_end(),
            new_code_cell("check_clip_grad_value(my_clip_value_)"),
            new_markdown_cell(
                ":::{exercise}\n:label: fixture-b-think\nExplain.\n:::\n\n"
                ":::{solution} fixture-b-think\n:class: dropdown\nSENTINEL_MD_SOLUTION_B\n:::"
            ),
        ],
        metadata={"kernelspec": {"name": KERNEL, "display_name": "Python 3", "language": "python"}},
    )


FIXTURE_CONFIG = """\
title: Fixture book
author: Tests
only_build_toc_files: true
execute:
  execute_notebooks: cache
  allow_errors: false
parse:
  myst_enable_extensions: [colon_fence, dollarmath]
repository:
  url: https://github.com/example-org/instructor-repo
  branch: main
html:
  use_repository_button: true
launch_buttons:
  binderhub_url: https://mybinder.org
sphinx:
  extra_extensions: [sphinx_exercise]
"""

FIXTURE_TOC = """\
format: jb-book
root: book/intro
chapters:
  - file: book/ch_a
  - file: book/ch_b
  - file: book/instructors
"""


def _execute(nb, cwd: Path, allow_errors: bool = False):
    client = NotebookClient(
        nb,
        timeout=300,
        kernel_name=KERNEL,
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(cwd)}},
    )
    client.execute()
    return nb


@pytest.fixture(scope="session")
def edition(tmp_path_factory):
    """The executed fixture book and its student edition (one HTML build per session)."""
    root = tmp_path_factory.mktemp("fixture_book")
    book = root / "book"
    book.mkdir()
    (root / "_config.yml").write_text(FIXTURE_CONFIG)
    (root / "_toc.yml").write_text(FIXTURE_TOC)
    (book / "intro.md").write_text("# Fixture intro\n\nTwo chapters.\n")
    (book / "instructors.md").write_text(
        "# For instructors\n\nSENTINEL_INSTRUCTORS\n\n```python\n"
        "def f():\n    ### BEGIN SOLUTION\n    pass\n    ### END SOLUTION\n```\n"
    )
    instructor = {}
    for name, make in (("ch_a.ipynb", _chapter_a), ("ch_b.ipynb", _chapter_b)):
        nb = _execute(make(), book)
        nbformat.write(nb, book / name)
        instructor[name] = nb
    out = tmp_path_factory.mktemp("student") / "edition"
    reports = se.build_student_edition(out, root=root, html=True, quiet=True)
    return {"root": root, "out": out, "instructor": instructor, "reports": reports}


def _student(edition, name):
    return nbformat.read(edition["out"] / "notebooks" / name, as_version=4)


def test_fixture_instructor_notebooks_pass_their_checks(edition):
    for nb in edition["instructor"].values():
        text = json.dumps(nb)
        assert "SENTINEL_OUTPUT_B" in text or "SENTINEL_CODE_A" in text
        check_outputs = [
            "".join(o.get("text", "") for o in c.outputs)
            for c in nb.cells
            if c.cell_type == "code" and "check_" in c.source and "import" not in c.source
        ]
        assert check_outputs and all(CHECK_PASSED.search(o) for o in check_outputs)


def test_layout(edition):
    out = edition["out"]
    assert (out / "notebooks" / "ch_a.ipynb").exists()
    assert (out / "notebooks" / "ch_b.ipynb").exists()
    assert (out / "html" / "index.html").exists()
    assert (out / "html" / "book" / "ch_a.html").exists()
    assert (out / "html" / "searchindex.js").exists()
    assert not (out / "html" / "book" / "instructors.html").exists()
    # the instructor tree is untouched
    assert "SENTINEL_CODE_A" in (edition["root"] / "book" / "ch_a.ipynb").read_text()
    assert not (edition["root"] / "_build").exists()


def _text_files(folder: Path):
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix in {".html", ".js", ".ipynb", ".txt", ".json", ".md"}:
            yield path


def test_no_solution_text_in_any_student_file(edition):
    files = list(_text_files(edition["out"]))
    assert len(files) > 10
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for sentinel in SENTINELS:
            assert sentinel not in text, f"{sentinel} leaks into {path}"
        assert "BEGIN SOLUTION" not in text, path
        assert not CHECK_PASSED.search(text) or path.suffix == ".js", path


def test_search_index_indexes_the_pages_but_not_the_solutions(edition):
    index = (edition["out"] / "html" / "searchindex.js").read_text()
    assert "zebracorn" in index  # the chapter text is indexed...
    for sentinel in SENTINELS:  # ...the solutions are not
        assert sentinel.lower() not in index.lower()


def test_html_keeps_exercises_and_drops_instructor_links(edition):
    page = (edition["out"] / "html" / "book" / "ch_a.html").read_text()
    assert "my_ignore_value_" in page and "NotImplementedError" in page
    assert "zebracorn" in page
    assert "example-org/instructor-repo" not in page
    assert "mybinder" not in page


def test_stubbed_and_check_cells_have_no_outputs(edition):
    for name, report in edition["reports"].items():
        nb = _student(edition, str(name))
        by_id = {c.get("id"): c for c in nb.cells}
        assert report.stubbed_cells
        for cell_id in report.stubbed_cells + report.cleared_check_cells:
            assert by_id[cell_id].outputs == []
        # other cells keep their outputs
        assert any(c.cell_type == "code" and c.outputs for c in nb.cells)


def test_student_notebooks_run_up_to_the_first_exercise(edition):
    for name, report in edition["reports"].items():
        nb = _execute(_student(edition, str(name)), edition["out"], allow_errors=True)
        code = [c for c in nb.cells if c.cell_type == "code"]
        first_stub = next(i for i, c in enumerate(code) if c.get("id") in report.stubbed_cells)
        errors = [(i, o) for i, c in enumerate(code) for o in c.outputs if o.output_type == "error"]
        # nothing fails before the first exercise, and the first failure is "not
        # implemented" (later cells may fail on what the stub did not define)
        assert all(i >= first_stub for i, _ in errors), errors
        assert not errors or errors[0][1].ename == "NotImplementedError", errors
        first_check = next(
            i for i, c in enumerate(code) if c.get("id") in report.cleared_check_cells
        )
        check_text = "".join(o.get("text", "") for o in code[first_check].outputs)
        first_error_at_stub = bool(errors) and errors[0][0] == first_stub
        assert first_error_at_stub or "Not implemented yet" in check_text, (name, check_text)


def test_pasting_the_solutions_back_passes_every_check(edition):
    for name, report in edition["reports"].items():
        student = _student(edition, str(name))
        original = {c.get("id"): c for c in edition["instructor"][str(name)].cells}
        for cell in student.cells:
            if cell.get("id") in report.stubbed_cells:
                cell.source = original[cell.get("id")].source
        nb = _execute(student, edition["out"], allow_errors=False)
        for cell in nb.cells:
            if cell.get("id") in report.cleared_check_cells:
                text = "".join(o.get("text", "") for o in cell.outputs)
                assert CHECK_PASSED.search(text), (name, text)


def test_cli_refuses_a_folder_with_other_files(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit):
        se.main([str(tmp_path), "--no-html"])
    assert "holds other files" in capsys.readouterr().err


def test_cli_writes_notebooks_only(edition, tmp_path, capsys):
    out = tmp_path / "nb_only"
    assert se.main([str(out), "--no-html", "--root", str(edition["root"])]) == 0
    assert (out / "notebooks" / "ch_b.ipynb").exists() and not (out / "html").exists()
    assert "2 solution cell(s) stubbed" in capsys.readouterr().out


def test_keep_marked_code_for_grading_tools(edition, tmp_path):
    out = tmp_path / "for_nbgrader"
    assert se.main([str(out), "--keep-marked-code", "--root", str(edition["root"])]) == 0
    assert not (out / "html").exists()
    text = (out / "notebooks" / "ch_a.ipynb").read_text()
    assert "### BEGIN SOLUTION" in text and "SENTINEL_CODE_A" in text  # left for the tool
    for sentinel in ("SENTINEL_GATED_MD_A", "SENTINEL_MD_SOLUTION_A", "cases pass"):
        assert sentinel not in text
    nb_b = nbformat.read(out / "notebooks" / "ch_b.ipynb", as_version=4)
    outputs = json.dumps([c.get("outputs", []) for c in nb_b.cells])
    assert "SENTINEL_OUTPUT_B" not in outputs and "Passed." not in outputs


# ------------------------------------------------------------- the real book


REAL_NOTEBOOKS = se.book_notebooks(ROOT / "book")


def _regions(source: str) -> list[str]:
    return re.findall(r"### BEGIN SOLUTION\n(.*?)\n[ \t]*### END SOLUTION", source, flags=re.S)


@pytest.mark.parametrize(
    "path", REAL_NOTEBOOKS, ids=[str(p.relative_to(ROOT)) for p in REAL_NOTEBOOKS]
)
def test_real_notebook_student_copy_has_no_solutions(path):
    nb = nbformat.read(path, as_version=4)
    student, report = se.strip_notebook(nb, str(path))
    text = json.dumps(student)
    sources = "\n".join(c.source for c in student.cells)
    assert "BEGIN SOLUTION" not in sources and "END SOLUTION" not in sources
    assert not re.search(r"\{solution(-start|-end)?\}", sources)
    for cell in nb.cells:
        if cell.cell_type == "code":
            for body in _regions(cell.source):
                if body.strip():
                    assert body not in text, f"a solution of {path} leaks"
    for cell in student.cells:
        if cell.get("id") in report.stubbed_cells + report.cleared_check_cells:
            assert cell.outputs == []
    # Pasting the solutions back gives exactly the instructor's code, which nbval runs
    # (and whose check cells must print a pass).
    original = {c.get("id"): c for c in nb.cells}
    for cell in student.cells:
        if cell.get("id") in report.stubbed_cells:
            cell.source = original[cell.get("id")].source
    assert [c.source for c in student.cells if c.cell_type == "code"] == [
        c.source for c in nb.cells if c.cell_type == "code"
    ]
    # Where the instructor notebook is executed, its checks print a pass.
    for cell in nb.cells:
        if cell.get("id") in report.cleared_check_cells and cell.get("outputs"):
            text = "".join(o.get("text", "") for o in cell.outputs)
            assert CHECK_PASSED.search(text), (path, cell.source, text)


REAL_WITH_EXERCISES = [
    p for p in REAL_NOTEBOOKS if se.strip_notebook(nbformat.read(p, as_version=4))[1].stubbed_cells
]


@pytest.mark.parametrize(
    "path", REAL_WITH_EXERCISES, ids=[str(p.relative_to(ROOT)) for p in REAL_WITH_EXERCISES]
)
def test_real_student_notebook_runs_up_to_its_first_exercise(path):
    student, report = se.strip_notebook(nbformat.read(path, as_version=4), str(path))
    code_ids = [c.get("id") for c in student.cells if c.cell_type == "code"]
    first_stub = code_ids.index(report.stubbed_cells[0])
    later_checks = [
        code_ids.index(i) for i in report.cleared_check_cells if code_ids.index(i) > first_stub
    ]
    stop = later_checks[0] if later_checks else first_stub
    keep_ids = set(code_ids[: stop + 1])
    last = max(i for i, c in enumerate(student.cells) if c.get("id") in keep_ids)
    student.cells = student.cells[: last + 1]
    nb = _execute(student, path.parent, allow_errors=True)
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [(i, o) for i, c in enumerate(code) for o in c.outputs if o.output_type == "error"]
    assert all(i >= first_stub for i, _ in errors), errors
    assert not errors or errors[0][1].ename == "NotImplementedError", errors
    if not errors:
        text = "".join(o.get("text", "") for o in code[stop].outputs)
        assert "Not implemented yet" in text, text


def test_real_markdown_pages_strip_cleanly():
    for path in sorted((ROOT / "book").rglob("*.md")):
        if "_build" in path.parts:
            continue
        out = se.strip_markdown_file(path.read_text(encoding="utf-8"), str(path))
        if path.name != "instructors.md":
            assert not re.search(r"^[`:]{3,}\{solution", out, flags=re.M), path
